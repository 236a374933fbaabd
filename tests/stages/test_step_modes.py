"""A training loop's modes and arguments that reach the step: autograd off, autocast, objects, select()'s choice.

Each test runs the user's loop on 2 ranks for several steps and compares with
the unsplit model (loss, gradients, parameters after SGD steps):
- ``step()`` under ``torch.no_grad()``/``inference_mode()`` is refused on every
  rank before anything moves, naming the problem; the loop goes on exactly.
- a step under ``torch.autocast`` after a step without it (and back) learns the
  dtypes the stages now produce instead of failing on the cached layouts.
- an object keyword argument that decides the output shape (a frozen
  dataclass, or a plain object changed in place) gives each value its layouts.
- README's ``select()`` recipe runs whatever ``select`` chooses, "auto" included.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from mp_utils import rank_values
from models import TOL

D, ROWS, M = 16, 8, 4


def _mlp(n: int, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(n)]


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, D, generator=g), torch.randn(ROWS, D, generator=g)


def _reference_step(model: list[nn.Module], opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                    autocast: bool = False, **kw) -> torch.Tensor:
    """One step of the unsplit model: forward, mse loss, backward, SGD."""
    opt.zero_grad()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        h = x
        for i, m in enumerate(model):
            h = m(h, **kw) if i == 0 and kw else m(h)
        loss = nn.functional.mse_loss(h.float(), y)
    loss.backward()
    grads = [p.grad.clone() for m in model for p in m.parameters()]
    opt.step()
    return loss.detach(), grads


def _step(sched, rank: int, world: int, x, y, **kw):
    losses: list = []
    if rank == 0:
        sched.step(x, **kw)
    elif rank == world - 1:
        sched.step(target=y, losses=losses)
    else:
        sched.step()
    return losses


# -- autograd off ------------------------------------------------------------------------------------

def _autograd_off(rank: int, world: int, how: str) -> list:
    import pipeline_ext as pe

    model = _mlp(world)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD([p for m in ref for p in m.parameters()], lr=0.1)
    stage = pe.PipelineStage(model[rank], rank, world, "cpu")
    sched = pe.Schedule1F1B(stage, M, loss_fn=nn.functional.mse_loss, timeout=30.0)
    opt = torch.optim.SGD(model[rank].parameters(), lr=0.1)
    said, problems = [], []
    for i in range(4):
        x, y = _batch(i)
        off = i in (1, 2) and (how != "rank0" or rank == 0)  # steps 1 and 2 with autograd off (every rank, or rank 0)
        opt.zero_grad()
        try:
            if off and how == "inference_mode":
                with torch.inference_mode():
                    losses = _step(sched, rank, world, x, y)
            elif off:
                with torch.no_grad():
                    losses = _step(sched, rank, world, x, y)
            else:
                losses = _step(sched, rank, world, x, y)
        except Exception as exc:  # noqa: BLE001 - the loop catches, skips the batch, goes on
            said.append(f"step {i}: {type(exc).__name__}: {exc}")
            if any(p.grad is not None and p.grad.abs().sum() > 0 for p in model[rank].parameters()):
                problems.append(f"step {i}: a refused step left gradients")
            continue
        opt.step()
        loss, grads = _reference_step(ref, ref_opt, x, y)
        mine = [p for p in ref[rank].parameters()]
        for p, q in zip(model[rank].parameters(), mine):
            if not torch.allclose(p, q, **TOL):
                problems.append(f"step {i}: parameters differ from the unsplit model's")
        if rank == world - 1 and not torch.allclose(torch.stack(losses).mean(), loss, **TOL):
            problems.append(f"step {i}: loss {float(torch.stack(losses).mean())} != {float(loss)}")
    return [said, problems]


@pytest.mark.parametrize("how", ["all", "inference_mode", "rank0"])
def test_a_step_with_autograd_off_is_refused_on_every_rank_and_the_loop_goes_on(transport, how):
    out = rank_values(_autograd_off, 2, how, timeout=120)
    for rank, (said, problems) in out.items():
        assert problems == [], (rank, problems)
        assert [s.split(":")[0] for s in said] == ["step 1", "step 2"], (rank, said)
        for s in said:
            if how != "rank0" or rank == 0:  # the rank with autograd off says what is wrong
                assert "RuntimeError" in s and "autograd is off" in s and "eval()" in s, s
            else:  # the other rank is told, names it, and says nothing moved
                assert "StepRejectedError" in s and "rank 0" in s and "autograd is off" in s, s


# -- autocast ----------------------------------------------------------------------------------------

def _autocast_loop(rank: int, world: int) -> list:
    import pipeline_ext as pe

    model = _mlp(world)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD([p for m in ref for p in m.parameters()], lr=0.1)
    stage = pe.PipelineStage(model[rank], rank, world, "cpu")
    sched = pe.Schedule1F1B(stage, M, loss_fn=lambda out, y: nn.functional.mse_loss(out.float(), y), timeout=30.0)
    opt = torch.optim.SGD(model[rank].parameters(), lr=0.1)
    problems = []
    for i, amp in enumerate([False, True, True, False, True]):
        x, y = _batch(i)
        opt.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=amp):
            losses = _step(sched, rank, world, x, y)
        opt.step()
        loss, grads = _reference_step(ref, ref_opt, x, y, autocast=amp)
        rounded = amp or i >= 1  # bfloat16 rounding (in the pipeline's order, or the whole batch's) stays in the weights
        tol = dict(rtol=2e-2, atol=2e-3) if rounded else TOL
        for p, q in zip(model[rank].parameters(), ref[rank].parameters()):
            if not torch.allclose(p, q, **tol):
                problems.append(f"step {i} (autocast {amp}): parameters differ by {float((p - q).abs().max().detach())}")
        if rank == world - 1:
            if not torch.allclose(torch.stack(losses).mean(), loss, **tol):
                problems.append(f"step {i} (autocast {amp}): loss {float(torch.stack(losses).mean())} != {float(loss)}")
            out = stage.output_chunks[0]
            if out.dtype != (torch.bfloat16 if amp else torch.float32):
                problems.append(f"step {i} (autocast {amp}): the last stage's output is {out.dtype}")
    return problems


def test_autocast_after_a_step_without_it_learns_the_new_dtypes(transport):
    out = rank_values(_autocast_loop, 2, timeout=120)
    assert out == {0: [], 1: []}


# -- an object argument that decides the output shape -------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Width:
    n: int


class MutableWidth:
    """Compares by identity: changed in place between steps, it must not reuse the last step's layouts."""

    def __init__(self, n: int) -> None:
        self.n = n


