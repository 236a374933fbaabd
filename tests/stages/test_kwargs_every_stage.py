"""Each rank's keyword arguments reach every stage of that rank, as in torch 2.13.

torch's schedules call ``forward_one_chunk(mb, arg_mbs[mb], kwarg_mbs[mb])``
on every stage, and a non-first stage runs ``module(*received, **kwargs)``:
each rank's own keyword arguments, cut into microbatches on that rank, reach
each of its stages (torchtitan passes attention masks so, on every rank).
Before, a stage other than stage 0 got none and a stage with ``mask=None`` as
default ran without its mask: a silently wrong answer. Every test is the
user's loop on 2 ranks against the unsplit model in which every stage gets its
rank's mask ([Note: keyword arguments per rank] in ``runtime/executor.py``):

- ``step(x, mask=m0)`` on rank 0 and ``step(mask=m1, target=y)`` on rank 1
  (each rank a mask of its own), and the same through ``step_microbatches(
  kwarg_mbs=)``, under 1F1B, ZB-H1, interleaved 1F1B and ZBV (two stages per
  rank: both get the rank's mask); 10 rows into 4 microbatches (uneven);
- a keyword argument given on rank 1 alone that decides the shape its stage
  sends (``width=``) takes part in the step's signature ([Note: keyword
  arguments salt the signatures] in ``comm/agreement.py``): a new value
  exchanges its layouts again;
- bad keyword arguments on rank 1 are its rejection of the step, named; rank
  0 raises ``StepRejectedError``, and both go on; keyword arguments cut into
  other rows than the batch are warned about on their rank.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from mp_utils import rank_values
from models import TOL

D, ROWS, M, STEPS = 8, 10, 4, 3
SCHEDULES = {"1f1b": 1, "zb_h1": 1, "interleaved_1f1b": 2, "zbv": 2}  # name: stages per rank


class Masked(nn.Module):
    """A stage that multiplies its activations by ``mask`` when given (a mask left out runs unmasked)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, mask: torch.Tensor = None) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        return h * mask if mask is not None else h


def _placement(name: str, world: int) -> list[int]:
    """The rank of each stage."""
    v = SCHEDULES[name]
    if name == "zbv":
        return [s if s < world else 2 * world - 1 - s for s in range(world * v)]
    return [s % world for s in range(world * v)]


def _schedule(name: str, stages: list):
    import pipeline_ext as pe

    loss = nn.functional.mse_loss
    if name == "1f1b":
        return pe.Schedule1F1B(stages[0], M, loss_fn=loss, timeout=30.0)
    if name == "zb_h1":
        return pe.ScheduleZBH1(stages[0], M, loss_fn=loss, timeout=30.0)
    if name == "interleaved_1f1b":
        return pe.ScheduleInterleaved1F1B(stages, M, loss_fn=loss, timeout=30.0)
    return pe.ScheduleZBVZeroBubble(stages, M, loss_fn=loss, timeout=30.0)


def _data(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The step's batch, target, and one mask per rank (every rank's its own)."""
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(ROWS, D, generator=g), torch.randn(ROWS, D, generator=g)
    masks = [0.25 + torch.rand(ROWS, D, generator=g) * (r + 1) for r in range(world)]
    return x, y, masks


def _masked_loop(rank: int, world: int, name: str, how: str) -> list[str]:
    """The user's loop: every rank passes its own mask, every stage multiplies by its rank's."""
    import pipeline_ext as pe

    placement = _placement(name, world)
    ns = len(placement)
    torch.manual_seed(0)
    model = [Masked() for _ in range(ns)]
    ref = copy.deepcopy(model)
    mine = [s for s in range(ns) if placement[s] == rank]
    stages = [pe.PipelineStage(model[s], s, ns, "cpu") for s in mine]
    sched = _schedule(name, stages)
    opt = torch.optim.SGD([p for s in mine for p in model[s].parameters()], lr=0.1)
    ref_opt = torch.optim.SGD([p for m in ref for p in m.parameters()], lr=0.1)
    first, last = 0 in mine, ns - 1 in mine
    bad: list[str] = []
    for step in range(STEPS):
        x, y, masks = _data(step, world)
        losses: list = []
        if how == "step":
            out = sched.step(*((x,) if first else ()), target=y if last else None, losses=losses, mask=masks[rank])
        else:  # torchtitan's form: the batch already cut, kwarg_mbs on every rank
            out = sched.step_microbatches(
                [(c,) for c in x.tensor_split(M)] if first else None,
                kwarg_mbs=[{"mask": c} for c in masks[rank].tensor_split(M)],
                target_mbs=list(y.tensor_split(M)) if last else None, losses=losses)
            out = torch.cat(out) if out is not None else None
        # the unsplit model: stage s multiplies by the mask of the rank that holds it
        h = x
        for s, m in enumerate(ref):
            h = m(h, mask=masks[placement[s]])
        ref_loss = nn.functional.mse_loss(h, y)
        ref_opt.zero_grad()
        ref_loss.backward()
        where = f"{name} {how} rank {rank} step {step}"
        if last:
            got = sum(float(l) * len(c) / ROWS for l, c in zip(losses, y.tensor_split(M)))
            if abs(got - float(ref_loss)) > 1e-5:
                bad.append(f"{where}: loss {got} vs the unsplit model's {float(ref_loss)}")
            if not torch.allclose(out, h.detach(), **TOL):
                bad.append(f"{where}: output differs by {(out - h).abs().max():.3g}")
        for s in mine:
            for (pname, p), q in zip(model[s].named_parameters(), ref[s].parameters()):
                if p.grad is None or not torch.allclose(p.grad, q.grad, **TOL):
                    err = "missing" if p.grad is None else f"differs by {(p.grad - q.grad).abs().max():.3g}"
                    bad.append(f"{where}: stage {s} {pname}.grad {err}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
    return bad


@pytest.mark.parametrize("how", ["step", "step_microbatches"])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_stage_gets_its_ranks_keyword_arguments_as_in_torch(name, how):
    said = rank_values(_masked_loop, 2, name, how, timeout=120)
    assert said == {0: [], 1: []}, said


# -- a keyword argument on a later rank that decides a shape ------------------------------------------------

class Narrowed(nn.Module):
    """Sends its first ``width`` features (the rest zero-padded back by the next stage): shapes from a kwarg."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, width: int = D) -> torch.Tensor:
        x = nn.functional.pad(x, (0, D - x.shape[-1]))
        return torch.tanh(self.lin(x))[:, :width]


