"""Skip connections (``pipeline_ext.skip``): torchgpipe's API, in Pipe and between processes.

The reference is always the unsplit model (the same ``nn.Sequential`` called
on the whole batch, the skips held by the thread's default tracker): same
loss, same gradients, same parameters after optimizer steps.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipeline_ext as pe
from pipeline_ext.skip import (
    Namespace,
    SkipRouteError,
    pop,
    skippable,
    stash,
    verify_skippables,
)
from pipeline_ext.runtime.skips import SkipRoutes
from tests.mp_utils import no_complaints
from models import TOL

D = 6


@skippable(stash=["skip"])
class Down(nn.Module):
    """One U-Net level going down: stashes its input for the matching ``Up``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        yield stash("skip", x)
        return torch.tanh(self.lin(x))


@skippable(pop=["skip"])
class Up(nn.Module):
    """One U-Net level going up: adds the stashed tensor (a long skip)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2 * D, D)

    def forward(self, x):
        skip = yield pop("skip")
        return torch.tanh(self.lin(torch.cat([x, skip], dim=-1)))


def unet(seed: int = 0, named: bool = True) -> nn.Sequential:
    """Six blocks, two nested long skips (block 0 -> block 5, block 1 -> block 4), isolated by namespaces."""
    torch.manual_seed(seed)
    outer, inner = (Namespace("outer"), Namespace("inner")) if named else (Namespace(), Namespace())
    return nn.Sequential(
        Down().isolate(outer),
        Down().isolate(inner),
        nn.Sequential(nn.Linear(D, D), nn.ReLU()),
        nn.Linear(D, D),
        Up().isolate(inner),
        Up().isolate(outer),
    )


def batch(rows: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, D, generator=g), torch.randn(rows, D, generator=g)


def reference_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    ref = copy.deepcopy(model)
    loss = F.mse_loss(ref(x), y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in ref.parameters()]


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.allclose(p, q, **TOL) for p, q in zip(a, b))


# -- the API --------------------------------------------------------------------------------------
def test_unsplit_model_runs_with_its_skips_and_keeps_torchgpipes_state_dict_keys():
    model = unet()
    x, _ = batch()
    out = model(x)
    # by hand: the same arithmetic without the skip machinery
    h0 = x
    h1 = torch.tanh(model[0].module.lin(h0))
    h2 = torch.tanh(model[1].module.lin(h1))
    h = model[3](model[2](h2))
    h = torch.tanh(model[4].module.lin(torch.cat([h, h1], -1)))
    h = torch.tanh(model[5].module.lin(torch.cat([h, h0], -1)))
    assert torch.allclose(out, h)
    assert "0.module.lin.weight" in model.state_dict()
    assert repr(model[0]).startswith("@skippable(Down(")


def test_verify_skippables_names_every_unmatched_skip():
    verify_skippables(unet())
    with pytest.raises(TypeError, match="no module declared 'skip' as poppable but stashed"):
        verify_skippables(nn.Sequential(Down()))
    with pytest.raises(TypeError, match="declared 'skip' as poppable but it was not stashed"):
        verify_skippables(nn.Sequential(Up()))
    with pytest.raises(TypeError, match="redeclared 'skip' as stashable but not isolated by namespace"):
        verify_skippables(nn.Sequential(Down(), Down(), Up(), Up()))


def test_stash_and_pop_must_be_declared_and_used():
    @skippable(stash=["a"])
    class Forgets(nn.Module):
        def forward(self, x):
            return x

    @skippable(pop=["a"])
    class Pops(nn.Module):
        def forward(self, x):
            return x + (yield pop("b"))

    with pytest.raises(RuntimeError, match="'a' must be stashed but have not"):
        Forgets()(torch.zeros(1))
    with pytest.raises(RuntimeError, match="has not been stashed"):
        nn.Sequential(Pops())(torch.zeros(1))


def test_a_failed_forward_does_not_poison_the_retry():
    """The user's loop: a forward raises between a stash and its pop, the batch is skipped, training goes on."""

    fail = [True]

    @skippable(pop=["skip"])
    class Fails(nn.Module):
        def forward(self, x):
            if fail[0]:
                raise ValueError("bad batch")
            return x + (yield pop("skip"))

    model = nn.Sequential(Down(), Fails())
    x, _ = batch()
    with pytest.raises(ValueError):
        model(x)
    fail[0] = False
    assert torch.allclose(model(x), torch.tanh(model[0].module.lin(x)) + x)


