"""Same-host shared-memory transport (comm/transport/, csrc/runtime/shm_channel.*): choice and crashes.

Messages themselves are tested under both transports by test_channels.py,
test_distributed.py, test_robustness.py and test_step_agreement.py (the
``transport`` fixture in conftest.py).
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from torch import nn

import pipeline_ext as pe
from models import build, loss_fn, make_batch, TOL
from mp_utils import no_complaints, run_ranks
from pipeline_ext.runtime._ext import _C
from pipeline_ext.comm.transport import TRANSPORT_ENV, make_channel, requested_transport

SEGMENT_PREFIX = "pipeline_ext_shm."


def _segments_of(pids: set[int]) -> list[str]:
    """Inbox names in /dev/shm created by these processes (other test runs may share the machine)."""
    return [n for n in os.listdir("/dev/shm") if n.startswith(SEGMENT_PREFIX) and int(n.split(".")[1]) in pids]


def test_transport_argument_and_environment(monkeypatch):
    monkeypatch.delenv(TRANSPORT_ENV, raising=False)
    assert requested_transport(None) == "auto"
    monkeypatch.setenv(TRANSPORT_ENV, "SHM")
    assert requested_transport(None) == "shm"
    assert requested_transport("gloo") == "process_group"  # the argument wins over the environment
    monkeypatch.setenv(TRANSPORT_ENV, "tcp")
    with pytest.raises(ValueError, match=r"\$PIPELINE_EXT_TRANSPORT='tcp': the transport must be one of auto, process_group, shm"):
        requested_transport(None)
    with pytest.raises(ValueError, match="transport='shm' moves CPU tensors; stages on cuda:0"):
        make_channel(None, "cuda:0", 2, "shm")


def _choices(rank: int, world: int) -> dict:
    """auto on one host is shared memory; with rank 1 pretending to be elsewhere, Gloo, and 'shm' an error."""
    import torch.distributed as dist

    import pipeline_ext.comm.transport.setup as transport

    out = {"auto": make_channel(None, "cpu", 2, "auto").connect()}
    if rank == 1:
        transport._host_id = lambda: "elsewhere|boot|dev|ns"
    group = dist.new_group([0, 1])
    out["other_host"] = make_channel(group, "cpu", 2, "auto").connect()
    try:
        make_channel(group, "cpu", 2, "shm").connect()
        out["forced"] = "no error"
    except RuntimeError as exc:
        out["forced"] = str(exc)
    # an inbox that cannot be made on one rank (a small /dev/shm): every rank falls back to Gloo together
    if rank == 1:
        def no_room(*args):
            raise _C.ChannelError("cannot allocate 16777216 bytes in /dev/shm: No space left on device")

        transport._C = type("NoShm", (), {"ShmChannel": staticmethod(no_room), "wait_work": staticmethod(_C.wait_work),
                                         "ProcessGroupChannel": _C.ProcessGroupChannel})
    small = dist.new_group([0, 1])
    out["no_room"] = make_channel(small, "cpu", 2, "auto").connect()
    transport._C = _C
    # Gloo underneath the fallback really moves the data
    ch = make_channel(group, "cpu", 2, "auto")
    ch.connect()  # the group's transport, settled above: nothing to wait for
    if rank == 0:
        handle, layout = ch.send([torch.arange(5.0)], 1, 3)
        handle.wait(10.0, "send")
    else:
        layout = _C.layout_of([torch.zeros(5)])
        out["data"] = ch.recv(layout, 0, 3).wait(10.0, "recv")[0].tolist()
    return out


@pytest.mark.timeout(60)
def test_auto_is_shared_memory_on_one_host_and_gloo_across_hosts():
    res = {r: v for r, (_, v) in run_ranks(_choices, 2, timeout=50).items()}
    for rank in (0, 1):
        assert res[rank]["auto"] == "shm"
        assert res[rank]["other_host"] == "process_group"
        assert "transport='shm': group" in res[rank]["forced"] and "cannot use shared memory (hosts:" in res[rank]["forced"]
        assert res[rank]["no_room"] == "process_group"
    assert res[1]["data"] == [0.0, 1.0, 2.0, 3.0, 4.0]


class KillAt(nn.Module):
    """A Linear layer whose process SIGKILLs itself on one call (no cleanup of any kind runs)."""

    def __init__(self, when: int) -> None:
        super().__init__()
        self.lin, self.when, self.calls = nn.Linear(16, 16), when, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.when:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.lin(x)


def _killed(rank: int, world: int, victim: int, pid_dir: str, when: str) -> tuple[list[str], str]:
    with open(os.path.join(pid_dir, str(rank)), "w") as f:
        f.write(str(os.getpid()))
    torch.manual_seed(0)
    modules = build("mlp", world)
    if rank == victim and when == "mid-step":  # 4 microbatches a step: dies in the second step's third forward
        modules[rank] = nn.Sequential(KillAt(when=7), modules[rank])
    stage = pe.PipelineStage(modules[rank], rank, world, "cpu")
    sched = pe.PipelineSchedule(stage, "1f1b", 4, loss_fn=loss_fn, timeout=20.0, transport="shm")
    during = _segments_of({os.getpid()})  # inboxes have no name, ever
    if rank == victim and when == "before-first-step":  # its inbox exists, no peer has mapped it yet
        os.kill(os.getpid(), signal.SIGKILL)
    x, y = make_batch("mlp", 8)
    if when == "mid-step":
        sched.step(x) if rank == 0 else sched.step(target=y)
    try:
        sched.step(x) if rank == 0 else sched.step(target=y)
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return during, f"{type(exc).__name__}: {exc}"
    return during, "no error"


@pytest.mark.isolated
@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("when", ["mid-step", "before-first-step"])
@pytest.mark.parametrize("victim", [0, 1])
def test_sigkill_of_either_rank_leaves_nothing_in_dev_shm_and_is_named(victim, when, tmp_path):
    results = run_ranks(_killed, 2, victim, str(tmp_path), when, timeout=60, expect_errors=True)
    survivor = 1 - victim
    assert results[victim][0] == "died", results[victim]
    status, (during, message) = results[survivor]
    assert status == "ok", message
    assert during == []
    if when == "mid-step":
        assert f"rank {victim} (pid" in message and "exited" in message, message
        assert "ChannelTimeout" not in message and "timed out" not in message, message
    else:  # the survivor's step record finds the connection to it closed, at once
        assert f"with rank {victim}" in message and message.startswith("ChannelError"), message
    pids = {int((tmp_path / str(r)).read_text()) for r in (0, 1)}
    deadline = time.monotonic() + 5  # the survivor's process may still be exiting
    while _segments_of(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _segments_of(pids) == []


def _train(rank: int, world: int, seed: int) -> bool:
    """Two 1F1B steps over shared memory on the default group; whether the gradients are the unsplit model's."""
    modules, ref = build("mlp", world), build("mlp", world)
    stage = pe.PipelineStage(modules[rank], rank, world, "cpu")
    sched = pe.Schedule1F1B(stage, 4, loss_fn=loss_fn, timeout=20.0, transport="shm")
    for i in range(2):
        x, y = make_batch("mlp", 8, seed=seed + i)
        sched.step(x) if rank == 0 else sched.step(target=y)
        loss_fn(nn.Sequential(*ref)(x), y).backward()
    return all(torch.allclose(p.grad, q.grad, **TOL)
               for p, q in zip(modules[rank].parameters(), ref[rank].parameters()))


