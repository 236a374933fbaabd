"""A rank's start-up does not pay for what the program does not use.

Importing ``torch.distributed.pipelining`` (dynamo, DTensor, sympy) or
``torch.distributed.fsdp`` costs a rank seconds on a small machine, and every
rank of every job pays it again. A program that uses only pipeline_ext, with
no FSDP, makes its stage and schedule and runs a step without loading either
(checked in a fresh interpreter), yet everything that depends on them still
holds when a program does load them: our schedule classes are subclasses of
torch's ``_PipelineSchedule`` whichever is imported first, and our shape
error is a ``PipeliningMetadataError`` of torch's.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os, sys, tempfile
    import torch
    import torch.distributed as dist
    from torch import nn
    import pipeline_ext as pe

    TORCH_FIRST = sys.argv[1] == "torch-first"
    if TORCH_FIRST:
        from torch.distributed.pipelining.schedules import _PipelineSchedule
    path = tempfile.mktemp()
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    stage = pe.PipelineStage(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), 0, 1, "cpu")
    sched = pe.Schedule1F1B(stage, 2, loss_fn=nn.functional.mse_loss, timeout=30)
    loss = []
    sched.step(torch.randn(4, 4), target=torch.randn(4, 4), losses=loss)
    assert len(loss) == 2
    heavy = [m for m in ("torch.distributed.pipelining", "torch.distributed.fsdp", "torch._dynamo")
             if m in sys.modules]
    print("loaded:", ",".join(heavy) or "-")
    from torch.distributed.pipelining.schedules import _PipelineSchedule
    from torch.distributed.pipelining._utils import PipeliningMetadataError
    print("subclass:", all(issubclass(c, _PipelineSchedule) for c in
                           (pe.Schedule1F1B, pe.ScheduleGPipe, pe.ScheduleZBVZeroBubble, pe.PipelineScheduleMulti)))
    print("error:", issubclass(pe.PipeliningShapeError, PipeliningMetadataError)
          and issubclass(pe.PipeliningShapeError, ValueError)
          and pe.PipeliningMetadataError is PipeliningMetadataError)
    dist.destroy_process_group()
""")


@pytest.mark.slow  # a fresh interpreter each
@pytest.mark.parametrize("order", ["pipeline_ext-only", "torch-first"])
def test_a_step_loads_neither_torch_pipelining_nor_fsdp_and_torch_parity_still_holds(order):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, order], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    if order == "pipeline_ext-only":
        assert lines["loaded"] == "-", proc.stdout
    else:  # loaded by the program itself, before pipeline_ext's classes existed
        assert "torch.distributed.pipelining" in lines["loaded"].split(","), proc.stdout
    assert lines["subclass"] == "True" and lines["error"] == "True", proc.stdout


def test_a_shape_error_is_torchs_metadata_error_and_pickles():
    import pickle

    import pipeline_ext as pe
    from pipeline_ext.pipelining import stage

    err = pe.PipeliningShapeError("stage 0, microbatch 1: input 0 is (2,) torch.float32")
    assert stage.PipeliningShapeError is pe.PipeliningShapeError
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is pe.PipeliningShapeError and str(back) == str(err)
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        stage.nope  # noqa: B018
