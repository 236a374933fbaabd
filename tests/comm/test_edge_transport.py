"""The transport chosen per edge (comm/transport/decide.py, [Note: transport per edge]).

From plain descriptions (``setup._Setup._describe``): every branch of
``decide_edges`` (one host, two hosts, one hostname on two hosts, a rank
without an inbox, rings of different sizes), the group's kind, the summary
line, the digest the step records carry and the agreement's check of it,
``PerEdgeChannel``'s routing, and the test-only host identity
(``$PIPELINE_EXT_TEST_HOST``). Then a real 2 x 2 job: four Gloo ranks on
this machine, ranks 2 and 3 on a simulated second host, every schedule's
steps against the unsplit model with shared memory inside each host and
Gloo between them, the summary said once, nothing left in /dev/shm.
"""
from __future__ import annotations

import os
import re
import warnings

import pytest
import torch

from models import build, loss_fn, make_batch, run_stages, TOL
from mp_utils import run_ranks
from pipeline_ext.comm import transport as T
from pipeline_ext.comm.transport import setup
from pipeline_ext.comm.agreement import StepAgreementError, StepRecord, agree
from pipeline_ext.comm.transport import (HOST_ENV, PerEdgeChannel, decide_edges, edges_digest, edges_kind,
                                         edges_summary)
from pipeline_ext.runtime.channel import ChannelError

A = "a|boot|(1, 2)|4026531836"
B = "b|boot2|(3, 4)|4026531999"
A_OTHER_NS = "a|boot|(1, 5)|4026532000"  # one hostname, another /dev/shm and PID namespace (a container)


def _d(host: str = A, **kw) -> dict:
    """A CPU stage's description with ``kw`` changed."""
    return {"host": host, "ring_bytes": 8 << 20, "segment": "/proc/1/fd/3", "error": "", **kw}


def _table(hosts: list[str], **per_rank) -> dict:
    everyone = {r: _d(h, **per_rank.get(f"r{r}", {})) for r, h in enumerate(hosts)}
    tables = [decide_edges(r, everyone[r], {p: e for p, e in everyone.items() if p != r}) for r in everyone]
    assert all(t == tables[0] for t in tables), "every rank computes the same table"
    return tables[0]


def test_one_host_is_shared_memory_on_every_edge():
    table = _table([A, A, A])
    assert table == {(0, 1): ("shm", ""), (0, 2): ("shm", ""), (1, 2): ("shm", "")}
    assert edges_kind(table) == "shm"


def test_two_hosts_of_two_ranks_share_memory_inside_each_host_and_the_process_group_between():
    table = _table([A, A, B, B])
    assert {e for e, (k, _) in table.items() if k == "shm"} == {(0, 1), (2, 3)}
    assert table[(1, 2)] == ("process_group", "hosts a|b")
    assert edges_kind(table) == "per_edge"
    assert edges_summary(table, [(0, 1), (2, 1), (2, 3)]) == "0<->1 shm, 1<->2 process_group (hosts a|b), 2<->3 shm"


def test_a_host_is_not_its_hostname_alone():
    table = _table([A, A_OTHER_NS])
    assert table == {(0, 1): ("process_group", "hosts a|a (other boot or namespace)")}
    assert edges_kind(table) == "process_group"


def test_a_rank_without_an_inbox_takes_the_process_group_on_its_edges_only():
    table = _table([A, A, A], r2={"segment": "", "error": "no space left in /dev/shm"})
    assert table[(0, 1)] == ("shm", "")
    assert table[(0, 2)] == table[(1, 2)] == ("process_group", "no shared-memory inbox (rank 2: no space left in /dev/shm)")


def test_rings_of_different_sizes_on_a_shared_memory_edge_are_an_error_across_hosts_they_do_not_matter():
    with pytest.raises(ChannelError, match="PIPELINE_EXT_SHM_RING_BYTES differs between the ranks"):
        _table([A, A], r1={"ring_bytes": 1024})
    assert _table([A, B], r1={"ring_bytes": 1024})[(0, 1)][0] == "process_group"


