"""torch's tracer front end (``pipeline()``, ``SplitPoint``, ``pipe_split``), running on our runtime.

Cutting a model into stages by tracing is torch's job, and it does it well: we
do not write a tracer. ``pipeline(model, mb_args=..., split_spec=...)`` is
torch's own; its stage modules (``pipe.get_stage_module(i)``) are ordinary
modules that our ``PipelineStage`` wraps. ``build_stage`` has torch's
signature and gives our stage; a stage torch built (``pipe.build_stage(...)``)
is taken over by :func:`as_stage`, so the schedules accept it too.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from pipeline_ext.pipelining.stage import PipelineStage

__all__ = ["pipeline", "Pipe", "SplitPoint", "pipe_split", "build_stage", "as_stage"]


def __getattr__(name: str) -> Any:
    # torch's own objects, imported on first use (torch.distributed.pipelining is not free to import)
    if name in ("pipeline", "Pipe", "SplitPoint", "pipe_split"):
        import torch.distributed.pipelining as tp

        return getattr(tp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_stage(stage_module: nn.Module, stage_index: int, pipe_info: Any, device: Union[torch.device, str, int],
                group: Optional[dist.ProcessGroup] = None) -> PipelineStage:
    """torch's ``build_stage``: a stage of a traced pipeline (``pipe.info()`` gives ``pipe_info``)."""
    num_stages = getattr(pipe_info, "num_stages", None)
    if not isinstance(num_stages, int):
        raise TypeError(f"pipe_info must be torch's PipeInfo (pipe.info()), got {type(pipe_info).__name__}")
    return PipelineStage(stage_module, stage_index, num_stages, device, group=group)


def as_stage(stage: Any) -> PipelineStage:
    """Ours as is; a stage torch built (``PipelineStage`` or ``pipe.build_stage``) becomes ours, same module."""
    if isinstance(stage, PipelineStage):
        return stage
    needed = ("submod", "stage_index", "num_stages", "device", "group")
    if all(hasattr(stage, a) for a in needed):
        return PipelineStage(stage.submod, stage.stage_index, stage.num_stages, stage.device, group=stage.group,
                             dw_builder=getattr(stage, "dw_builder", None))
    raise TypeError(f"expected a PipelineStage, got {type(stage).__name__}")