@dataclasses.dataclass(frozen=True)
class HiddenWidth:
    """Compares by value, but its repr hides the field that decides the shape (``HiddenWidth()``)."""

    n: int = dataclasses.field(repr=False)


class ReprWidth:
    """Compares by value; its own ``__repr__`` says the same for every value."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReprWidth) and other.n == self.n

    def __hash__(self) -> int:
        return hash(self.n)

    def __repr__(self) -> str:
        return "ReprWidth(...)"


class EqWidth(ReprWidth):
    """Compares by value with object's default repr (the same for one object), changed in place between steps."""

    __repr__ = object.__repr__


#: kind -> (make a value, whether the loop changes one object in place instead of making a new one)
WIDTHS = {"frozen": (Width, False), "mutable": (MutableWidth, True), "repr_hidden": (HiddenWidth, False),
          "custom_repr": (ReprWidth, False), "default_repr_mutated": (EqWidth, True)}


class Narrow(nn.Module):
    """Stage 0: keeps the first ``cfg.n`` features, so the message's shape follows ``cfg``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, cfg=None) -> torch.Tensor:
        return torch.tanh(self.lin(x))[:, :cfg.n]


class Widen(nn.Module):
    """Stage 1: takes any width up to D (the rows of its weight it needs)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) / D ** 0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.w[: h.shape[1]]


def _narrow_widen(rank: int, world: int) -> tuple:
    """The two stages (this rank's under 1F1B over 2 microbatches, with its SGD) and the unsplit reference."""
    import pipeline_ext as pe

    torch.manual_seed(0)
    model = [Narrow(), Widen()]
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD([p for m in ref for p in m.parameters()], lr=0.1)
    stage = pe.PipelineStage(model[rank], rank, world, "cpu")
    sched = pe.Schedule1F1B(stage, 2, loss_fn=nn.functional.mse_loss, timeout=30.0)
    opt = torch.optim.SGD(model[rank].parameters(), lr=0.1)
    return model, ref, ref_opt, sched, opt


