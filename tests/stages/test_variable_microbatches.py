"""Microbatches of different shapes in one step (``step_microbatches``): exact under every schedule.

Length-bucketed and packed language-model batches hand the pipeline
microbatches of different sequence lengths (and rows). Every rank learns every
microbatch's signature in the step agreement, so each message's layout is
known before it arrives once that signature was seen in any earlier step, in
any position. The reference is the unsplit model run microbatch by microbatch:
with ``TokenMeanLoss`` the step's loss is the cross entropy over every valid
token of every microbatch, whatever their lengths.
"""
from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

import pipeline_ext as pe
from pipeline_ext import schedules as S
from pipeline_ext.comm.agreement import StepRejectedError
from pipeline_ext.comm.session import TRAIN
from mp_utils import rank_values, run_ranks
from models import ATOL, RTOL

VOCAB, D = 11, 8


class LMStage(nn.Module):
    """A causal language-model slice: embedding on the first stage, head on the last, causal mixing in each."""

    def __init__(self, first: bool, last: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D) if first else None
        self.ln, self.mix = nn.LayerNorm(D), nn.Linear(D, D)
        self.head = nn.Linear(D, VOCAB) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.emb is not None:
            x = self.emb(x)
        pos = torch.arange(1, x.shape[1] + 1, dtype=x.dtype).view(1, -1, 1)
        h = x + torch.tanh(self.mix(self.ln(x.cumsum(1) / pos)))  # position t sees tokens <= t only
        return self.head(h) if self.head is not None else h


def lm_stages(num_stages: int, seed: int = 0, model: str = "lm") -> list[nn.Module]:
    """``model``: "lm" (``LMStage``) or "gpt" (the demo's GPT: causal self-attention blocks)."""
    if model == "gpt":
        from pipeline_ext.demo.model import GPTConfig, gpt_stages

        cfg = GPTConfig(vocab=VOCAB, seq_len=16, d_model=16, heads=2, layers=num_stages)
        return gpt_stages(cfg, num_stages, seed)
    torch.manual_seed(seed)
    return [LMStage(i == 0, i == num_stages - 1) for i in range(num_stages)]


def lm_microbatches(shapes: list[tuple[int, int]], seed: int) -> tuple[list, list]:
    """Token ids and labels (some masked with -100) per microbatch of (rows, length)."""
    g = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for rows, length in shapes:
        xs.append(torch.randint(0, VOCAB, (rows, length), generator=g))
        y = torch.randint(0, VOCAB, (rows, length), generator=g)
        y[torch.rand(rows, length, generator=g) < 0.2] = -100
        ys.append(y)
    return xs, ys


