"""NCCL's ordering rules on CPU: the stream model finds the hangs Gloo hides, and the runtime's choices have none.

The model (``pipeline_ext/schedules/nccl_order.py``, rules in ``nccl_streams.py``) plays a lowered schedule on
modelled CUDA streams: one FIFO per (communicator, stream), NCCL's send/receive rendezvous, fences between
streams, host reads. These tests pin what it says about known hangs (torch's looped schedule on one shared
group, pytorch PR 195760; the reason for ``DirectionGroups``), check its rules one by one on hand-built
programs, and sweep every built-in schedule under the runtime's real choices (the whole grid is ``long``).
"""
from __future__ import annotations

import time

import pytest

from pipeline_ext import schedules as S
from pipeline_ext.schedules import Collectives, IssuePolicy, Schedule, ScheduleError, check_fifo_order, model_order
from pipeline_ext.schedules.nccl_streams import Op, World

# pytorch PR 195760's configuration: 2 microbatches, 8 stages on 4 ranks (stages r and r + 4 on rank r), each
# rank running all microbatches through its first stage, then its second (looped BFS). Lowered, rank 0 sends
# 0F0 and 1F0 (PR's notation: microbatch, F, stage) to rank 1, then receives 0F3 from rank 3: our text
# format's 0SEND_F0 0SEND_F1 then 4RECV_F0.
TORCH_195760 = """\
# schedule name=looped_bfs n_microbatches=2 stage_to_rank=0,1,2,3,0,1,2,3
0F0 0SEND_F0 0F1 0SEND_F1 4RECV_F0 4F0 4SEND_F0 4RECV_F1 4F1 4SEND_F1 4RECV_B1 4B1 4SEND_B1 4RECV_B0 4B0 4SEND_B0 0RECV_B1 0B1 0RECV_B0 0B0
1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 5RECV_F0 5F0 5SEND_F0 5RECV_F1 5F1 5SEND_F1 5RECV_B1 5B1 5SEND_B1 5RECV_B0 5B0 5SEND_B0 1RECV_B1 1B1 1SEND_B1 1RECV_B0 1B0 1SEND_B0
2RECV_F0 2F0 2SEND_F0 2RECV_F1 2F1 2SEND_F1 6RECV_F0 6F0 6SEND_F0 6RECV_F1 6F1 6SEND_F1 6RECV_B1 6B1 6SEND_B1 6RECV_B0 6B0 6SEND_B0 2RECV_B1 2B1 2SEND_B1 2RECV_B0 2B0 2SEND_B0
3RECV_F0 3F0 3SEND_F0 3RECV_F1 3F1 3SEND_F1 7RECV_F0 7F0 7RECV_F1 7F1 7B1 7SEND_B1 7B0 7SEND_B0 3RECV_B1 3B1 3SEND_B1 3RECV_B0 3B0 3SEND_B0
"""


def test_torch_195760_order_is_what_the_builders_make():
    built = S.lower(S.build("looped_bfs", 4, 2, 2))
    assert built == Schedule.from_text(TORCH_195760)
    S.validate(built)  # Gloo's world: blocking receives, sends that never block. No hang there.


@pytest.mark.parametrize("discovery", [False, True])
def test_torch_195760_cycles_on_one_shared_group_not_on_direction_groups(discovery):
    """The runtime posts receives ahead; on one communicator a receive posted ahead holds up the sends behind it.

    Rank 0 posts its first receives at its first message action, ahead of 0SEND_F0; the first, 4RECV_F0 (stage
    3's output), needs the pipeline to fill, which needs 0SEND_F0, queued behind it: a cycle through all four
    ranks. One 2-rank communicator per direction (the runtime's ``DirectionGroups``) takes the send out from
    behind the receive.
    """
    sch = Schedule.from_text(TORCH_195760)
    shared = model_order(sch, "shared", discovery=discovery)
    assert not shared.ok and not shared.deadlock.unmatched
    assert shared.deadlock.ranks == [0, 1, 2, 3]
    assert {w.node for w in shared.deadlock.cycle} == {"nccl[pp]"}
    assert any("4RECV_F0" in w.at for w in shared.deadlock.cycle)
    with pytest.raises(ScheduleError, match=r"deadlocks under NCCL's ordering.*cycle: rank \d nccl\[pp\] at recv"):
        check_fifo_order(sch, "shared", discovery=discovery)
    # torch's per-direction groups over the whole pipeline (PR 186173: one for activations, one for gradients)
    # still put rank 0's receive from rank 3 in front of its send to rank 1
    assert not model_order(sch, "forward_backward", discovery=discovery).ok
    report = check_fifo_order(sch, discovery=discovery)  # the runtime's real choices
    assert report.ok and "communicators: direction" in str(report)


