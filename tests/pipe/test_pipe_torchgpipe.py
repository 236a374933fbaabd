"""Pipe follows torchgpipe's conventions (issue 13 gaps); each checked against the unsplit model."""
from __future__ import annotations

import copy
import threading
from collections import OrderedDict

import pytest
import torch
from torch import nn

import pipeline_ext as pe
from pipeline_ext.pipe.lockstep import Lockstep
from pipeline_ext.pipe.partition import balance_by_size, balance_by_time
from models import ATOL, RTOL



def _grads(m):
    return [p.grad.clone() for p in m.parameters()]


def _same(pipe_model, ref, x, make_loss):
    """pipe(x) then backward equals the unsplit model: output and every gradient."""
    out = pipe_model(x)
    make_loss(out).backward()
    ref_out = ref(x)
    make_loss(ref_out).backward()
    torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL)
    return out


class Split(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x), self.b(x)


class Join(nn.Module):
    """Takes the pair as ONE argument (torchgpipe)."""

    def forward(self, pair):
        a, b = pair
        return a * torch.tanh(b)


class Single(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, only):
        (a,) = only
        return (self.fc(a),)


@pytest.mark.parametrize("balance", [[3], [1, 2], [2, 1]])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_tuple_is_passed_as_one_argument_within_and_between_stages(balance, checkpoint):
    torch.manual_seed(0)
    model = nn.Sequential(Split(), Join(), nn.Linear(4, 2))
    ref = copy.deepcopy(model)
    pipe = pe.Pipe(model, balance=balance, devices=["cpu"] * len(balance), chunks=2, checkpoint=checkpoint)
    x = torch.randn(6, 4)
    _same(pipe, ref, x, lambda o: o.pow(2).sum())
    for a, b in zip(_grads(model), _grads(ref)):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    model.zero_grad()
    ref.zero_grad()
    y = torch.randn(6, 2)
    loss = pipe.step(x, target=y, loss_fn=nn.functional.mse_loss)
    nn.functional.mse_loss(ref(x), y).backward()
    torch.testing.assert_close(loss, nn.functional.mse_loss(ref(x), y).detach(), rtol=RTOL, atol=ATOL)
    for a, b in zip(_grads(model), _grads(ref)):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_one_element_tuple_stays_a_tuple_across_stages():
    torch.manual_seed(0)
    model = nn.Sequential(Single(), Single())
    pipe = pe.Pipe(model, balance=[1, 1], devices=["cpu", "cpu"], chunks=2)
    a = torch.randn(4, 4, requires_grad=True)
    (out,) = pipe((a,))
    torch.testing.assert_close(out, model[1](model[0]((a,)))[0])
    out.sum().backward()
    assert a.grad is not None and all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_inplace_first_layer_of_a_stage(checkpoint):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    ref = copy.deepcopy(model)
    pipe = pe.Pipe(model, balance=[1, 2], devices=["cpu", "cpu"], chunks=2, checkpoint=checkpoint)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    if checkpoint == "always":  # the recomputation would start from the modified input: refused, not wrong
        with pytest.raises(RuntimeError, match="modified its input in place"):
            pipe(x)
        return
    _same(pipe, ref, x, lambda o: o.pow(2).sum())
    for a, b in zip(_grads(model), _grads(ref)):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    model.zero_grad()
    ref.zero_grad()
    pipe.step(x, target=y, loss_fn=nn.functional.mse_loss)
    nn.functional.mse_loss(ref(x), y).backward()
    for a, b in zip(_grads(model), _grads(ref)):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_sequential_like_and_torchgpipe_state_dict_keys():
    a, b, c = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    model = nn.Sequential(a, b, c)
    pipe = pe.Pipe(model, balance=[1, 2], devices=["cpu", "cpu"])
    assert len(pipe) == 3 and list(pipe) == [a, b, c] and pipe[-1] is c and pipe[1] is b
    with pytest.raises(IndexError):
        pipe[3]
    assert set(pipe.state_dict()) == {f"partitions.{s}.{i}.{w}" for s, i in [(0, 0), (1, 1), (1, 2)] for w in ("weight", "bias")}
    named = pe.Pipe(nn.Sequential(OrderedDict(first=nn.Linear(2, 2), second=nn.Linear(2, 2))), balance=[1, 1],
                    devices=["cpu", "cpu"])
    assert {"partitions.0.first.weight", "partitions.1.second.weight"} <= set(named.state_dict())
    # a checkpoint of one pipe loads into another with the same balance
    other = pe.Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)), balance=[1, 2], devices=["cpu"] * 2)
    other.load_state_dict(pipe.state_dict())
    assert torch.equal(other[2].weight, c.weight)