def test_routes_name_unmatched_and_backward_skips():
    blocks = list(unet())
    routes = SkipRoutes.of_modules([nn.Sequential(*blocks[:2]), nn.Sequential(*blocks[2:4]), nn.Sequential(*blocks[4:])])
    assert set(routes.edges.values()) == {(0, 2)} and len(routes.edges) == 2
    assert routes.sources(2) == {0: sorted(routes.edges, key=lambda k: k.order)}
    with pytest.raises(SkipRouteError, match="popped on stage 0, before stage 1 stashes it"):
        SkipRoutes.of_modules([nn.Sequential(Up()), nn.Sequential(Down())])
    with pytest.raises(SkipRouteError, match="stashed on stage 0 but no later stage pops it"):
        SkipRoutes.of_modules([nn.Sequential(Down()), nn.Linear(D, D)])


# -- Pipe -----------------------------------------------------------------------------------------
PIPE_CASES = [
    ("gpipe", [2, 2, 2], 3),
    ("1f1b", [2, 2, 2], 3),
    ("zb_h1", [1, 3, 2], 3),
    ("interleaved_1f1b", [1, 1, 1, 1, 1, 1], 3),
    ("zbv", [1, 2, 2, 1], 2),  # V: stages 0 and 3 on one device, the outer skip stays local
]


@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("schedule,balance,devices", PIPE_CASES)
def test_pipe_trains_a_unet_exactly(schedule, balance, devices, checkpoint):
    model = unet()
    x, y = batch()
    want_loss, want = reference_grads(model, x, y)
    pipe = pe.Pipe(model, balance=balance, devices=["cpu"] * devices, chunks=4, schedule=schedule,
                   checkpoint=checkpoint)
    assert pipe.skip_routes, "the long skips must cross stages in this split"
    loss = pipe.step(x, target=y, loss_fn=F.mse_loss)
    assert torch.allclose(loss, want_loss, rtol=1e-5)
    assert close(grads_of(model), want)
    model.zero_grad()
    out = pipe(x)  # forward connected to autograd: the skip's gradient flows back through Reattach
    F.mse_loss(out, y).backward()
    assert close(grads_of(model), want)


def test_pipe_optimizer_steps_match_the_unsplit_model():
    model, ref = unet(), unet()
    x, y = batch()
    pipe = pe.Pipe(model, balance=[2, 2, 2], devices=["cpu"] * 3, chunks=4, schedule="1f1b")
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        pipe.step(x, target=y, loss_fn=F.mse_loss)
        F.mse_loss(ref(x), y).backward()
        opt.step()
        ref_opt.step()
    assert all(torch.allclose(p, q, **TOL) for p, q in zip(model.parameters(), ref.parameters()))


def test_pipe_refuses_unmatched_skips_and_carries_none():
    with pytest.raises(TypeError, match="no module declared 'skip' as poppable"):
        pe.Pipe(nn.Sequential(Down(), nn.Linear(D, D)), balance=[1, 1], devices=["cpu"] * 2)

    @skippable(stash=["none"])
    class StashNone(nn.Module):
        def forward(self, x):
            yield stash("none", None)
            return x * 2

    @skippable(pop=["none"])
    class PopNone(nn.Module):
        def forward(self, x):
            got = yield pop("none")
            assert got is None
            return x + 1

    pipe = pe.Pipe(nn.Sequential(StashNone(), PopNone()), balance=[1, 1], devices=["cpu"] * 2, chunks=5)
    x = torch.rand(10, requires_grad=True)
    pipe(x).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