def _object_kwarg(rank: int, world: int, kind: str, per_microbatch: bool) -> list:
    model, ref, ref_opt, sched, opt = _narrow_widen(rank, world)
    make, in_place = WIDTHS[kind]
    cfg = make(8)
    problems = []
    for i, n in enumerate([8, 12, 8, 5, 12]):
        if in_place:
            cfg.n = n  # the same object, changed in place
        else:
            cfg = make(n)
        x, y = _batch(i)
        opt.zero_grad()
        losses: list = []
        if per_microbatch:  # step_microbatches: the second microbatch is 4 wider (dataclass) or the same object
            other = cfg if in_place else make(min(n + 4, D))
            cfgs = [cfg, other]
            xs, ys = [x[:4], x[4:]], [y[:4], y[4:]]
            if rank == 0:
                sched.step_microbatches([(a,) for a in xs], kwarg_mbs=[{"cfg": c} for c in cfgs])
            else:
                sched.step_microbatches(target_mbs=ys, losses=losses)
            # the unsplit model, microbatch by microbatch, each mean loss weighted by its rows (4 of 8)
            ref_opt.zero_grad()
            loss = sum(0.5 * nn.functional.mse_loss(ref[1](ref[0](a, cfg=c)), b) for a, b, c in zip(xs, ys, cfgs))
            loss.backward()
            ref_opt.step()
        else:
            if rank == 0:
                sched.step(x, cfg=cfg)
            else:
                sched.step(target=y, losses=losses)
            loss, _ = _reference_step(ref, ref_opt, x, y, cfg=cfg)
        opt.step()
        for p, q in zip(model[rank].parameters(), ref[rank].parameters()):
            if not torch.allclose(p, q, **TOL):
                problems.append(f"step {i} (width {n}): parameters differ from the unsplit model's")
        if rank == 1 and not torch.allclose(torch.stack(losses).mean(), loss.detach(), **TOL):
            problems.append(f"step {i} (width {n}): loss {float(torch.stack(losses).mean())} != {float(loss)}")
    return problems


@pytest.mark.parametrize("kind", sorted(WIDTHS))
@pytest.mark.parametrize("per_microbatch", [False, True], ids=["step", "step_microbatches"])
def test_an_object_argument_that_decides_the_output_shape_is_part_of_the_signature(kind, per_microbatch):
    out = rank_values(_object_kwarg, 2, kind, per_microbatch, timeout=120)
    assert out == {0: [], 1: []}


def test_object_leaves_are_keyed_by_value_or_anew_each_step():
    from pipeline_ext.comm.agreement import StepAgreement

    keys = StepAgreement(None, 0, 1, torch.device("cpu"), 1.0)
    x = torch.zeros(2, D)
    sig = lambda cfg: keys.microbatch_signatures([(x,)], [{"cfg": cfg}])[0]  # noqa: E731
    eight = Width(8)  # alive: an equal value later gets its signature
    assert sig(eight) == sig(Width(8)) != sig(Width(12))
    same = MutableWidth(8)
    assert sig(same) != sig(same)  # by identity: nothing later steps can trust
    for make in (HiddenWidth, ReprWidth):  # by value, whatever the repr says
        a, b = make(8), make(12)
        assert sig(a) == sig(make(8)) != sig(b), make
    import enum

    Mode = enum.Enum("Mode", ["NARROW", "WIDE"])
    assert sig(Mode.NARROW) == sig(Mode["NARROW"]) != sig(Mode.WIDE)  # a member is its own value
    changed = EqWidth(8)
    first = sig(changed)
    changed.n = 12
    assert sig(changed) != first and sig(EqWidth(12)) == sig(changed)
    changed.n = 8
    assert sig(changed) == first


@dataclasses.dataclass(frozen=True)
class Masked:
    """A step's config: compares by its width and step number, and carries a new 1 MiB tensor each step."""

    n: int
    step: int
    mask: torch.Tensor = dataclasses.field(compare=False, repr=False)


def test_the_signature_cache_keeps_no_argument_alive():
    import gc
    import weakref

    from pipeline_ext.comm.agreement import StepAgreement

    keys = StepAgreement(None, 0, 1, torch.device("cpu"), 1.0)
    x = torch.zeros(2, D)
    masks = []
    for i in range(64):
        cfg = Masked(8, i % 32, torch.zeros(256 * 1024))
        masks.append(weakref.ref(cfg.mask))
        keys.microbatch_signatures([(x,)] * 2, [{"cfg": cfg}] * 2)
    del cfg
    gc.collect()
    assert [m for m in masks if m() is not None] == []