def test_torch_issue_order_on_one_group_only_delays_195760():
    """torch issues each receive at its RECV, behind the sends before it (the PR's picture): the receive waits
    there, but each send it waits behind has its receiver at its own head, so the model finds no cycle."""
    sch = Schedule.from_text(TORCH_195760)
    assert model_order(sch, policy=IssuePolicy.torch()).ok
    assert model_order(sch, policy=IssuePolicy.torch("forward_backward")).ok


def _torch_lowered(schedule: Schedule, defer: bool = False) -> Schedule:
    """``schedule`` lowered by torch's own ``_add_send_recv`` (each RECV as early as the senders' order allows),
    with ``defer`` then moved by its ``_defer_recv_ops`` (``defer_pp_recv=True``: each RECV to its consumer,
    a lower rank's receives flushed before its sends to that peer)."""
    torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    add_send_recv = getattr(torch_schedules, "_add_send_recv", None)
    defer_recv_ops = getattr(torch_schedules, "_defer_recv_ops", None)
    if add_send_recv is None or (defer and defer_recv_ops is None):
        pytest.skip("this torch lowers differently")
    order = S.csv_io.torch_order(schedule)
    lowered = add_send_recv(order, lambda s: schedule.stage_to_rank[s], schedule.num_stages)
    if defer:
        lowered = defer_recv_ops(lowered, lambda s: schedule.stage_to_rank[s])
    return S.from_cells([lowered[r] for r in range(schedule.num_ranks)], "compute_comms",
                        schedule.n_microbatches, schedule.name)


def test_torch_lowering_of_195760_under_torch_and_runtime_issue():
    sch = _torch_lowered(S.build("looped_bfs", 4, 2, 2))
    S.validate(sch)
    assert sch.actions[0][:3] == [S.Action.parse(t) for t in ("0F0", "0SEND_F0", "4RECV_F0")]
    assert model_order(sch, policy=IssuePolicy.torch()).ok
    assert not model_order(sch, "shared").ok
    assert check_fifo_order(sch).ok


def test_a_send_holds_its_stream_until_the_receive_is_posted():
    """1F1B on one stream with each receive issued right before its consumer (torch's ``defer_pp_recv``; pytorch
    issue 172668 reports this hang across two nodes): rank 0 sends microbatch 1's activation while rank 1 sends
    microbatch 0's gradient, each receive behind the peer's send. NCCL may hold a send until its receive is
    posted: a cycle. Without the deferral torch's lowering posts rank 1's receive before its send."""
    sch = S.build("1f1b", 2, 2)
    deferred = _torch_lowered(sch, defer=True)
    assert deferred == S.lower(sch)  # here torch's deferral gives our lowering's order
    S.validate(deferred)  # Gloo's world: fine
    report = model_order(deferred, policy=IssuePolicy.torch())
    assert not report.ok
    assert [w.at for w in report.deadlock.cycle] == ["send 0SEND_F1 to rank 1", "send 1SEND_B0 to rank 0"]
    assert model_order(_torch_lowered(sch), policy=IssuePolicy.torch()).ok
    assert check_fifo_order(deferred).ok  # the runtime's receive window and direction groups


@pytest.mark.parametrize("groups,ok", [("direction", True), ("shared", False), ("pair", False)])
def test_why_direction_groups(groups, ok):
    """[Note: why DirectionGroups]: with receives posted ahead, one communicator per pair of ranks puts rank 0's
    receive of a gradient in front of its activation's send, on both ranks at once."""
    report = model_order(S.build("1f1b", 2, 4), groups)
    assert report.ok == ok
    if not ok:
        assert report.deadlock.ranks == [0, 1]
        assert any("0RECV_B0" in w.at for w in report.deadlock.cycle)