def test_argument_rules():
    lin = lambda: nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1), nn.Linear(1, 1))  # noqa: E731
    pipe = pe.Pipe(lin(), balance=[1, 1, 1], devices=["cpu"] * 5)  # extra devices are ignored
    assert pipe.devices == [torch.device("cpu")] * 3
    with pytest.raises(IndexError, match="only 1 devices"):
        pe.Pipe(lin(), balance=[1, 1, 1], devices=["cpu"])
    pipe = pe.Pipe(lin(), balance=[3], devices=["cpu"], chunks=42.0, checkpoint="always")
    assert pipe.chunks == 42 and isinstance(pipe.chunks, int) and pipe.checkpoint == "always"
    for move in (lambda: pipe.cpu(), lambda: pipe.to("cpu"), lambda: pipe.to(torch.rand(1)), lambda: pipe.to(device='meta')):
        with pytest.raises(TypeError):
            move()
    empty = pe.Pipe(nn.Sequential(), [])
    x = torch.tensor([42.0])
    assert empty(x) is x and empty((x,)) == (x,)
    with pytest.raises(TypeError):
        empty(42)
    with pytest.raises(TypeError, match="must be tensors"):
        pe.Pipe(nn.Sequential(nn.Identity()), balance=[1], devices=["cpu"])("hello")


def test_no_recomputation_in_eval_mode():
    seen = []

    class Spy(nn.Module):
        def forward(self, x):
            seen.append((pe.is_checkpointing(), pe.is_recomputing()))
            return x * x  # saves x: its recomputation is needed

    pipe = pe.Pipe(nn.Sequential(nn.Linear(2, 2), Spy()), balance=[1, 1], devices=["cpu", "cpu"], chunks=2,
                   checkpoint="always")
    pipe(torch.randn(4, 2)).sum().backward()
    assert sorted(seen) == [(False, True)] * 2 + [(True, False)] * 2  # each microbatch: checkpointed, then recomputed
    seen.clear()
    pipe.eval()
    pipe(torch.randn(4, 2)).sum().backward()
    assert seen == [(False, False)] * 2


@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
def test_deferred_batch_norm_matches_unsplit_model(checkpoint):
    torch.manual_seed(0)
    # one BatchNorm: a later one's input would differ anyway (per-microbatch normalisation upstream)
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3), nn.ReLU(), nn.Conv2d(3, 3, 1))
    ref = copy.deepcopy(model)
    pipe = pe.Pipe(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=4, checkpoint=checkpoint,
                   deferred_batch_norm=True)
    for step in range(2):
        x = torch.randn(8, 3, 5, 5) + step
        pipe(x).mean().backward()
        ref(x).mean().backward()
    for m, r in zip(model.modules(), ref.modules()):
        if isinstance(m, nn.BatchNorm2d):
            torch.testing.assert_close(m.running_mean, r.running_mean, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(m.running_var, r.running_var, rtol=1e-4, atol=1e-5)
            assert int(m.num_batches_tracked) == int(r.num_batches_tracked) == 2


def test_balancing_leaves_the_model_untouched():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 64), nn.Linear(64, 2))
    model.eval()
    model(torch.randn(4, 8)).sum().backward()  # existing gradients
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    for balance in (balance_by_time(model, torch.randn(16, 8), 2), balance_by_size(model, torch.randn(16, 8), 2)):
        assert len(balance) == 2 and sum(balance) == 4
    assert not model.training
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    # sizes: the big Linear(64, 2) side is heavier in parameters; saved activations decide too
    assert balance_by_size(nn.Sequential(*[nn.Linear(i + 1, i + 2) for i in range(6)]), torch.rand(7, 1), 2,
                           param_scale=100) == [4, 2]