# -- between processes ----------------------------------------------------------------------------
SCHEDULES_3 = ["gpipe", "1f1b", "zb_h1", "zb_h2", "interleaved_1f1b", "interleaved_zb", "looped_bfs", "zbv",
               "dualpipev"]


def _stage_modules(model: nn.Sequential, num_stages: int) -> list[nn.Module]:
    per = len(model) // num_stages
    return [nn.Sequential(*list(model)[i * per:(i + 1) * per]) for i in range(num_stages)]


def _unet_pipeline(name: str, rank: int, world: int, m: int) -> tuple:
    """The U-Net under schedule ``name`` on this rank: (model, reference copy, schedule, holds the first stage,
    holds the last stage, ids of this rank's parameters)."""
    v = pe.schedules.default_stages_per_rank(name)
    model, ref = unet(), unet()
    stages = _stage_modules(model, world * v)
    placement = pe.schedules.build(name, world, m, stages_per_rank=v).stage_to_rank
    mine = [s for s, r in enumerate(placement) if r == rank]
    sched = pe.PipelineSchedule([pe.PipelineStage(stages[s], s, world * v, "cpu") for s in mine], name, m,
                                loss_fn=F.mse_loss)
    held = {id(p) for s in mine for p in stages[s].parameters()}
    return model, ref, sched, placement[0] == rank, placement[-1] == rank, held


def _multiprocess(rank: int, world: int, schedules: list[str]) -> list[str]:
    bad: list[str] = []
    x, y = batch(12)
    m = 6  # DualPipeV needs 2 microbatches per rank
    for name in schedules:
        model, ref, sched, first, last, held = _unet_pipeline(name, rank, world, m)
        opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
        for k in range(2):  # two training steps (the second on a known communication plan)
            opt.zero_grad()
            ref_opt.zero_grad()
            losses: list = []
            sched.step(*((x,) if first else ()), target=y if last else None, losses=losses)
            want_loss = F.mse_loss(ref(x), y)
            want_loss.backward()
            if any(id(p) in held and not torch.allclose(p.grad, q.grad, **TOL)
                   for p, q in zip(model.parameters(), ref.parameters())):
                bad.append(f"{name}: step {k}: rank {rank}: a gradient differs from the unsplit model's")
            if last and not torch.allclose(sum(losses) / m, want_loss, rtol=1e-5):
                bad.append(f"{name}: step {k}: loss {float(sum(losses) / m)} != {float(want_loss)}")
            opt.step()
            ref_opt.step()
        out = sched.eval(*((x,) if first else ()))
        if last:
            with torch.no_grad():
                if not torch.allclose(out, ref(x), **TOL):
                    bad.append(f"{name}: eval() output differs from the unsplit model's")
    return bad


@pytest.mark.timeout(120)
def test_unet_over_three_gloo_ranks_1f1b_and_zb_h1():
    no_complaints(_multiprocess, 3, ["1f1b", "zb_h1"], timeout=100)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_unet_over_three_gloo_ranks_every_schedule():
    no_complaints(_multiprocess, 3, SCHEDULES_3, timeout=220)


def _variable_rows(rank: int, world: int, schedules: list[str]) -> list[str]:
    """``step_microbatches`` with microbatches of different rows: skips between processes keep their layouts
    per microbatch signature too (their own lane of tags)."""
    bad: list[str] = []
    m = 6
    steps = [[1, 3, 2, 4, 2, 3], [4, 2, 3, 1, 3, 2], [5, 1, 1, 2, 6, 1]]  # new order, then new rows
    for name in schedules:
        model, ref, sched, first, last, held = _unet_pipeline(name, rank, world, m)
        for k, rows in enumerate(steps):
            model.zero_grad(), ref.zero_grad()
            pairs = [batch(r, seed=10 * k + i) for i, r in enumerate(rows)]
            xs, ys = [x for x, _ in pairs], [y for _, y in pairs]
            sched.step_microbatches(xs if first else None, target_mbs=ys if last else None)
            F.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()  # losses weighted by rows: the batch's mean
            if any(id(p) in held and not torch.allclose(p.grad, q.grad, **TOL)
                   for p, q in zip(model.parameters(), ref.parameters())):
                bad.append(f"{name}: step {k}: rank {rank}: a gradient differs from the unsplit model's")
    return bad