# -- the rules, one by one, on hand-built programs -----------------------------------------------------------


def test_collectives_called_in_different_orders_deadlock():
    world = World()
    for rank, order in ((0, "ab"), (1, "ba")):
        for name in order:
            item = world.issue(rank, f"nccl[{name}]", f"all-reduce {name}", after=[world.tail(rank, "compute")],
                               ops=[Op("coll", name, (0, 1), name)])
            world.issue(rank, "compute", f"wait for {name}", after=[item])
    deadlock = world.run()
    assert deadlock is not None and deadlock.ranks == [0, 1]
    assert "nccl[a]" in str(deadlock) and "nccl[b]" in str(deadlock)


def test_collectives_in_one_order_complete():
    world = World()
    for rank in (0, 1, 2):
        for name in "ab":
            item = world.issue(rank, f"nccl[{name}]", name, after=[world.tail(rank, "compute")],
                               ops=[Op("coll", name, (0, 1, 2), name)])
            world.issue(rank, "compute", f"wait for {name}", after=[item])
    assert world.run() is None


def test_messages_pair_by_order_per_communicator():
    world = World()
    for key in ("x", "y"):
        world.issue(0, "nccl[c]", f"send {key}", ops=[Op("send", "c", 1, key)])
    for key in ("y", "x"):
        world.issue(1, "nccl[c]", f"recv {key}", ops=[Op("recv", "c", 0, key)])
    with pytest.raises(ScheduleError, match=r"send #0 from rank 0 to rank 1 is x .* expects y .* by order"):
        world.run()


def test_a_receive_nothing_sends_is_named():
    world = World()
    world.issue(1, "nccl[c]", "recv x", ops=[Op("recv", "c", 0, "x")])
    deadlock = world.run()
    assert deadlock.unmatched and "nothing matches" in str(deadlock)


def test_a_host_read_stops_the_host_from_issuing():
    """Rank 0's host reads what rank 1 sends before it issues the send rank 1 needs first: a cycle through a host."""
    world = World()
    r = world.issue(0, "nccl[1->0]", "recv r", ops=[Op("recv", "1->0", 1, "r")])
    world.block(0, r)
    world.issue(0, "nccl[0->1]", "send s", ops=[Op("send", "0->1", 1, "s")])
    s = world.issue(1, "nccl[0->1]", "recv s", ops=[Op("recv", "0->1", 0, "s")])
    world.issue(1, "compute", "wait for s", after=[s])
    world.issue(1, "nccl[1->0]", "send r", after=[world.tail(1, "compute")], ops=[Op("send", "1->0", 0, "r")])
    deadlock = world.run()
    assert deadlock is not None and not deadlock.unmatched
    assert "rank 0 host" in str(deadlock)


@pytest.mark.parametrize("rank2_receives_first", [True, False])
def test_a_batch_holds_its_stream_until_every_operation_completed(rank2_receives_first):
    """Rank 0's sends to ranks 1 and 2 in one NCCL group, then a receive from rank 2: while rank 2 sends before
    it receives, the group (and the receive behind it) waits for it, and rank 2's send for that receive."""
    world = World()
    world.issue(0, "nccl[c]", "batch", ops=[Op("send", "c", 1, "a"), Op("send", "c", 2, "b")])
    world.issue(0, "nccl[c]", "recv z", ops=[Op("recv", "c", 2, "z")])
    world.issue(1, "nccl[c]", "recv a", ops=[Op("recv", "c", 0, "a")])
    rank2 = [Op("recv", "c", 0, "b"), Op("send", "c", 0, "z")]
    for op in (rank2 if rank2_receives_first else rank2[::-1]):
        world.issue(2, "nccl[c]", f"{op.kind} {op.key}", ops=[op])
    deadlock = world.run()
    assert (deadlock is None) == rank2_receives_first
    if deadlock is not None:
        assert [w.at for w in deadlock.cycle] == ["batch", "send z"]