def test_the_digest_says_the_kinds_and_is_zero_before_the_setup():
    mixed, one = _table([A, A, B, B]), _table([A, A, A, A])
    assert edges_digest({}) == edges_digest(None) == 0
    assert edges_digest(mixed) == edges_digest(_table([A, A, B, B])) != edges_digest(one) != 0
    # the reasons are words for people; the digest is what was chosen
    assert edges_digest({(0, 1): ("process_group", "x")}) == edges_digest({(0, 1): ("process_group", "y")})


def _records(edges: list[int]) -> list[StepRecord]:
    return [StepRecord(rank=r, step=3, kind=1, schedule="1F1B", schedule_key=7, n_microbatches=4, num_stages=4,
                       has_loss=True, edges=e) for r, e in enumerate(edges)]


def test_the_step_records_check_every_rank_settled_the_same_table():
    agree(_records([5, 5, 5, 5]), 0, 3)
    agree(_records([0, 5, 5, 0]), 0, 3)  # a rank not settled yet (its first step failed before a message)
    with pytest.raises(StepAgreementError, match="the ranks settled different transports per edge"):
        agree(_records([5, 5, 6, 5]), 0, 3)
    words = _records([123])[0].encode()
    assert StepRecord.decode(words, 0).edges == 123


class _Fake:
    """Stands for a C++ channel: records the calls it gets."""

    def __init__(self, name: str) -> None:
        self.name, self.calls = name, []
        self.rank, self.size, self.device = 0, 4, torch.device("cpu")

    def __getattr__(self, op):
        peer_at = {"send": 1, "recv": 1, "recv_layout": 0}  # where each operation takes its peer
        return lambda *args: self.calls.append((op, args[peer_at[op]] if op in peer_at else args))


def test_a_per_edge_channel_sends_each_message_on_its_peers_channel():
    shm, pg = _Fake("shm"), _Fake("pg")
    ch = PerEdgeChannel(shm, pg, {1})
    ch.send([torch.ones(1)], 1, 5, None, False, None, False)
    ch.send([torch.ones(1)], 2, 5, None, False, None, False)
    ch.recv(None, 1, 5)
    ch.recv_layout(3, 5)
    ch.begin_step(4)
    ch.notify_failure(4, "boom")
    assert shm.calls == [("send", 1), ("recv", 1), ("begin_step", (4,)), ("notify_failure", (4, "boom"))]
    assert pg.calls == [("send", 2), ("recv_layout", 3), ("begin_step", (4,))]  # a process group cannot be woken


def test_the_summary_is_said_once_by_group_rank_0_and_only_when_an_edge_leaves_the_host():
    class Group:
        def __init__(self, rank: int) -> None:
            self._rank = rank

        def rank(self) -> int:
            return self._rank

    mixed = T.Settled("per_edge", None, edges=_table([A, A, B, B]))
    one = T.Settled("shm", None, edges=_table([A, A, A, A]))
    zero, other = Group(0), Group(1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        line = T.announce_edges(zero, mixed, [(0, 1), (1, 2), (2, 3)])
        assert T.announce_edges(zero, mixed, [(0, 1), (1, 2), (2, 3)]) == ""  # once
        assert T.announce_edges(other, mixed, [(0, 1), (1, 2), (2, 3)]) == ""  # rank 0 says it
        assert T.announce_edges(Group(0), one, [(0, 1)]) == ""  # one host: nothing to say
        assert T.announce_edges(Group(0), None, [(0, 1)]) == ""  # "process_group": nothing exchanged
    assert line == "pipeline_ext: transport per edge: 0<->1 shm, 1<->2 process_group (hosts a|b), 2<->3 shm"
    assert [str(w.message) for w in said] == [line]


def test_the_simulated_host_splits_a_host_and_is_named(monkeypatch):
    monkeypatch.delenv(HOST_ENV, raising=False)
    real = setup._host_id()
    monkeypatch.setenv(HOST_ENV, "b")
    simulated = setup._host_id()
    name, _, rest = real.partition("|")
    assert simulated == f"{name}~b|{rest}" != real


# -- a real 2 x 2 job ----------------------------------------------------------------------------------------

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zb_h2", "zbv", "dualpipev", "v_half",
             "v_min"]