def _masked_loop(rank: int, world: int, steps: int) -> list:
    """The user's loop: a new config holding a new 1 MiB tensor each step; the old ones must be freed."""
    import gc
    import weakref

    model, ref, ref_opt, sched, opt = _narrow_widen(rank, world)
    problems, masks = [], []
    for i in range(steps):
        cfg = Masked(8 if i % 3 else 12, i, torch.zeros(256 * 1024))
        masks.append(weakref.ref(cfg.mask))
        x, y = _batch(i)
        opt.zero_grad()
        losses: list = []
        if rank == 0:
            sched.step(x, cfg=cfg)
        else:
            sched.step(target=y, losses=losses)
        opt.step()
        loss, _ = _reference_step(ref, ref_opt, x, y, cfg=cfg)
        for p, q in zip(model[rank].parameters(), ref[rank].parameters()):
            if not torch.allclose(p, q, **TOL):
                problems.append(f"step {i}: parameters differ from the unsplit model's")
        if rank == 1 and not torch.allclose(torch.stack(losses).mean(), loss, **TOL):
            problems.append(f"step {i}: loss {float(torch.stack(losses).mean())} != {float(loss)}")
    del cfg
    gc.collect()
    alive = [i for i, m in enumerate(masks) if m() is not None]
    if alive:
        problems.append(f"{len(alive)} of {steps} steps' 1 MiB tensors are still alive: {alive[:8]}...")
    return problems


def test_a_new_object_argument_each_step_is_freed_after_its_step():
    out = rank_values(_masked_loop, 2, 64, timeout=180)
    assert out == {0: [], 1: []}


# -- select()'s recipe --------------------------------------------------------------------------------

def _select_recipe(rank: int, world: int, budgets: list) -> list:
    import pipeline_ext as pe
    from pipeline_ext import schedules as S

    problems, chosen = [], []
    for budget in budgets:
        sel = S.select(world, M, budget=budget)
        v = sel.chosen.stages_per_rank
        chosen.append(sel.schedule.name)
        model = _mlp(world * v, seed=1)
        ref = copy.deepcopy(model)
        ref_opt = torch.optim.SGD([p for m in ref for p in m.parameters()], lr=0.1)
        mine = [s for s, r in enumerate(sel.schedule.stage_to_rank) if r == rank]
        stages = [pe.PipelineStage(model[s], s, world * v, "cpu") for s in mine]
        sched = pe.PipelineSchedule(stages, sel.schedule, M, loss_fn=nn.functional.mse_loss, timeout=30.0)  # README
        opt = torch.optim.SGD([p for s in mine for p in model[s].parameters()], lr=0.1)
        for i in range(2):
            x, y = _batch(i)
            opt.zero_grad()
            losses: list = []
            sched.step(x, target=y, losses=losses)  # inputs and target on every rank: unused where not needed
            opt.step()
            loss, _ = _reference_step(ref, ref_opt, x, y)
            for s in mine:
                for p, q in zip(model[s].parameters(), ref[s].parameters()):
                    if not torch.allclose(p, q, **TOL):
                        problems.append(f"{sel.schedule.name}, step {i}: stage {s}'s parameters differ")
            if losses and not torch.allclose(torch.stack(losses).mean(), loss, **TOL):
                problems.append(f"{sel.schedule.name}, step {i}: loss differs")
    return [chosen, problems]


def test_the_readme_select_recipe_runs_every_choice_select_makes():
    out = rank_values(_select_recipe, 2, [1, 2], timeout=120)
    for rank, (chosen, problems) in out.items():
        assert chosen == ["auto", "zbv"], chosen  # below every built-in's peak: the greedy schedule
        assert problems == [], (rank, problems)


def test_auto_by_name_says_to_pass_the_schedule():
    from pipeline_ext import schedules as S

    with pytest.raises(S.ScheduleError, match=r"select\(\.\.\.\)\.schedule"):
        S.build("auto", 2, 4)


@dataclasses.dataclass(frozen=True)
class LooseWidth:
    """Equal whatever its width: the field that decides the shape takes no part in ``__eq__``."""

    n: int = dataclasses.field(compare=False)