# -- the API ---------------------------------------------------------------------------------------------


def test_report_api_and_arguments():
    sch = S.build("zb_h1", 2, 2)
    report = check_fifo_order(sch)
    assert report.ok and report.deadlock is None and report.streams > 0 and report.items > 0
    assert model_order(S.lower(sch)).items == report.items  # lowered or not, the same step
    assert check_fifo_order(S.build("gpipe", 1, 3)).ok  # one rank: nothing to order
    assert "3 steps, the first a discovery step" in str(model_order(sch, steps=3, discovery=True))
    with pytest.raises(ValueError, match="groups="):
        IssuePolicy("everything")
    with pytest.raises(ValueError, match="recv_window"):
        IssuePolicy(recv_window=0)
    with pytest.raises(ValueError, match="degrees"):
        Collectives(tp=0)
    with pytest.raises(ValueError, match="steps"):
        model_order(sch, steps=0)
    custom = model_order(sch, lambda src, dst, way: f"{src}{dst}")
    assert custom.ok and "communicators: <lambda>" in str(custom)


def test_collectives_of_every_replica():
    sch = S.build("zbv", 2, 4)
    for dp_kind in ("fsdp", "ddp"):
        assert check_fifo_order(sch, collectives=Collectives(tp=2, dp=2, dp_kind=dp_kind)).ok
    report = model_order(sch, "shared", collectives=Collectives(tp=2))
    assert not report.ok and "0[tp 0, dp 0]" in str(report)


# -- every built-in schedule under the runtime's real choices -----------------------------------------------


def _cases(ps, ms=None):
    """Every (name, p, m, v) a built-in accepts for p in ``ps``, m in p..4p (or ``ms(p)``), v in {1, 2, 4}."""
    for p in ps:
        for m in (ms(p) if ms else range(p, 4 * p + 1)):
            for name in S.available():
                for v in (1, 2, 4):
                    try:
                        yield name, p, m, v, S.build(name, p, m, v)
                    except ScheduleError:
                        continue


def _check_runtime_choices(cases) -> tuple[int, list[str]]:
    """Model each case as the runtime runs it: training and forward-only steps, a discovery step then a known
    one, and for schedules with overlapped pairs also ``overlap=False``. Returns (runs, failures)."""
    runs, failures = 0, []
    for name, p, m, v, sch in cases:
        variants = [("train", sch, IssuePolicy.runtime()), ("forward-only", S.forward_only(sch), IssuePolicy.runtime())]
        if sch.overlapped:
            variants.append(("train, overlap=False", sch, IssuePolicy(overlap=False)))
        for what, s, policy in variants:
            runs += 1
            report = model_order(s, policy=policy, discovery=True, steps=2)
            if not report.ok:
                failures.append(f"{name} p={p} m={m} v={v} ({what}): {report}")
    return runs, failures


def test_builtin_schedules_pass_with_the_runtime_choices_quick():
    runs, failures = _check_runtime_choices(_cases((2, 4), lambda p: (p, 2 * p)))
    assert runs > 50 and not failures, "\n".join(failures)


@pytest.mark.long
@pytest.mark.parametrize("p", [2, 4, 8])
def test_builtin_schedules_pass_with_the_runtime_choices_full_grid(p):
    start = time.perf_counter()
    runs, failures = _check_runtime_choices(_cases((p,)))
    print(f"p={p}: {runs} runs (each a discovery step then a known one) in {time.perf_counter() - start:.1f} s")
    assert not failures, "\n".join(failures)


@pytest.mark.long
def test_builtin_schedules_with_tensor_and_data_parallel_collectives():
    failures = []
    for name, p, m, v, sch in _cases((2, 4), lambda p: (p, 2 * p)):
        for coll in (Collectives(tp=2, dp=2), Collectives(tp=2, dp=2, dp_kind="ddp")):
            report = model_order(sch, collectives=coll, discovery=True, steps=2)
            if not report.ok:
                failures.append(f"{name} p={p} m={m} v={v} {coll}: {report}")
    assert not failures, "\n".join(failures)
