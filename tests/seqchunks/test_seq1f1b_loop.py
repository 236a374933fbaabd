"""Sequence pieces in a whole training loop: eval between steps, a failed step, the steps after; exact.

A training loop does more than ``step()``: it evaluates between steps (a
forward-only schedule over the same pieces, no backward, so no carry may be
left for a backward that never comes) and skips a batch whose step failed
(a module that raised in the middle of a sequence, with earlier pieces'
keys and values carried and their gradients half collected). The steps after
either must be those of the unsplit model on the whole sequences.
"""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.nn.functional as F

from models import TOL
from mp_utils import rank_values
from test_seq1f1b_pipeline import DIM, M, ROWS, SEQ, _stages, _unsplit


def _loop(rank: int, world: int, name: str, k: int) -> list[str]:
    import pipeline_ext as pe

    stages, ref = _stages(world), _stages(world)
    sched = pe.get_schedule_class(name)(pe.PipelineStage(stages[rank], rank, world, "cpu"), M, loss_fn=F.mse_loss,
                                        seq_chunks=k, timeout=60)
    opt = torch.optim.SGD(stages[rank].parameters(), lr=0.1)
    ref_opt = torch.optim.SGD([p for m in ref for p in m.parameters()], lr=0.1)
    forwards = [0]

    def flaky(module, args):  # the last stage raises in piece 1 of sequence 1 of step 1, mid-sequence
        forwards[0] += 1
        if forwards[0] == 2 * M * k + k + 2:  # step 0 and the eval after it ran M * k each
            raise ValueError("boom in the user's module")

    if rank == world - 1:
        stages[rank].register_forward_pre_hook(flaky)
    said: list[str] = []
    first, last = rank == 0, rank == world - 1
    for i in range(4):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(ROWS, SEQ, DIM, generator=g), torch.randn(ROWS, SEQ, DIM, generator=g)
        xs, ys = list(x.chunk(M)), list(y.chunk(M))
        opt.zero_grad(set_to_none=True)
        try:
            sched.step(*((x,) if first else ()), target=y if last else None)
        except Exception as exc:  # a loop that skips a bad batch
            said.append(f"{i}:{type(exc).__name__}")
            continue
        ref_opt.zero_grad(set_to_none=True)
        _unsplit(ref, xs, ys).backward()
        for (n, p), q in zip(stages[rank].named_parameters(), ref[rank].parameters()):
            if not torch.allclose(p.grad, q.grad, **TOL):
                said.append(f"step {i}: {n}'s gradient differs from the unsplit model's")
        opt.step()
        ref_opt.step()
        # eval between steps: the merged outputs and one loss per piece, the unsplit model's
        losses: list = []
        out = sched.eval(*((x,) if first else ()), target=y if last else None, losses=losses)
        if last:
            with torch.no_grad():
                whole = x
                for m in ref:
                    whole = m(whole)
            if not torch.allclose(out, whole, **TOL):
                said.append(f"eval after step {i}: the outputs differ from the unsplit model's")
            if len(losses) != M * k:
                said.append(f"eval after step {i}: {len(losses)} losses, not one per piece ({M * k})")
        held = sched.stages[rank]._runner.pieces.held()
        if held:
            said.append(f"after eval {i}: carries still held for sequences {held}")
    return said


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", ["1f1b", "zb_h1"])
def test_eval_between_steps_and_a_failed_step_leave_the_next_steps_exact(name):
    said = rank_values(_loop, 2, name, 2, timeout=150)
    assert said[1] == ["1:ValueError"], said
    assert said[0] == ["1:StepFailedError"] or (len(said[0]) == 1 and said[0][0].startswith("1:")), said