def run_lm(model: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for m in model:
        x = m(x)
    return x


def reference_step(model: list[nn.Module], xs: list, ys: list) -> torch.Tensor:
    """The unsplit model over every microbatch: cross entropy over all valid tokens of the step."""
    logits = [run_lm(model, x).flatten(0, 1) for x in xs]
    loss = nn.functional.cross_entropy(torch.cat(logits), torch.cat([y.flatten() for y in ys]), ignore_index=-100)
    loss.backward()
    return loss.detach()


# 4 sequence lengths in one step; the same shapes in another order; new shapes
STEPS_2 = [[(2, 5), (1, 9), (3, 3), (2, 7)], [(3, 3), (2, 7), (2, 5), (1, 9)], [(2, 4), (2, 6), (1, 10), (3, 2)]]


def _steps_for(n: int) -> list[list[tuple[int, int]]]:
    return [(shapes * (n // len(shapes)))[:n] for shapes in STEPS_2]


def _place(name: str, world: int, n: int) -> tuple[int, list[int]]:
    v = S.default_stages_per_rank(name)
    return world * v, list(S.build(name, world, n, stages_per_rank=v).stage_to_rank)


def _every_schedule(rank: int, world: int, n: int, names: list[str], model: str = "lm") -> dict:
    """Per schedule: max |difference| of the losses and the parameters after each step, and the cache sizes."""
    out = {}
    for name in names:
        num_stages, placement = _place(name, world, n)
        full = lm_stages(num_stages, model=model)
        reference = copy.deepcopy(full)
        mine = [s for s, r in enumerate(placement) if r == rank]
        stages = [pe.PipelineStage(full[s], s, num_stages, "cpu") for s in mine]
        loss_fn = pe.TokenMeanLoss()
        sched = pe.PipelineSchedule(stages, name, n, loss_fn=loss_fn)
        opt = torch.optim.SGD([p for s in mine for p in full[s].parameters()], lr=0.5)
        ref_opt = torch.optim.SGD([p for m in reference for p in m.parameters()], lr=0.5)
        worst, cached = 0.0, []
        for step, shapes in enumerate(_steps_for(n)):
            xs, ys = lm_microbatches(shapes, seed=step)
            losses: list = []
            outs = sched.step_microbatches(xs if sched.has_first_stage else None,
                                           target_mbs=ys if sched.has_last_stage else None, losses=losses)
            ref_loss = reference_step(reference, xs, ys)
            if sched.has_last_stage:
                assert [tuple(o.shape[:2]) for o in outs] == shapes  # one output per microbatch, its own shape
                worst = max(worst, abs(float(loss_fn.combine(losses)) - float(ref_loss)))
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
            if step == 0:  # validation between training steps, on microbatches in another order
                evals = sched.eval_microbatches(xs[::-1] if sched.has_first_stage else None)
                if sched.has_last_stage:
                    with torch.no_grad():
                        want = [run_lm(reference, x) for x in xs[::-1]]
                    worst = max(worst, max(float((o - w).abs().max()) for o, w in zip(evals, want)))
            for s in mine:
                for p, q in zip(full[s].parameters(), reference[s].parameters()):
                    worst = max(worst, float((p - q).abs().max()))
            cached.append(len(sched._session._plans[TRAIN]))
        out[name] = (worst, cached)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, n", [(2, 4), pytest.param(4, 8, marks=pytest.mark.slow)])
def test_every_schedule_is_exact_with_microbatches_of_different_lengths(world, n):
    names = S.available()
    results = rank_values(_every_schedule, world, n, names, timeout=280)
    for rank, per_schedule in results.items():
        for name, (worst, cached) in per_schedule.items():
            assert worst < 1e-5, f"rank {rank}, {name}: differs from the unsplit model by {worst}"
            # 4 signatures learnt; the same 4 in another order are known (nothing new); then 4 new ones
            assert cached == [4, 4, 8], f"rank {rank}, {name}: microbatch signatures cached {cached}"


@pytest.mark.timeout(120)
def test_the_demo_gpt_with_token_mean_loss_is_exact_with_microbatches_of_different_lengths():
    """Causal self-attention over sequences of 4 lengths (the demo's GPT), 1F1B and ZBV."""
    results = rank_values(_every_schedule, 2, 4, ["1f1b", "zbv"], "gpt", timeout=100)
    for rank, per_schedule in results.items():
        for name, (worst, cached) in per_schedule.items():
            assert worst < 1e-5 and cached == [4, 4, 8], (rank, name, worst, cached)


def _disagreements(rank: int, world: int) -> list[str]:
    """Bad microbatch lists are rejected on every rank with a named error, and the ranks stay in step."""
    full = lm_stages(2)
    sched = pe.Schedule1F1B(pe.PipelineStage(full[rank], rank, 2, "cpu"), 4, loss_fn=pe.TokenMeanLoss())
    xs, ys = lm_microbatches(STEPS_2[0], seed=0)
    said = []

    def attempt(arg_mbs, target_mbs) -> None:
        try:
            sched.step_microbatches(arg_mbs if rank == 0 else None, target_mbs=target_mbs if rank == 1 else None)
            said.append("accepted")
        except (ValueError, TypeError, StepRejectedError) as exc:
            said.append(f"{type(exc).__name__}: {exc}")

    attempt(xs, ys[:3])  # the last rank has 3 targets for 4 microbatches
    attempt(xs, [ys[1], ys[0], ys[2], ys[3]])  # targets in another order: rows per microbatch differ
    attempt(xs[:3], ys)  # the first rank has 3 microbatches
    attempt(xs, ys)  # and the ranks are still in step
    return said


def test_a_step_whose_ranks_disagree_about_the_microbatches_is_rejected_everywhere():
    said = rank_values(_disagreements, 2, timeout=60)
    assert "target_mbs has 3 entries but the schedule runs n_microbatches=4" in said[1][0]
    assert said[0][0].startswith("StepRejectedError") and "rank 1: ValueError: target_mbs has 3" in said[0][0]
    for rank in (0, 1):
        assert said[rank][1].startswith("StepRejectedError") and "other rows than the inputs' microbatches" in \
            said[rank][1], said[rank][1]
    assert "arg_mbs has 3 entries" in said[0][2] and "rank 0: ValueError: arg_mbs has 3" in said[1][2]
    assert said[0][3] == said[1][3] == "accepted"


def _torch_private_name(rank: int, world: int) -> bool:
    """torch's ``_step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses)`` runs the same step."""
    full = lm_stages(2)
    reference = copy.deepcopy(full)
    stage = pe.PipelineStage(full[rank], rank, 2, "cpu")
    sched = pe.ScheduleZBH1(stage, 4, loss_fn=pe.TokenMeanLoss())
    xs, ys = lm_microbatches(STEPS_2[0], seed=3)
    kwarg_mbs = [{} for _ in xs]
    sched._step_microbatches([(x,) for x in xs] if rank == 0 else None, kwarg_mbs if rank == 0 else None,
                             ys if rank == 1 else None)
    reference_step(reference, xs, ys)
    ok = all(torch.allclose(p.grad, q.grad, rtol=RTOL, atol=ATOL)
             for p, q in zip(full[rank].parameters(), reference[rank].parameters()))
    if rank == 1:  # torch leaves the outputs on the stage
        ok = ok and [tuple(o.shape[:2]) for o in stage.output_chunks] == STEPS_2[0]
    return ok


def _eval(rank: int, world: int) -> bool:
    """``eval_microbatches``: each microbatch's output and loss as the unsplit model's, no gradient anywhere."""
    full = lm_stages(2)
    sched = pe.Schedule1F1B(pe.PipelineStage(full[rank], rank, 2, "cpu"), 4, loss_fn=pe.TokenMeanLoss())
    xs, ys = lm_microbatches(STEPS_2[0], seed=5)
    losses: list = []
    outs = sched.eval_microbatches(xs if rank == 0 else None, target_mbs=ys if rank == 1 else None, losses=losses)
    ok = all(p.grad is None for p in full[rank].parameters())
    if rank == 1:
        with torch.no_grad():
            want = [full[1](full[0](x)) for x in xs]
        ok = ok and len(outs) == 4 and all(torch.allclose(o, w, rtol=RTOL, atol=ATOL) for o, w in zip(outs, want))
        ce = [nn.functional.cross_entropy(w.flatten(0, 1), y.flatten(), ignore_index=-100) for w, y in zip(want, ys)]
        ok = ok and len(losses) == 4 and all(torch.allclose(a, b, rtol=RTOL, atol=ATOL) for a, b in zip(losses, ce))
    return ok


def test_eval_microbatches_gives_each_microbatchs_output_and_loss():
    assert all(rank_values(_eval, 2, timeout=60).values())


def test_torch_private_step_microbatches_name_runs_the_same_step():
    assert all(rank_values(_torch_private_name, 2, timeout=60).values())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_pipe_takes_microbatches_of_different_lengths(schedule):
    full = lm_stages(2)
    reference = copy.deepcopy(full)
    pipe = pe.Pipe(nn.Sequential(*full), balance=[1, 1], devices=["cpu", "cpu"], chunks=4, schedule=schedule)
    for step, shapes in enumerate(STEPS_2):
        xs, ys = lm_microbatches(shapes, seed=step)
        x0 = [x.clone() for x in xs]
        loss = pipe.step_microbatches(xs, target_mbs=ys, loss_fn=pe.TokenMeanLoss())
        ref = reference_step(reference, xs, ys)
        torch.testing.assert_close(loss, ref, rtol=RTOL, atol=ATOL)
        for p, q in zip(pipe.parameters(), (q for m in reference for q in m.parameters())):
            torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)
        pipe.zero_grad()
        for m in reference:
            m.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(xs, x0))  # the caller's microbatches are untouched


def test_pipe_names_a_target_whose_rows_do_not_match_its_microbatch():
    pipe = pe.Pipe(nn.Sequential(*lm_stages(2)), balance=[1, 1], devices=["cpu", "cpu"], chunks=2)
    xs, ys = lm_microbatches([(2, 5), (1, 9)], seed=0)
    with pytest.raises(ValueError, match=r"target_mbs\[0\] has 1 rows but microbatch 0 of the inputs has 2"):
        pipe.step_microbatches(xs, target_mbs=[ys[1], ys[0]], loss_fn=pe.TokenMeanLoss())


def _random_lengths(rank: int, world: int, name: str, steps: int, every: int) -> list[float]:
    """Random rows and lengths per microbatch for many steps; every ``every``-th step compared."""
    full = lm_stages(2)
    reference = copy.deepcopy(full)
    sched = pe.PipelineSchedule([pe.PipelineStage(full[rank], rank, 2, "cpu")], name, 4, loss_fn=pe.TokenMeanLoss())
    rng = random.Random(7)  # the same on both ranks
    diffs = []
    for step in range(steps):
        shapes = [(rng.randint(1, 3), rng.randint(1, 16)) for _ in range(4)]
        xs, ys = lm_microbatches(shapes, seed=step)
        sched.step_microbatches(xs if rank == 0 else None, target_mbs=ys if rank == 1 else None)
        if step % every == 0:
            reference_step(reference, xs, ys)
            diffs.append(max(float((p.grad - q.grad).abs().max())
                             for p, q in zip(full[rank].parameters(), reference[rank].parameters())))
            for m in reference:
                m.zero_grad()
        full[rank].zero_grad()
    return diffs


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["1f1b", "zb_h1"])
def test_a_thousand_steps_of_random_lengths(name):
    results = run_ranks(_random_lengths, 2, name, 1000, 100, timeout=560)
    for rank, (_, diffs) in results.items():
        assert len(diffs) == 10 and max(diffs) < 1e-5, (rank, diffs)


def _too_many_signatures(rank: int, world: int, n: int) -> tuple[float, list[int]]:
    """More distinct microbatch shapes than a step record describes: exchanged every step, never cached."""
    full = lm_stages(2)
    reference = copy.deepcopy(full)
    sched = pe.Schedule1F1B(pe.PipelineStage(full[rank], rank, 2, "cpu"), n, loss_fn=pe.TokenMeanLoss())
    worst, cached = 0.0, []
    for step in range(2):
        xs, ys = lm_microbatches([(1, length + 1) for length in range(n)], seed=step)
        sched.step_microbatches(xs if rank == 0 else None, target_mbs=ys if rank == 1 else None)
        reference_step(reference, xs, ys)
        worst = max(worst, max(float((p.grad - q.grad).abs().max())
                               for p, q in zip(full[rank].parameters(), reference[rank].parameters())))
        cached.append(len(sched._session._plans[TRAIN]))
    return worst, cached


def test_more_distinct_shapes_than_a_record_describes_are_exchanged_every_step():
    from pipeline_ext.comm.agreement import MAX_SIGNATURES

    for rank, (worst, cached) in rank_values(_too_many_signatures, 2, MAX_SIGNATURES + 2, timeout=120).items():
        assert worst < 1e-5 and cached == [0, 0], (rank, worst, cached)
