"""The NCCL path's logic, on CPU: direction routes, batches, and no host read of the loss weights.

What only NCCL can show (its streams, its coalesced launches) runs in
``tests/comm/test_cuda_paths.py`` on a GPU. What these tests pin down on CPU:

- each direction between two ranks can go over a group of its own
  (``comm/groups.py``): the channel sends over one and receives over the
  other, the groups are made in one global order (a 3-rank ring would deadlock
  otherwise), and a pipeline routed through them trains exactly as the unsplit
  model;
- back-to-back sends go in one batch, receives never (a batched receive
  completes with its whole batch, which would deadlock 1F1B);
- ``TokenMeanLoss`` computes its weights without reading a tensor on the host
  (checked on fake CUDA tensors, where any such read raises).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import pipeline_ext as pe
from loopback_pg import Loopback
from models import build, loss_fn, make_batch, run_stages, TOL
from mp_utils import no_complaints
from pipeline_ext import schedules as S
from pipeline_ext.comm.transport import DistChannel
from pipeline_ext.runtime.local import LocalChannel
from pipeline_ext.comm.groups import matches_by_order, message_pairs


def test_message_pairs_are_both_directions_of_every_boundary_between_ranks():
    assert message_pairs([0, 1]) == [(0, 1), (1, 0)]
    assert message_pairs([0, 1, 2, 0, 1, 2]) == [(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)]  # a ring
    assert message_pairs([0, 1, 1, 0]) == [(0, 1), (1, 0)]  # V: the turn stays on rank 1
    assert message_pairs([0]) == []


def test_only_nccl_groups_need_direction_groups():
    assert not matches_by_order(None, torch.device("cpu"))
    # Not initialised: no backend to ask, so no routes (a CPU-only default group never needs them).
    assert not matches_by_order(None, torch.device("cuda", 0))


def test_a_route_sends_over_one_group_and_receives_over_the_other():
    own, out, back = Loopback(), Loopback(), Loopback()
    channel = DistChannel(own, "cpu", num_stages=2)
    channel.set_route(1, out, 1, back, 1)
    sent = torch.arange(6.0)
    channel.send([sent], 1, 3)[0].wait(5.0, "send")
    assert len(out.sent) == 1 and torch.equal(out.sent[0], sent.view(torch.uint8)) and not own.sent
    back.wire[3] = [torch.full((6,), 7.0).view(torch.uint8)]  # what the peer sent over its own direction
    layout = channel.send([sent], 1, 4)[1]
    got = channel.recv(layout, 1, 3).wait(5.0, "recv")
    assert torch.equal(got[0], torch.full((6,), 7.0))
    assert 3 not in own.wire or not own.wire[3]


def test_a_route_is_checked():
    channel = DistChannel(Loopback(), "cpu", num_stages=2)
    with pytest.raises(ValueError, match="send_peer 0 is not another rank"):
        channel.set_route(1, Loopback(), 0, Loopback(), 1)
    with pytest.raises(ValueError, match="peer 0 is not another rank"):
        channel.set_route(0, Loopback(), 1, Loopback(), 1)


def test_batches_nest_and_issue_at_once_where_the_backend_does_not_coalesce():
    pg = Loopback()
    channel = DistChannel(pg, "cpu", num_stages=2)
    assert not channel.batches  # Gloo (and CPU tensors) never coalesce
    with channel.batch():
        with channel.batch():
            handle, layout = channel.send([torch.ones(3)], 1, 0)
            assert channel._pg.batch_depth == 2
        handle.wait(5.0, "send inside a batch")  # issued already: nothing waits for the batch's end
    assert channel._pg.batch_depth == 0
    with pytest.raises(RuntimeError, match="no batch is open"):
        channel._pg.end_batch()
    with pytest.raises(KeyError), channel.batch():  # an error inside a batch still closes it
        raise KeyError("boom")
    assert channel._pg.batch_depth == 0


# -- the executor batches back-to-back sends, never receives -----------------------------------
def _two_sends_in_a_row() -> S.Schedule:
    """GPipe on 2 ranks with rank 0's two sends written back to back (a hand-written lowered schedule)."""
    return S.Schedule(
        [
            [S.Action.parse(a) for a in "0F0 0F1 0SEND_F0 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1".split()],
            [S.Action.parse(a) for a in "1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1".split()],
        ],
        [0, 1],
        2,
        "two_sends",
    )


