"""pipeline_ext: pipeline-parallel training for PyTorch.

Schedules are data (``pipeline_ext.schedules``); one executor runs them in a
single process (``Pipe``) or across processes (``PipelineStage`` + ``Schedule*``).
The byte moving and waiting live in the compiled core, ``pipeline_ext._C``.

Names are resolved lazily (PEP 562): ``import pipeline_ext.schedules`` needs
neither torch nor the compiled core, so schedule tooling starts fast; the first
use of a runtime name loads them.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "PipelineStage": "pipeline_ext.pipelining.stage",
    "PipelineSchedule": "pipeline_ext.pipelining.schedule",
    "PipeliningMetadataError": "pipeline_ext.pipelining.stage",
    "PipeliningShapeError": "pipeline_ext.pipelining.stage",
    "PipelineScheduleSingle": "pipeline_ext.pipelining.schedule_classes",
    "PipelineScheduleMulti": "pipeline_ext.pipelining.schedule_classes",
    "ScheduleGPipe": "pipeline_ext.pipelining.schedule_classes",
    "Schedule1F1B": "pipeline_ext.pipelining.schedule_classes",
    "ScheduleInterleaved1F1B": "pipeline_ext.pipelining.schedule_classes",
    "ScheduleInterleavedZeroBubble": "pipeline_ext.pipelining.schedule_classes",
    "ScheduleLoopedBFS": "pipeline_ext.pipelining.schedule_classes",
    "ScheduleZBH1": "pipeline_ext.pipelining.schedule_classes",
    "ScheduleZBH2": "pipeline_ext.pipelining.schedule_classes",
    "ScheduleZBV": "pipeline_ext.pipelining.schedule_classes",
    "ScheduleZBVZeroBubble": "pipeline_ext.pipelining.schedule_classes",
    "ScheduleDualPipeV": "pipeline_ext.pipelining.schedule_classes",
    "ScheduleVHalf": "pipeline_ext.pipelining.schedule_classes",
    "ScheduleVMin": "pipeline_ext.pipelining.schedule_classes",
    "_ScheduleForwardOnly": "pipeline_ext.pipelining.schedule_classes",
    "_PipelineScheduleRuntime": "pipeline_ext.pipelining.schedule_classes",
    "get_schedule_class": "pipeline_ext.pipelining.schedule_classes",
    "TensorChunkSpec": "pipeline_ext.runtime.microbatch",
    "pipeline": "pipeline_ext.pipelining.model_split",
    "SplitPoint": "pipeline_ext.pipelining.model_split",
    "pipe_split": "pipeline_ext.pipelining.model_split",
    "build_stage": "pipeline_ext.pipelining.model_split",
    "split_args_kwargs_into_chunks": "pipeline_ext.runtime.microbatch",
    "merge_chunks": "pipeline_ext.runtime.microbatch",
    "StepAgreementError": "pipeline_ext.dist.agreement",
    "StepRejectedError": "pipeline_ext.dist.agreement",
    "UnsupportedWrapperError": "pipeline_ext.dist.data_parallel",
    "UnsplitBackwardWarning": "pipeline_ext.runtime.split_backward",
    "split_backend": "pipeline_ext.runtime.compiled_split",
    "comm_region": "pipeline_ext.runtime.overlap",
    "overlap_point": "pipeline_ext.runtime.overlap",
    "in_overlap": "pipeline_ext.runtime.overlap",
    "pipeline_mesh": "pipeline_ext.pipelining.mesh",
    "pipeline_layout": "pipeline_ext.pipelining.mesh",
    "PipelineLayout": "pipeline_ext.pipelining.mesh",
    "Pipe": "pipeline_ext.pipe",
    "balance_by_params": "pipeline_ext.pipe.partition",
    "balance_by_time": "pipeline_ext.pipe.partition",
    "balance_by_size": "pipeline_ext.pipe.partition",
    "is_checkpointing": "pipeline_ext.pipe.recompute",
    "is_recomputing": "pipeline_ext.pipe.recompute",
    "tie_parameters": "pipeline_ext.training.tied",
    "TiedParameters": "pipeline_ext.training.tied",
    "clip_grad_norm_": "pipeline_ext.training.clip",
    "save_checkpoint": "pipeline_ext.training.checkpoint",
    "load_checkpoint": "pipeline_ext.training.checkpoint",
    "TokenMeanLoss": "pipeline_ext.training.loss",
    "activation_bytes": "pipeline_ext.runtime.memory",
    "profile_layers": "pipeline_ext.training.balance",
    "balance_layers": "pipeline_ext.training.balance",
    "stage_modules": "pipeline_ext.training.balance",
    "block_ranges": "pipeline_ext.training.balance",
    "sizes_with_ends": "pipeline_ext.training.balance",
    "LayerChain": "pipeline_ext.training.balance",
    "balance_stages": "pipeline_ext.schedules.balance",
    "LayerCost": "pipeline_ext.schedules.balance",
}
#: subpackages, and the modules users reach as ``pipeline_ext.<name>`` (``from pipeline_ext import ops``)
_SUBMODULES = {
    "schedules": "pipeline_ext.schedules",
    "skip": "pipeline_ext.skip",
    "runtime": "pipeline_ext.runtime",
    "dist": "pipeline_ext.dist",
    "pipelining": "pipeline_ext.pipelining",
    "pipe": "pipeline_ext.pipe",
    "training": "pipeline_ext.training",
    "ops": "pipeline_ext.runtime.ops",
    "microbatch": "pipeline_ext.runtime.microbatch",
}

__all__ = sorted(_EXPORTS) + sorted(_SUBMODULES)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(_SUBMODULES[name])
    else:
        raise AttributeError(f"module 'pipeline_ext' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
