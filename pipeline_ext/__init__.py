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
    "PipelineStage": "pipeline_ext.distributed",
    "PipelineSchedule": "pipeline_ext.distributed",
    "PipeliningMetadataError": "pipeline_ext.distributed",
    "PipeliningShapeError": "pipeline_ext.distributed",
    "PipelineScheduleSingle": "pipeline_ext.schedule_classes",
    "PipelineScheduleMulti": "pipeline_ext.schedule_classes",
    "ScheduleGPipe": "pipeline_ext.schedule_classes",
    "Schedule1F1B": "pipeline_ext.schedule_classes",
    "ScheduleInterleaved1F1B": "pipeline_ext.schedule_classes",
    "ScheduleInterleavedZeroBubble": "pipeline_ext.schedule_classes",
    "ScheduleLoopedBFS": "pipeline_ext.schedule_classes",
    "ScheduleZBH1": "pipeline_ext.schedule_classes",
    "ScheduleZBH2": "pipeline_ext.schedule_classes",
    "ScheduleZBV": "pipeline_ext.schedule_classes",
    "ScheduleZBVZeroBubble": "pipeline_ext.schedule_classes",
    "ScheduleDualPipeV": "pipeline_ext.schedule_classes",
    "_ScheduleForwardOnly": "pipeline_ext.schedule_classes",
    "_PipelineScheduleRuntime": "pipeline_ext.schedule_classes",
    "get_schedule_class": "pipeline_ext.schedule_classes",
    "TensorChunkSpec": "pipeline_ext.microbatch",
    "pipeline": "pipeline_ext.tracer",
    "SplitPoint": "pipeline_ext.tracer",
    "pipe_split": "pipeline_ext.tracer",
    "build_stage": "pipeline_ext.tracer",
    "split_args_kwargs_into_chunks": "pipeline_ext.microbatch",
    "merge_chunks": "pipeline_ext.microbatch",
    "StepAgreementError": "pipeline_ext.runtime.protocol.agreement",
    "StepRejectedError": "pipeline_ext.runtime.protocol.agreement",
    "UnsupportedWrapperError": "pipeline_ext.runtime.data_parallel",
    "UnsplitBackwardWarning": "pipeline_ext.runtime.split_backward",
    "split_backend": "pipeline_ext.runtime.compiled_split",
    "pipeline_mesh": "pipeline_ext.mesh",
    "pipeline_layout": "pipeline_ext.mesh",
    "PipelineLayout": "pipeline_ext.mesh",
    "Pipe": "pipeline_ext.pipe",
    "balance_by_params": "pipeline_ext.partition",
    "balance_by_time": "pipeline_ext.partition",
    "balance_by_size": "pipeline_ext.partition",
    "is_checkpointing": "pipeline_ext.checkpoint",
    "is_recomputing": "pipeline_ext.checkpoint",
    "tie_parameters": "pipeline_ext.training.tied",
    "TiedParameters": "pipeline_ext.training.tied",
    "clip_grad_norm_": "pipeline_ext.training.clip",
    "save_checkpoint": "pipeline_ext.training.checkpoint",
    "load_checkpoint": "pipeline_ext.training.checkpoint",
    "TokenMeanLoss": "pipeline_ext.training.loss",
}
_SUBMODULES = {"skip", "tracer", "schedule_classes", "ops", "schedules", "microbatch", "runtime", "distributed", "pipe", "partition", "checkpoint", "training", "mesh"}

__all__ = sorted(_EXPORTS) + sorted(_SUBMODULES)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"pipeline_ext.{name}")
    else:
        raise AttributeError(f"module 'pipeline_ext' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