def test_back_to_back_sends_go_in_one_batch_and_receives_never(monkeypatch):
    events: dict[int, list[str]] = {0: [], 1: []}
    depth = {0: 0, 1: 0}
    send, recv = LocalChannel.send, LocalChannel.recv

    @contextlib.contextmanager
    def batch(self):
        depth[self.rank] += 1
        events[self.rank].append("open")
        try:
            yield
        finally:
            depth[self.rank] -= 1
            events[self.rank].append("close")

    def recording_send(self, tensors, peer, tag, owned=False):
        events[self.rank].append("send in batch" if depth[self.rank] else "send")
        return send(self, tensors, peer, tag, owned)

    def recording_recv(self, peer, tag):
        events[self.rank].append("recv in batch" if depth[self.rank] else "recv")
        return recv(self, peer, tag)

    monkeypatch.setattr(LocalChannel, "batch", batch, raising=False)
    monkeypatch.setattr(LocalChannel, "send", recording_send)
    monkeypatch.setattr(LocalChannel, "recv", recording_recv)
    modules = build("mlp", 2)
    pipe = pe.Pipe(torch.nn.Sequential(*modules), balance=[1, 1], devices=["cpu", "cpu"], chunks=2,
                   schedule=_two_sends_in_a_row())
    x, y = make_batch("mlp", 8)
    loss = pipe.step(x, target=y, loss_fn=loss_fn)
    ref = build("mlp", 2)
    ref_loss = loss_fn(run_stages(ref, x), y)
    ref_loss.backward()
    assert torch.allclose(loss, ref_loss, **TOL)
    for got, want in zip([p for m in modules for p in m.parameters()], [p for m in ref for p in m.parameters()]):
        assert torch.allclose(got.grad, want.grad, **TOL)
    assert events[0].count("open") == 1 and "send in batch" in events[0]
    assert events[0][events[0].index("open"):events[0].index("close") + 1] == ["open", "send in batch",
                                                                               "send in batch", "close"]
    assert "open" not in events[1]  # rank 1's sends are apart, each after its own B
    assert not [e for r in events for e in events[r] if e == "recv in batch"]


# -- direction groups over Gloo: made in one order on a ring, exact ---------------------------
def _ring_through_direction_groups(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from pipeline_ext.comm.groups import DirectionGroups

    num_stages = 2 * world  # interleaved 1F1B: stage s on rank s % world, so the last rank sends to rank 0
    modules, ref = build("mlp", num_stages), build("mlp", num_stages)
    mine = [s for s in range(num_stages) if s % world == rank]
    sched = pe.ScheduleInterleaved1F1B([pe.PipelineStage(modules[s], s, num_stages, "cpu") for s in mine], world,
                                       loss_fn=loss_fn, transport="gloo")
    groups = DirectionGroups(None, torch.device("cpu"))
    batches, batch = [], dist.batch_isend_irecv  # each new direction is connected by one message, in its direction

    def counted(ops):
        batches.append([(op.op.__name__, op.peer) for op in ops])
        return batch(ops)

    dist.batch_isend_irecv = counted
    try:
        groups.route(sched._session.channel, sched.schedule.stage_to_rank)
        groups.route(sched._session.channel, sched.schedule.stage_to_rank)  # set again: no new groups
    finally:
        dist.batch_isend_irecv = batch
    bad = [] if len(groups) == 4 else [f"rank {rank}: {len(groups)} direction groups, expected 4"]
    before, after = (rank - 1) % world, (rank + 1) % world
    want = sorted([[("isend", after)], [("irecv", after)], [("isend", before)], [("irecv", before)]])
    if sorted(batches) != want:
        bad.append(f"rank {rank}: the direction groups were connected by {batches}, expected {want}")
    opt = torch.optim.SGD([p for s in mine for p in modules[s].parameters()], lr=0.1)
    ref_opt = torch.optim.SGD([p for m in ref for p in m.parameters()], lr=0.1)
    for step in range(2):
        x, y = make_batch("mlp", 4 * world + 1, seed=step)
        opt.zero_grad()
        sched.step(*((x,) if rank == 0 else ()), target=y if num_stages - 1 in mine else None)
        opt.step()
        ref_opt.zero_grad()
        loss_fn(run_stages(ref, x), y).backward()
        ref_opt.step()
    bad += [f"rank {rank} stage {s} param {i} differs after 2 steps"
            for s in mine for i, (p, q) in enumerate(zip(modules[s].parameters(), ref[s].parameters()))
            if not torch.allclose(p, q, **TOL)]
    dist.barrier()
    return bad


@pytest.mark.timeout(120)
def test_a_ring_routed_through_direction_groups_trains_exactly():
    no_complaints(_ring_through_direction_groups, 3, timeout=100)


# -- no host read in the loss weights ---------------------------------------------------------
def test_token_mean_loss_weights_are_never_read_on_the_host():
    """Under FakeTensorMode every read of a tensor's value on the host (.item, .tolist, float, bool)
    raises: the weights of GPU targets must be computed, scaled and applied on the device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pipeline_ext.runtime.microbatch import loss_weights

    loss = pe.TokenMeanLoss()
    with FakeTensorMode():
        targets = [torch.randint(-1, 5, (2, 7), device="cuda") for _ in range(3)]
        weights = loss_weights(loss, [2, 2, 2], targets)
        logits = torch.randn(2, 7, 5, device="cuda")  # (no autograd: its engine needs a real CUDA device)
        scaled = loss(logits, targets[0]) * weights[0]  # what the last stage backpropagates
        assert len(weights) == 3 and all(w.device.type == "cuda" and w.dim() == 0 for w in weights)
        assert scaled.device.type == "cuda" and scaled.dtype == torch.float32
        loss.combine([scaled, scaled, scaled])


def test_token_mean_weights_are_the_token_shares_and_zero_without_tokens():
    loss = pe.TokenMeanLoss(ignore_index=-100)
    targets = [torch.tensor([1, -100, 2]), torch.tensor([-100, -100, -100]), torch.tensor([3, 4, 5])]
    assert torch.allclose(loss.microbatch_weights(targets), torch.tensor([0.4, 0.0, 0.6]))
    empty = [torch.full((3,), -100)] * 2
    assert torch.equal(loss.microbatch_weights(empty), torch.zeros(2))