MULTI_STAGE = {"interleaved_1f1b", "looped_bfs", "zbv", "dualpipev", "v_half", "v_min"}
STEPS = 2


def _two_by_two(rank: int, world: int) -> dict:
    """Ranks 2, 3 on a second (simulated) host; every schedule: STEPS optimizer steps vs the unsplit model."""
    import pipeline_ext as pe
    from pipeline_ext import schedules as S

    before = os.environ.get(HOST_ENV)
    os.environ[HOST_ENV] = "hostB" if rank >= 2 else "hostA"
    out: dict = {"bad": [], "edges": {}, "kinds": set(), "said": [], "leftover": 0}
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for name in SCHEDULES:
                v = 2 if name in MULTI_STAGE else 1
                ns, m = world * v, 2 * world
                modules, ref = build("blocks", ns), build("blocks", ns)
                placement = S.build(name, world, m, stages_per_rank=v).stage_to_rank
                mine = [s for s, r in enumerate(placement) if r == rank]
                stages = [pe.PipelineStage(modules[s], s, ns, "cpu") for s in mine]
                sched = pe.get_schedule_class(name)(stages if v > 1 else stages[0], m, loss_fn=loss_fn,
                                                    timeout=60.0)
                opt = torch.optim.SGD([p for s in mine for p in modules[s].parameters()], lr=0.1, momentum=0.9)
                ref_opt = torch.optim.SGD([p for s in ref for p in s.parameters()], lr=0.1, momentum=0.9)
                for step in range(STEPS):
                    x, y = make_batch("blocks", 4 * m + 1, seed=step)
                    losses: list = []
                    opt.zero_grad()
                    sched.step(*((x,) if 0 in mine else ()), target=y if ns - 1 in mine else None, losses=losses)
                    ref_opt.zero_grad()
                    ref_loss = loss_fn(run_stages(ref, x), y)
                    ref_loss.backward()
                    for s in mine:
                        for i, (p, q) in enumerate(zip(modules[s].parameters(), ref[s].parameters())):
                            if not torch.allclose(p.grad, q.grad, **TOL):
                                out["bad"].append(f"{name} step {step} stage {s} param {i}: grad differs")
                    if losses:
                        sizes = [len(c) for c in torch.tensor_split(torch.arange(4 * m + 1), m)]
                        loss = sum(l * n / (4 * m + 1) for l, n in zip(losses, sizes))
                        if not torch.allclose(loss, ref_loss, **TOL):
                            out["bad"].append(f"{name} step {step}: loss {loss} vs {ref_loss}")
                    opt.step()
                    ref_opt.step()
                for s in mine:
                    for i, (p, q) in enumerate(zip(modules[s].parameters(), ref[s].parameters())):
                        if not torch.allclose(p, q, **TOL):
                            out["bad"].append(f"{name} stage {s} param {i} differs after {STEPS} steps")
                channel = sched._session.channel
                out["edges"][name] = sched.transport_per_edge
                out["kinds"].add((channel.transport, type(channel._pg).__name__))
                unexpected = getattr(channel._pg, "unexpected", None)
                out["leftover"] += unexpected() if unexpected is not None else 0
        out["said"] = [str(w.message) for w in said if "transport per edge" in str(w.message)]
    finally:
        if before is None:
            os.environ.pop(HOST_ENV, None)
        else:
            os.environ[HOST_ENV] = before
    return out