class PairOfLists(nn.Module):
    """Takes two lists of tensors (torchgpipe's ``test_multi_sequence_input`` model, with weights)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, xs, ys):
        return [self.a(x) for x in xs], [self.b(y) for y in ys]


def test_list_inputs_and_outputs_split_like_tuples_and_other_leaves_name_their_type():
    torch.manual_seed(0)
    ref = nn.Sequential(PairOfLists())
    pipe = pe.Pipe(copy.deepcopy(ref), balance=[1], devices=["cpu"], chunks=2, unpack_tuples=True)
    xs, ys = [torch.randn(6, 4), torch.randn(6, 4)], [torch.randn(6, 4), torch.randn(6, 4)]
    out, ref_out = pipe(xs, ys), ref[0](xs, ys)
    assert isinstance(out, tuple) and all(isinstance(o, list) for o in out)  # the structure comes back
    torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL)
    sum(t.sum() for o in out for t in o).backward()
    sum(t.sum() for o in ref_out for t in o).backward()
    for p, q in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)
    with pytest.raises(TypeError, match="tensors, or tuples, lists or dicts of tensors; got a str"):
        pipe(["not a tensor"], ys)


# -- forwards in clock-cycle order (torchgpipe's test_forward_lockstep, without its sleeps) ----------
class Clocked(nn.Module):
    """Records (microbatch, stage) when its forward returns (not in recomputations), counting its own calls.

    ``started``: {(microbatch, stage): Event}, each set when that forward begins.
    """

    def __init__(self, stage: int, timeline: list, started: dict | None = None) -> None:
        super().__init__()
        self.stage, self.timeline, self.calls = stage, timeline, 0
        self.started = started or {}
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if not pe.is_recomputing() and (self.calls, self.stage) in self.started:
            self.started[(self.calls, self.stage)].set()
        out = torch.tanh(self.fc(x))
        if not pe.is_recomputing():
            self.timeline.append((self.calls, self.stage))
            self.calls += 1
        return out


def _in_clock_cycles(timeline: list, n_stages: int, m: int) -> bool:
    """Every forward once, and cycles (microbatch + stage) never go back: a forward returns only after every
    forward of the previous cycle returned (none of them could start before that cycle was complete)."""
    cycles = [i + j for i, j in timeline]
    return sorted(timeline) == sorted((i, j) for i in range(m) for j in range(n_stages)) and cycles == sorted(cycles)


@pytest.mark.parametrize("call", ["forward", "step"])
def test_forwards_run_in_clock_cycle_order(call):
    """torchgpipe runs the forward of microbatch i on stage j in clock cycle i + j, a cycle after the whole previous
    one: users rely on that order (their forwards' side effects happen in the same order in every run). Stage 0,
    which never waits for an input, would otherwise run ahead through its microbatches."""
    n_stages, m = 3, 4
    timeline: list = []
    for run in range(10):
        timeline.clear()
        layers = [Clocked(j, timeline) for j in range(n_stages)]
        pipe = pe.Pipe(nn.Sequential(*layers), balance=[1] * n_stages, devices=["cpu"] * n_stages, chunks=m)
        x = torch.randn(2 * m, 4)
        if call == "forward":
            pipe(x).sum().backward()
        else:
            pipe.step(x, target=x, loss_fn=nn.functional.mse_loss)
        assert _in_clock_cycles(timeline, n_stages, m), f"run {run}: (microbatch, stage) in order {timeline}"
    # torchgpipe's own case: two stages, three microbatches; within a cycle, partition order (no sleeps here)
    timeline.clear()
    pipe = pe.Pipe(nn.Sequential(Clocked(0, timeline), Clocked(1, timeline)), balance=[1, 1],
                   devices=["cpu", "cpu"], chunks=3)
    pipe(torch.randn(3, 4))
    assert timeline == TORCHGPIPE_LOCKSTEP


#: torchgpipe's test_forward_lockstep: (microbatch, partition) in the order the forwards return
TORCHGPIPE_LOCKSTEP = [(0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (2, 1)]


def _hold_cycle_entry(monkeypatch, held: dict, bound: float = 0.5) -> None:
    """Forward (microbatch, stage) in ``held`` enters its clock cycle only once ``held[...]`` is set, or after
    ``bound`` seconds: the interleaving where the other forwards of its cycle reach the clock first. Where the
    clock lets them run first (the old race), the event comes at once; where they wait for this forward, the
    bound lets it go (a wait that cannot end early, never a check of time)."""
    wait = Lockstep.wait

    def held_wait(self, stage, mb):
        if (mb, stage) in held:
            held[(mb, stage)].wait(bound)
        return wait(self, stage, mb)

    monkeypatch.setattr(Lockstep, "wait", held_wait)


@pytest.mark.parametrize("call", ["forward", "step"])
def test_forwards_of_a_cycle_run_in_partition_order_whoever_reaches_the_clock_first(call, monkeypatch):
    """torchgpipe's test_forward_lockstep with the interleaving forced instead of sleeps: stage 1 reaches each
    cycle before stage 0 does. Seeded forwards (the default checkpointing; dropout) hold the process's RNG
    lock, so they run one at a time whatever happens, and the clock gives them the lock in partition order:
    stage 0's forward of a cycle returns before stage 1's, as in torchgpipe, not whichever thread came first."""
    timeline: list = []
    started = {(0, 1): threading.Event(), (1, 1): threading.Event()}
    # stage 0's forward of cycle c (microbatch c) waits for stage 1's of the same cycle (microbatch c - 1)
    _hold_cycle_entry(monkeypatch, {(1, 0): started[(0, 1)], (2, 0): started[(1, 1)]})
    pipe = pe.Pipe(nn.Sequential(Clocked(0, timeline, started), Clocked(1, timeline, started)), balance=[1, 1],
                   devices=["cpu", "cpu"], chunks=3)
    x = torch.randn(3, 4)
    if call == "forward":
        pipe(x)
    else:
        pipe.step(x, target=x, loss_fn=nn.functional.mse_loss)
    assert timeline == TORCHGPIPE_LOCKSTEP


def test_unseeded_forwards_of_a_cycle_still_run_at_once():
    """Without seeds (no recomputation, no dropout) forwards take no lock: a cycle's forwards run together, as
    torchgpipe's worker threads do (two stages meet at a barrier inside their forwards of cycles 1 and 2)."""
    timeline: list = []
    meet = threading.Barrier(2, timeout=60)

    class Meet(Clocked):
        def forward(self, x):
            if self.calls + self.stage in (1, 2):  # the cycles with two forwards
                meet.wait()
            return super().forward(x)

    pipe = pe.Pipe(nn.Sequential(Meet(0, timeline), Meet(1, timeline)), balance=[1, 1], devices=["cpu", "cpu"],
                   chunks=3, checkpoint="never")
    pipe(torch.randn(3, 4))
    assert sorted(timeline) == sorted(TORCHGPIPE_LOCKSTEP)


def test_a_failed_forward_stops_the_later_cycles():
    """torchgpipe's test_exception_early_stop_asap, without sleeps: stage 3 fails on microbatch 0 (cycle 3), so no
    forward of cycle 4 or later runs (stage 2 never reaches microbatch 2), and the forwards waiting for their cycle
    are woken by the cancellation: the stage's own error comes back, not a timeout."""

    class Boom(Exception):
        pass

    class Raise(nn.Module):
        def forward(self, x):
            raise Boom()

    for _ in range(5):
        timeline: list = []
        model = nn.Sequential(nn.Identity(), nn.Identity(), Clocked(2, timeline), Raise())
        pipe = pe.Pipe(model, balance=[1, 1, 1, 1], devices=["cpu"] * 4, chunks=3, timeout=60.0)
        with pytest.raises(Boom):
            pipe(torch.randn(3, 4))
        assert timeline == [(0, 2), (1, 2)]  # torchgpipe: counter == 2, microbatch 1 runs beside the failure


def test_a_failure_lets_the_earlier_partitions_of_its_cycle_run_and_stops_the_next_cycle(monkeypatch):
    """torchgpipe's test_exception_early_stop_asap with the interleaving forced: stage 3 fails on microbatch 0
    in cycle 3 while stage 2 has not reached its forward of that cycle (microbatch 1). torchgpipe started both
    tasks of the cycle, so its counter is 2: stage 2's forward of cycle 3 runs, none of cycle 4. Here the
    clock runs stage 2's first, then stage 3's fails and nothing later starts (the forward of cycle 4 is
    woken by the cancellation and never runs)."""

    class Boom(Exception):
        pass

    class Raise(nn.Module):
        def forward(self, x):
            raise Boom()

    cancelled = threading.Event()
    close = Lockstep.close

    def closing(self, reason):
        cancelled.set()
        close(self, reason)

    monkeypatch.setattr(Lockstep, "close", closing)
    _hold_cycle_entry(monkeypatch, {(1, 2): cancelled})  # stage 2's forward of cycle 3 waits for the failure
    timeline: list = []
    model = nn.Sequential(nn.Identity(), nn.Identity(), Clocked(2, timeline), Raise())
    pipe = pe.Pipe(model, balance=[1, 1, 1, 1], devices=["cpu"] * 4, chunks=3, timeout=60.0)
    with pytest.raises(Boom):
        pipe(torch.randn(3, 4))
    assert timeline == [(0, 2), (1, 2)]


@pytest.mark.parametrize("name,m,serial", [("gpipe", 4, True), ("1f1b", 4, True), ("looped_bfs", 2, True),
                                           ("zbv", 2, False)])
def test_the_clock_is_serial_where_every_rank_runs_its_forwards_in_partition_order(name, m, serial):
    """Seeded calls ask for a serial clock; a schedule whose rank runs two forwards of one cycle later stage first
    (the V schedules) gets cycles only, since a serial clock would wait there for a forward its own rank runs
    later. ``pipe(x)`` under such a schedule, seeded, runs (no deadlock)."""
    from pipeline_ext import schedules as S

    v = 2 if name in pe.pipe.MULTI_STAGE_SCHEDULES else 1
    forward_only = S.forward_only(S.lower(S.build(name, 2, m, stages_per_rank=v)))
    assert Lockstep.of(forward_only, serial=True).serial == serial
    assert not Lockstep.of(forward_only).serial  # unseeded: cycles only
    n = 2 * v
    timeline: list = []
    pipe = pe.Pipe(nn.Sequential(*[Clocked(j, timeline) for j in range(n)]), balance=[1] * n,
                   devices=["cpu", "cpu"], chunks=m, schedule=name)
    pipe(torch.randn(m, 4)).sum().backward()
    if serial:
        assert timeline == sorted(((i, j) for i in range(m) for j in range(n)), key=lambda ij: (sum(ij), ij[1]))
    else:
        assert _in_clock_cycles(timeline, n, m), timeline
