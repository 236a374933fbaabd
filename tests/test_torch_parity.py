"""Behaviours torch.distributed.pipelining users rely on, checked on pipeline_ext (2 Gloo ranks).

Written here from torch's documented behaviour (its schedules' ``step``); the
wider parity work is issue 12.
"""
from __future__ import annotations

import pytest
import torch

import pipeline_ext as pe
from models import build, loss_fn, make_batch, run_stages
from mp_utils import no_complaints


def _parity(rank: int, world: int) -> list[str]:
    modules, ref = build("mlp", world), build("mlp", world)
    stage = pe.PipelineStage(modules[rank], rank, world, "cpu")
    sched = pe.Schedule1F1B(stage, 4, loss_fn=loss_fn)
    bad, losses = [], []
    for i in range(2):
        x, y = make_batch("mlp", 8, seed=i)
        # as torch allows: every rank passes the batch; only stage 0's rank uses it
        sched.step(x, target=y if rank == world - 1 else None, losses=losses)
        if rank == world - 1:
            # the list holds this step's losses only (torch clears it first)
            mean = sum(losses) / len(losses)
            with torch.no_grad():
                want = loss_fn(run_stages(ref, x), y)
            if len(losses) != 4 or not torch.allclose(mean, want, rtol=1e-5, atol=1e-6):
                bad.append(f"step {i}: {len(losses)} losses, mean {float(mean):.6f} vs {float(want):.6f}")
        loss_fn(run_stages(ref, x), y).backward()
    # the inputs every rank passed changed nothing: gradients of both steps equal the unsplit model's
    for j, (p, q) in enumerate(zip(modules[rank].parameters(), ref[rank].parameters())):
        if not torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6):
            bad.append(f"rank {rank}: parameter {j} gradient differs from the unsplit model")
    return bad


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_losses_list_is_refilled_and_inputs_on_other_ranks_are_ignored():
    no_complaints(_parity, 2, timeout=40)


def test_torch_class_names():
    assert pe.ScheduleZBVZeroBubble is pe.ScheduleZBV
    assert pe.get_schedule_class("ZBVZeroBubble") is pe.ScheduleZBV
