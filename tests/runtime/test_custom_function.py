"""register_custom_function (torch's hook, torchtitan's DualPipeV overlap) over 2 Gloo ranks.

A registered function is called for its actions with torch's ``_PipelineContext``
and runs each microbatch through the stages' per-microbatch API; the trained
parameters equal those of the same schedule without the function and of the
unsplit model. A function that raises fails the step on every rank, named.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from models import build, make_batch, run_stages, TOL
from mp_utils import rank_values, run_ranks

M = 4  # microbatches (dualpipev needs m >= 2p)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def _train(rank: int, world: int, schedule_name: str, register: str) -> dict:
    """One training step of ``schedule_name``; with ``register``, through functions given to the schedule."""
    import pipeline_ext as pe
    from torch.distributed.pipelining.schedules import (BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD,
                                                        OVERLAP_F_B)

    v = 2
    modules = build("mlp", v * world)
    mine = [rank, 2 * world - 1 - rank]  # V placement
    stages = [pe.PipelineStage(modules[s], s, v * world, "cpu") for s in mine]
    cls = pe.get_schedule_class(schedule_name)
    sched = cls(stages, M, loss_fn=_loss)
    calls: list[tuple[str, int, int]] = []
    contexts = []

    def forward(action, ctx):
        stage = {st.stage_index: st for st in ctx.schedule_ref._stages}[action.stage_index]
        calls.append(("F", action.stage_index, action.microbatch_index))
        contexts.append(ctx)
        stage.forward_one_chunk(action.microbatch_index, ctx.arg_mbs[action.microbatch_index])

    def backward(action, ctx):
        stage = {st.stage_index: st for st in ctx.schedule_ref._stages}[action.stage_index]
        full = str(action).endswith(f"B{action.microbatch_index}")
        calls.append(("B" if full else "I", action.stage_index, action.microbatch_index))
        stage.backward_one_chunk(action.microbatch_index, full_backward=full)

    def weight(action, ctx):
        stage = {st.stage_index: st for st in ctx.schedule_ref._stages}[action.stage_index]
        calls.append(("W", action.stage_index, action.microbatch_index))
        stage.backward_weight_one_chunk(action.microbatch_index)

    def overlap(action, ctx):
        f, b = action.sub_actions
        calls.append(("PAIR", f.stage_index, b.stage_index))
        by_index = {st.stage_index: st for st in ctx.schedule_ref._stages}
        by_index[f.stage_index].forward_one_chunk(f.microbatch_index, ())  # the forward first, as torchtitan
        by_index[b.stage_index].backward_one_chunk(b.microbatch_index, full_backward=True)

    if register:
        sched.register_custom_function(FORWARD, forward)
        sched.register_custom_function(FULL_BACKWARD, backward)
        sched.register_custom_function(BACKWARD_INPUT, backward)
        sched.register_custom_function(BACKWARD_WEIGHT, weight)
        if register == "overlap":
            sched.register_custom_function(OVERLAP_F_B, overlap)
    x, y = make_batch("mlp", 8)
    losses: list = []
    sched.step(x if rank == 0 else None, target=y if rank == 0 else None, losses=losses)
    n_compute = sum(1 for a in sched.schedule.actions[rank] if a.is_compute)
    return {
        # as lists: tensors through the result queue would be shared memory the exiting rank takes along
        "grads": {s: [p.grad.tolist() for p in modules[s].parameters()] for s in mine},
        "calls": calls,
        "n_compute": n_compute,
        "n_pairs": sum(1 for a, _ in sched.schedule.overlapped if a.stage in mine),
        "ctx_ok": all(c.schedule_ref is sched and len(c.arg_mbs) == M for c in contexts),
        "loss": float(sum(losses)) if losses else None,
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize("register", ["overlap", "each"])
def test_registered_functions_run_the_actions_and_train_the_same(register):
    plain = rank_values(_train, 2, "dualpipev", "", timeout=200)
    hooked = rank_values(_train, 2, "dualpipev", register, timeout=200)
    modules = build("mlp", 4)
    ref = copy.deepcopy(modules)
    x, y = make_batch("mlp", 8)
    _loss(run_stages(ref, x), y).backward()
    for rank in (0, 1):
        h, p = hooked[rank], plain[rank]
        assert h["ctx_ok"]
        pairs = [c for c in h["calls"] if c[0] == "PAIR"]
        if register == "overlap":
            assert len(pairs) == h["n_pairs"] > 0  # one call per overlapped pair of this rank
            assert len(h["calls"]) - len(pairs) == h["n_compute"] - 2 * h["n_pairs"]
        else:
            assert not pairs and len(h["calls"]) == h["n_compute"]  # every compute action went through a function
        forwards = sorted((s, m) for k, s, m in h["calls"] if k == "F")
        assert len(forwards) == 2 * M - len(pairs)  # this rank's two stages, less the forwards run in pairs
        for s, grads in h["grads"].items():
            for g, g_plain, p_ref in zip(grads, p["grads"][s], ref[s].parameters()):
                assert g == g_plain  # the same arithmetic, bit for bit
                torch.testing.assert_close(torch.tensor(g), p_ref.grad, **TOL)


def _raises(rank: int, world: int) -> str:
    import pipeline_ext as pe
    from torch.distributed.pipelining.schedules import FORWARD

    modules = build("mlp", world)
    stage = pe.PipelineStage(modules[rank], rank, world, "cpu")
    sched = pe.Schedule1F1B(stage, 2, loss_fn=_loss, timeout=20.0)

    def boom(action, ctx):
        if action.stage_index == 1:
            raise RuntimeError(f"custom forward refused {action}")
        ctx.schedule_ref.stages[action.stage_index].forward_one_chunk(action.microbatch_index, ())

    sched.register_custom_function(FORWARD, boom)
    x, y = make_batch("mlp", 4)
    try:
        sched.step(x if rank == 0 else None, target=y if rank == 1 else None)
    except Exception as exc:  # noqa: BLE001 - what each rank saw is the point
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.timeout(120)
def test_a_function_that_raises_fails_the_step_on_every_rank():
    said = {r: v for r, (_, v) in run_ranks(_raises, 2, timeout=100).items()}
    assert "custom forward refused 1F0" in said[1], said
    assert said[0] != "no error", said  # rank 0 is told, it does not hang


def _unhanded(rank: int, world: int) -> str:
    import pipeline_ext as pe

    modules = build("mlp", world)
    stage = pe.PipelineStage(modules[rank], rank, world, "cpu")
    try:
        stage.forward_one_chunk(0, ())
    except RuntimeError as exc:
        return str(exc)
    return "ran"


@pytest.mark.timeout(60)
def test_the_stage_api_outside_a_custom_function_is_refused_by_name():
    said = rank_values(_unhanded, 2, timeout=50)
    assert all("register_custom_function" in v for v in said.values()), said