def _width_loop(rank: int, world: int) -> list[str]:
    """ZBV on 2 ranks: rank 1 holds stages 1 and 2 and passes ``width=``; stage 2's message to rank 0 follows it."""
    import pipeline_ext as pe

    placement = _placement("zbv", world)
    torch.manual_seed(0)
    model = [Narrowed() for _ in range(4)]
    ref = copy.deepcopy(model)
    mine = [s for s in range(4) if placement[s] == rank]
    sched = _schedule("zbv", [pe.PipelineStage(model[s], s, 4, "cpu") for s in mine])
    bad: list[str] = []
    for step, width in enumerate([D, D - 3, D, D - 3]):
        x, y, _ = _data(step, world)
        losses: list = []
        for m in model + ref:
            m.zero_grad()
        try:
            if rank == 0:
                sched.step(x, target=y, losses=losses)
            else:
                sched.step(width=width)
        except Exception as exc:  # noqa: BLE001 - what the user reads is the test's subject
            bad.append(f"rank {rank} step {step} (width {width}): {type(exc).__name__}: {exc}")
            break
        h = x
        for s, m in enumerate(ref):
            h = m(h, width=width) if placement[s] == 1 else m(h)
        ref_loss = nn.functional.mse_loss(h, y)
        ref_loss.backward()
        if rank == 0:
            got = sum(float(l) * len(c) / ROWS for l, c in zip(losses, y.tensor_split(M)))
            if abs(got - float(ref_loss)) > 1e-5:
                bad.append(f"step {step} (width {width}): loss {got} vs {float(ref_loss)}")
        for s in mine:
            for p, q in zip(model[s].parameters(), ref[s].parameters()):
                if not torch.allclose(p.grad, q.grad, **TOL):
                    bad.append(f"step {step} (width {width}): stage {s}'s gradients differ")
    return bad


def test_a_keyword_argument_on_a_later_rank_that_decides_a_shape_is_part_of_the_signature():
    said = rank_values(_width_loop, 2, timeout=120)
    assert said == {0: [], 1: []}, said


# -- refusals and warnings on a later rank ---------------------------------------------------------------------

def _bad_kwargs(rank: int, world: int) -> list[str]:
    """Rank 1 passes a mask it cannot cut, a 0-d one, one with a row per microbatch (torch's own test's kind of
    keyword argument, cut into other rows than the batch), then a good one."""
    import pipeline_ext as pe

    torch.manual_seed(0)
    model = [Masked() for _ in range(world)]
    sched = _schedule("1f1b", [pe.PipelineStage(model[rank], rank, world, "cpu")])
    x, y, masks = _data(0, world)
    said: list[str] = []
    cases = [("too few rows", masks[rank][:3]), ("0-d", torch.tensor(2.0)), ("other rows", masks[rank][:M]),
             ("good", masks[rank])]
    for what, mask in cases:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if rank == 0:
                    sched.step(x, mask=masks[0])
                else:
                    sched.step(target=y, mask=mask)
                said.append(f"{what}: ran")
            except Exception as exc:  # noqa: BLE001 - what the user reads is the test's subject
                said.append(f"{what}: {type(exc).__name__}: {exc}")
        said += [f"{what}: warned: {w.message}" for w in caught if "keyword arguments" in str(w.message)]
    return said


def test_bad_keyword_arguments_on_a_later_rank_are_its_rejection_named_and_other_rows_warn():
    said = rank_values(_bad_kwargs, 2, timeout=120)
    r0, r1 = said[0], said[1]
    # too few rows: rank 1 names the argument; rank 0 is told which rank rejected and why, nothing waits
    assert r1[0].startswith("too few rows: ValueError") and "kwargs['mask']" in r1[0] and "3 rows" in r1[0], r1
    assert r0[0].startswith("too few rows: StepRejectedError") and "rank 1" in r0[0], r0
    assert "kwargs['mask']" in r0[0], r0
    assert r1[1].startswith("0-d: ValueError") and "kwargs['mask']" in r1[1], r1
    assert r0[1].startswith("0-d: StepRejectedError") and "rank 1" in r0[1], r0
    # other rows: cut on their own as torch does, said on rank 1 with both cuts, before its stage runs
    warned = [s for s in r1 if s.startswith("other rows: warned")]
    assert len(warned) == 1 and "mask=" in warned[0] and "1, 1, 1, 1" in warned[0], r1
    assert "3, 3, 2, 2" in warned[0] and "rank 0" in warned[0], warned
    assert "other rows: ran" in r1 and "other rows: ran" in r0, said
    # and the ranks are still in step: a good step runs, without a warning
    assert r0[-1] == "good: ran" and r1[-1] == "good: ran", said
