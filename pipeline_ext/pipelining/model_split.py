"""torch's tracer front end (``pipeline()``, ``Pipe``, ``SplitPoint``, ``pipe_split``), running on our runtime.

Cutting a model into stages by tracing is torch's job, and it does it well: we
do not write a tracer. ``pipeline(model, mb_args=..., split_spec=...)`` is
torch's own; its stage modules (``pipe.get_stage_module(i)``) are ordinary
modules that our ``PipelineStage`` wraps. ``build_stage`` (``stage.py``, where
torch has it) gives our stage from one; a stage torch built
(``pipe.build_stage(...)``) is taken over by ``stage.as_stage``, so the
schedules accept it too. torch's objects are imported on first use: torch's
pipelining package costs a rank about a second to import.
"""
from __future__ import annotations

from pipeline_ext._lazy import lazy_names

__all__ = ["pipeline", "Pipe", "SplitPoint", "pipe_split"]

__getattr__, __dir__ = lazy_names(__name__, dict.fromkeys(__all__, "torch.distributed.pipelining"))