@pytest.mark.timeout(120)
def test_unet_with_microbatches_of_different_rows_over_three_ranks():
    no_complaints(_variable_rows, 3, ["1f1b", "zbv"], timeout=100)


def _unmatched(rank: int, world: int) -> list[str]:
    torch.manual_seed(0)
    module = nn.Sequential(Down()) if rank == 0 else nn.Linear(D, D)
    sched = pe.ScheduleGPipe(pe.PipelineStage(module, rank, world, "cpu"), 2, loss_fn=F.mse_loss)
    x, y = batch(4)
    try:
        sched.step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None)
    except SkipRouteError as exc:
        return [] if "stashed on stage 0 but no later stage pops it" in str(exc) else [str(exc)]
    return ["an unmatched skip between processes was accepted"]


@pytest.mark.timeout(60)
def test_unmatched_skip_between_processes_raises_on_every_rank():
    no_complaints(_unmatched, 2, timeout=50)


def test_no_skip_tensor_outlives_a_call():
    """Skips live from their stash to their pop: nothing is left behind by pipe(x), backward or step()."""
    model = unet()
    x, y = batch()
    pipe = pe.Pipe(model, balance=[2, 2, 2], devices=["cpu"] * 3, chunks=4, checkpoint="always")
    F.mse_loss(pipe(x), y).backward()
    pipe.step(x, target=y, loss_fn=F.mse_loss)
    model(x)  # the unsplit model on this thread's default tracker
    assert pe.skip.current_skip_tracker().tensors == {}


def test_balancing_profiles_a_model_with_skips_and_leaves_it_untouched():
    """balance_by_time / balance_by_size run each layer alone: a popping layer gets its skip as a fresh input."""
    model = unet()
    x, _ = batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for balance in (pe.balance_by_time(model, x, 3), pe.balance_by_size(model, x, 3)):
        assert len(balance) == 3 and sum(balance) == len(model) and min(balance) >= 1
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert pe.skip.current_skip_tracker().tensors == {}


def _training_loop(rank: int, world: int) -> list[str]:
    """A user's loop with skips between 2 ranks: a rejected first step caught, eval, then steps with SGD."""
    bad: list[str] = []
    x, y = batch(8)
    model, ref = unet(), unet()
    stages = _stage_modules(model, world)
    sched = pe.Schedule1F1B(pe.PipelineStage(stages[rank], rank, world, "cpu"), 4, loss_fn=F.mse_loss)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    first, last = rank == 0, rank == world - 1
    try:  # the last rank forgot its target: every rank raises before any skip moves
        sched.step(*((x,) if first else ()))
        bad.append("a step without a target on the last rank was accepted")
    except (pe.StepRejectedError, ValueError):
        pass
    out = sched.eval(*((x,) if first else ()))
    if last and not torch.allclose(out, ref(x).detach(), **TOL):
        bad.append("eval() after the rejected step differs from the unsplit model")
    for k in range(2):
        xk, yk = batch(8, seed=10 + k)
        opt.zero_grad()
        ref_opt.zero_grad()
        sched.step(*((xk,) if first else ()), target=yk if last else None)
        F.mse_loss(ref(xk), yk).backward()
        if any(not torch.allclose(p.grad, q.grad, **TOL)
               for p, q in zip(stages[rank].parameters(), _stage_modules(ref, world)[rank].parameters())):
            bad.append(f"step {k}: a gradient differs from the unsplit model's")
        opt.step()
        ref_opt.step()
    return bad


@pytest.mark.timeout(60)
def test_a_caught_rejection_then_eval_then_training_stays_exact_with_skips():
    no_complaints(_training_loop, 2, timeout=50)