def _reinit(rank: int, world: int, store: str) -> list[str]:
    """Train, destroy the default group, make it again (same name), train again: the new group gets a
    transport and step numbers of its own."""
    import torch.distributed as dist

    said = [] if _train(rank, world, 0) else ["first group: WRONG gradients"]
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        said += [] if _train(rank, world, 2) else ["second group: WRONG gradients"]
    except Exception as exc:  # noqa: BLE001 - what went wrong is the complaint
        said.append(f"second group: {type(exc).__name__}: {exc}")
    return said


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_default_group_made_again_gets_a_transport_of_its_own(tmp_path):
    no_complaints(_reinit, 2, str(tmp_path / "store"), timeout=50)


def test_hosts_note_says_which_rank_runs_where():
    """What a failed step adds to its error once the transport setup has exchanged every rank's host: each host's
    ranks; two hosts of one hostname (containers, namespaces) told apart by the rest of their identity."""
    from pipeline_ext.comm import transport as T
    from pipeline_ext.comm.transport import setup

    class Group:  # stands for a process group: the key of its registry (weakly held)
        pass

    def settled(hosts: dict) -> Group:
        group = Group()
        T.GroupTransport.of(group)._setups["cpu"] = T.Settled("process_group", None, "hosts", hosts=hosts)
        return group

    two = settled({0: "a|boot1|shm|1", 1: "a|boot1|shm|1", 2: "b|boot2|shm|2"})
    one_name = settled({0: "a|boot|s1|1", 1: "a|boot|s2|2"})
    alone = settled({0: "a|b|s|1", 1: "a|b|s|1"})
    assert T.hosts_note(two) == "pipeline_ext: the ranks' hosts: ranks 0, 1 on host a; rank 2 on host b"
    assert T.hosts_note(one_name) == ("pipeline_ext: the ranks' hosts: rank 0 on host a (boot|s1|1); "
                                      "rank 1 on host a (boot|s2|2)")
    assert T.hosts_note(alone) == "" and T.hosts_note(None) == "" and T.hosts_note(Group()) == ""
    assert setup.GroupTransport.known(Group()) is None  # a lookup makes no registry