def _dev_shm() -> set[str]:
    """What of ours is in /dev/shm (the rank pool's own semaphores, ``sem.mp-*``, are multiprocessing's)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith("pipeline_ext")} if os.path.isdir("/dev/shm") else set()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_two_by_two_job_shares_memory_inside_each_host_and_is_exact():
    found = _dev_shm()
    res = {r: v for r, (_, v) in run_ranks(_two_by_two, 4, timeout=280).items()}
    assert not [b for r in res.values() for b in r["bad"]], [b for r in res.values() for b in r["bad"]][:20]
    cross = "process_group (hosts " + "|".join(sorted({f"{os.uname().nodename}~hostA", f"{os.uname().nodename}~hostB"}))
    for name in SCHEDULES:
        edges = res[0]["edges"][name]
        assert all(res[r]["edges"][name] == edges for r in res), name  # every rank took the same
        assert edges["0<->1"] == "shm" and edges["2<->3"] == "shm", (name, edges)
        assert edges["1<->2"].startswith(cross), (name, edges)
        assert edges.get("0<->3", cross).startswith(cross), (name, edges)  # interleaved: the wrap-around edge
    # rank 0 has a same-host peer and peers elsewhere: both channels, each message on its peer's
    assert res[0]["kinds"] == {("per_edge", "PerEdgeChannel")}
    assert all(r["leftover"] == 0 for r in res.values())
    # said once per distinct table of edges (two: with and without the interleaved wrap-around), by rank 0 only
    assert sorted(res[0]["said"]) == sorted({f"pipeline_ext: transport per edge: {', '.join(f'{e} {k}' for e, k in res[0]['edges'][n].items())}"
                                             for n in SCHEDULES}), res[0]["said"]
    assert all(not res[r]["said"] for r in (1, 2, 3))
    assert _dev_shm() == found


def test_the_trace_report_says_which_edge_uses_what():
    from pipeline_ext import schedules as S
    from pipeline_ext.runtime.trace import TraceReport

    sch = S.build("1f1b", 4, 4)
    edges = {"0<->1": "shm", "1<->2": "process_group (hosts a|b)", "2<->3": "shm"}
    report = TraceReport(sch, [S.simulate(sch).timeline], transport=edges)
    assert "transport per edge: 0<->1 shm, 1<->2 process_group (hosts a|b), 2<->3 shm" in report.summary()
    assert report.chrome_trace()["traceEvents"][0]["args"]["transport"] == edges


def _error_mid_step(rank: int, world: int) -> str:
    """2 x 2 job: rank 1's module raises in step 1 (microbatch 2's forward); what each rank's step raises."""
    import pipeline_ext as pe

    os.environ[HOST_ENV] = "hostB" if rank >= 2 else "hostA"  # a fresh process (isolated): nothing to put back
    modules = build("mlp", world)
    forwards = [0]

    def flaky(module, args):
        forwards[0] += 1
        if forwards[0] == 4 + 3:  # step 0 ran 4 forwards
            raise ValueError("boom in the user's module")

    if rank == 1:
        modules[1].register_forward_pre_hook(flaky)
    sched = pe.Schedule1F1B(pe.PipelineStage(modules[rank], rank, world, "cpu"), 4, loss_fn=loss_fn, timeout=8.0)
    for i in range(2):
        x, y = make_batch("mlp", 8, seed=i)
        try:
            sched.step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None)
        except Exception as exc:  # noqa: BLE001 - the message is what the test checks
            return f"{i}:{type(exc).__name__}: {exc}" + "".join(f"\n{n}" for n in getattr(exc, "__notes__", ()))
    return "no error"


@pytest.mark.isolated
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_failed_step_is_told_at_once_over_shared_memory_edges_and_at_the_timeout_across_hosts():
    """Rank 1 fails mid-step: rank 0 (its host) hears why at once; rank 2 (the other host, over Gloo) cannot be
    woken, its wait ends at its timeout or when rank 1's process ends, naming rank 1 and the hosts; rank 3 then
    hears rank 2's failure at once over their shared memory."""
    said = {r: v for r, (_, v) in run_ranks(_error_mid_step, 4, timeout=80).items()}
    assert said[1].startswith("1:ValueError: boom in the user's module"), said
    assert "failed on rank 1 in F of stage 1, microbatch 2: ValueError: boom" in said[0], said
    assert "timed out" not in said[0] and said[0].startswith("1:ChannelError"), said
    assert said[2].startswith("1:ChannelTimeout" if "timed out" in said[2] else "1:ChannelError"), said
    assert "with peer rank 1 in step 1" in said[2], said
    assert "pipeline_ext: the ranks' hosts: ranks 0, 1 on host" in said[2], said
    # Which microbatch rank 3 waits on depends on how many of rank 1's sends crossed hosts before it failed.
    assert re.match(r"1:ChannelError: rank 3 waiting on RECV_F of stage 3 microbatch [0-3] with peer rank 2 in "
                    r"step 1: step 1 failed on rank 2", said[3]), said
