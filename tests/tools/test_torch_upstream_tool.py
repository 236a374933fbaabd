"""The source rewriting of tools/run_torch_pipelining_tests.py: what it changes in torch's tests, and what it must not.

The tool's numbers are only meaningful if the port is exactly "CPU + Gloo" and
the swap exactly "change the import": these tests pin both on small sources.
"""
from __future__ import annotations

import ast
import importlib.util
import sys

from models import ROOT

_TOOL = ROOT / "tools" / "run_torch_pipelining_tests.py"
_spec = importlib.util.spec_from_file_location("run_torch_pipelining_tests", _TOOL)
tool = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = tool  # dataclasses look their module up
_spec.loader.exec_module(tool)

SOURCE = '''\
import torch

from models import ROOT
from torch.distributed.pipelining import (
    pipeline,
    PipelineStage,
    ScheduleGPipe as GPipe,
)
from torch.distributed.pipelining.microbatch import merge_chunks, TensorChunkSpec
from torch.distributed.pipelining.schedules import _Action, get_schedule_class


class T(MultiProcContinuousTest):
    @property
    def world_size(self):
        return torch.get_device_module(device_type).device_count()

    def init_pg(self):
        dist.init_process_group(
            backend=backend,
            device_id=self.device,
        )

    @requires_accelerator_dist_backend(["nccl", "xccl"])
    @skip_but_pass_in_sandcastle_if(
        not TEST_MULTIACCELERATOR, f"{backend} test requires 2+ GPUs"
    )
    @skip_but_pass_in_sandcastle_if(IS_SANDCASTLE, "not in sandcastle")
    @skipXPUIf(True, "xpu issue")
    @skip_if_lt_x_gpu(4)
    def test_a(self):
        from torch.distributed.pipelining.schedules import _wait_batch_p2p
        return _wait_batch_p2p
'''


def test_port_removes_only_the_accelerator_skips():
    out = tool.port_cpu_gloo(SOURCE, world_size=3)
    ast.parse(out)
    assert "requires_accelerator_dist_backend" not in out
    assert "skip_if_lt_x_gpu" not in out
    assert "TEST_MULTIACCELERATOR" not in out
    # torch's other skip conditions stay
    assert '@skip_but_pass_in_sandcastle_if(IS_SANDCASTLE, "not in sandcastle")' in out
    assert '@skipXPUIf(True, "xpu issue")' in out
    assert "return 3" in out and "device_count()" not in out
    assert "device_id" not in out and "backend=backend," in out


def test_swap_moves_provided_names_and_keeps_the_rest():
    provided = {
        ("torch.distributed.pipelining", "PipelineStage"),
        ("torch.distributed.pipelining", "ScheduleGPipe"),
        ("torch.distributed.pipelining.microbatch", "merge_chunks"),
        ("torch.distributed.pipelining.microbatch", "TensorChunkSpec"),
        ("torch.distributed.pipelining.schedules", "get_schedule_class"),
    }
    out, kept = tool.swap_imports(SOURCE, provided)
    ast.parse(out)
    assert "from pipeline_ext.pipelining import PipelineStage, ScheduleGPipe as GPipe" in out
    assert "from torch.distributed.pipelining import pipeline\n" in out
    assert "from pipeline_ext.pipelining.microbatch import merge_chunks, TensorChunkSpec" in out
    assert "from pipeline_ext.pipelining.schedules import get_schedule_class" in out
    assert "from torch.distributed.pipelining.schedules import _Action\n" in out
    # an import inside a function keeps its indentation and, unprovided, stays torch's
    assert "        from torch.distributed.pipelining.schedules import _wait_batch_p2p" in out
    assert kept == sorted([
        "torch.distributed.pipelining.pipeline",
        "torch.distributed.pipelining.schedules._Action",
        "torch.distributed.pipelining.schedules._wait_batch_p2p",
    ])
    assert tool.imported_pipelining_names(SOURCE) >= provided
    # nothing but the import statements changed
    assert out.split("\n\n\nclass T", 1)[1] == SOURCE.split("\n\n\nclass T", 1)[1]


def test_one_line_reason_reads_the_worker_traceback():
    text = (
        "E   RuntimeError: Exception in worker process:\n"
        "E   Traceback (most recent call last):\n"
        'E     File "x.py", line 3, in test_a\n'
        "E   AssertionError: Tensor-likes are not close!\n"
        "E   Mismatched elements: 3 / 4\n"
    )
    assert tool.one_line_reason(text) == "AssertionError: Tensor-likes are not close!"
    assert tool.one_line_reason("E   assert 1 == 2") == "assert 1 == 2"