def _objective(rank: int, world: int, name: str, k: int, split: object) -> list[str]:
    """The same schedule with and without pieces, on microbatches of different lengths: equal gradients."""
    import pipeline_ext as pe

    said: list[str] = []
    for scale_grads in (True, False):
        grads = []
        for pieces in (1, k):
            stages = _stages(world)
            sched = pe.get_schedule_class(name)(pe.PipelineStage(stages[rank], rank, world, "cpu"), M,
                                                loss_fn=F.mse_loss, seq_chunks=pieces, seq_split=split,
                                                scale_grads=scale_grads, timeout=60)
            g = torch.Generator().manual_seed(7)
            lengths = [SEQ, SEQ - 4, SEQ - 2, SEQ][:M]
            xs = [torch.randn(ROWS // M, n, DIM, generator=g) for n in lengths]
            ys = [torch.randn(ROWS // M, n, DIM, generator=g) for n in lengths]
            sched.step_microbatches([(x,) for x in xs] if rank == 0 else None,
                                    target_mbs=ys if rank == world - 1 else None)
            grads.append([p.grad for p in stages[rank].parameters()])
        for i, (a, b) in enumerate(zip(*grads)):
            if not torch.allclose(a, b, **TOL):
                said.append(f"scale_grads={scale_grads} parameter {i}: pieces change the gradient "
                            f"(max {(a - b).abs().max():.3g})")
    return said


@pytest.mark.timeout(200)
def test_pieces_keep_the_objective_of_the_schedule_without_them():
    """A microbatch weighs what it weighs without pieces (its rows' share, or 1 with ``scale_grads=False``),
    shared among its pieces by length: turning ``seq_chunks`` on changes no gradient, also when the microbatches
    have different lengths."""
    said = rank_values(_objective, 2, "zb_h1", 2, 0.6, timeout=150)
    assert not said[0] and not said[1], said


def _given_schedule(rank: int, world: int, name: str) -> list[str]:
    """A ``Schedule`` over pieces handed in (renamed, so only its ``pieces`` says it): the step of the built-in
    over the same pieces, exact against the unsplit model; a ``seq_chunks`` that contradicts it is refused."""
    import dataclasses

    import pipeline_ext as pe
    from pipeline_ext.schedules.pieces import PIECE_SCHEDULES, build_pieces

    said: list[str] = []
    v = PIECE_SCHEDULES[name]
    mine = dataclasses.replace(build_pieces(name, world, M, 2), name="my order")
    n = world * v
    stages, ref = _stages(n), _stages(n)
    held = [s for s in range(n) if mine.stage_to_rank[s] == rank]
    given = [pe.PipelineStage(stages[s], s, n, "cpu") for s in held]
    try:
        pe.PipelineSchedule(given, mine, M, loss_fn=F.mse_loss, seq_chunks=4)
        said.append("seq_chunks=4 with a schedule over 2 pieces was accepted")
    except ValueError as exc:
        if "over seq_chunks=2 pieces, but seq_chunks=4" not in str(exc):
            said.append(f"unclear refusal: {exc}")
    sched = pe.PipelineSchedule(given, mine, M, loss_fn=F.mse_loss, timeout=60)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(ROWS, SEQ, DIM, generator=g), torch.randn(ROWS, SEQ, DIM, generator=g)
    losses: list = []
    first, last = 0 in held, n - 1 in held
    sched.step(*((x,) if first else ()), target=y if last else None, losses=losses)
    _unsplit(ref, list(x.chunk(M)), list(y.chunk(M))).backward()
    for s in held:
        for (pn, p), q in zip(stages[s].named_parameters(), ref[s].parameters()):
            if not torch.allclose(p.grad, q.grad, **TOL):
                said.append(f"stage {s} {pn}'s gradient differs from the unsplit model's")
    if last and len(losses) != M * 2:
        said.append(f"{len(losses)} losses, not one per piece ({M * 2})")
    # torch's round trips keep the order over pieces: pipeline_order, and its CSV written and read back
    def order() -> tuple:
        return sched.schedule.actions, sched.schedule.n_microbatches, sched.schedule.pieces

    before = order()
    sched.pipeline_order = sched.pipeline_order
    if order() != before:
        said.append("pipeline_order assigned back changed the schedule")
    path = f"{tempfile.gettempdir()}/pieces_order_{os.getpid()}.csv"
    sched._dump_csv(path)
    try:
        sched._load_csv(path)
    finally:
        os.unlink(path)
    if order() != before:
        said.append("the schedule read back from torch's CSV differs")
    return said


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", ["1f1b", "interleaved_1f1b"])
def test_a_schedule_over_pieces_runs_its_pieces(name):
    said = rank_values(_given_schedule, 2, name, timeout=150)
    assert not said[0] and not said[1], said