def _loose_loop(rank: int, world: int) -> str:
    import pipeline_ext as pe

    torch.manual_seed(0)
    stage = pe.PipelineStage([Narrow(), Widen()][rank], rank, world, "cpu")
    sched = pe.Schedule1F1B(stage, 2, loss_fn=nn.functional.mse_loss, timeout=30.0)
    cfgs = [{"cfg": LooseWidth(8)}, {"cfg": LooseWidth(12)}]  # equal, so one signature, yet other shapes
    for i in range(2):
        x, y = _batch(i)
        try:
            if rank == 0:
                sched.step_microbatches([(x[:4],), (x[4:],)], kwarg_mbs=cfgs)
            else:
                sched.step_microbatches(target_mbs=[y[:4], y[4:]], losses=[])
        except Exception as exc:  # noqa: BLE001 - what the user reads is the test's subject
            return f"step {i}: {exc}"
    return "no error"


def test_an_object_equal_to_an_earlier_one_with_other_shapes_is_named_in_the_error():
    said = rank_values(_loose_loop, 2, timeout=120)[0]
    assert said.startswith("step 1:"), said
    assert "changed shape or dtype" in said and "cfg: LooseWidth" in said, said
    assert "__eq__ and __hash__" in said, said


# -- a keyword argument with one row per microbatch (torch's test_zero_bubble_with_model_kwargs) ---------

class Scaled(nn.Module):
    """Stage 0: its keyword argument holds one row per microbatch, not one per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * scale


class IgnoresScale(nn.Module):
    """A later stage: takes ``scale`` and leaves it unused (torch's ``MultiMLPKwargs`` layers do the same).

    torch hands a rank's keyword arguments to every stage of that rank, so
    under the interleaved schedule stage 2 (on rank 0) is given ``scale``
    too ([Note: keyword arguments per rank] in ``runtime/executor.py``).
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor, scale: torch.Tensor = None) -> torch.Tensor:
        return self.inner(x)


def _per_microbatch_kwarg(rank: int, world: int, name: str) -> list:
    import warnings

    import pipeline_ext as pe

    v = 2 if name == "interleaved_zb" else 1
    torch.manual_seed(0)
    model = [Scaled()] + [IgnoresScale(m) for m in _mlp(world * v - 1, seed=1)]
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD([p for m in ref for p in m.parameters()], lr=0.1)
    mine = [rank + i * world for i in range(v)]
    stages = [pe.PipelineStage(model[s], s, world * v, "cpu") for s in mine]
    cls = pe.ScheduleInterleavedZeroBubble if v == 2 else pe.Schedule1F1B
    sched = cls(stages if v == 2 else stages[0], M, loss_fn=nn.functional.mse_loss, timeout=30.0)
    opt = torch.optim.SGD([p for s in mine for p in model[s].parameters()], lr=0.1)
    problems, warned = [], []
    for i in range(3):
        x, y = _batch(i)
        scale = torch.linspace(0.5, 2.0, M).unsqueeze(1) + i  # M rows beside a batch of ROWS: one per microbatch
        opt.zero_grad()
        losses: list = []
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            _step(sched, rank, world, x, y, scale=scale)
        warned += [str(w.message) for w in said if "different numbers of rows" in str(w.message)]
        opt.step()
        # the unsplit model, microbatch by microbatch: microbatch k gets rows k of x and row k of scale
        ref_opt.zero_grad()
        loss = 0
        for k, (xk, yk) in enumerate(zip(x.tensor_split(M), y.tensor_split(M))):
            h = ref[0](xk, scale=scale[k : k + 1])
            for m in ref[1:]:
                h = m(h)
            loss = loss + nn.functional.mse_loss(h, yk) * (len(xk) / ROWS)
        loss.backward()
        ref_opt.step()
        for s in mine:
            for p, q in zip(model[s].parameters(), ref[s].parameters()):
                if not torch.allclose(p, q, **TOL):
                    problems.append(f"{name} step {i}: stage {s}'s parameters differ from the unsplit model's")
        if losses and not torch.allclose(torch.stack(losses).sum() / M, loss.detach(), **TOL):
            problems.append(f"{name} step {i}: loss {float(torch.stack(losses).sum() / M)} != {float(loss)}")
    if rank == 0 and len(warned) != 3:
        problems.append(f"{name}: rank 0 warned {len(warned)} times in 3 steps, not at every step: {warned[:1]}")
    return problems


@pytest.mark.parametrize("name", ["1f1b", "interleaved_zb"])
def test_a_keyword_argument_with_one_row_per_microbatch_is_split_on_its_own_as_torch_does(name):
    out = rank_values(_per_microbatch_kwarg, 2, name, timeout=120)
    assert out == {0: [], 1: []}
