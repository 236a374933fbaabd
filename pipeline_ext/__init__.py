"""pipeline_ext: pipeline-parallel training for PyTorch.

Schedules are data (``pipeline_ext.schedules``); one executor runs them in a
single process (``Pipe``) or across processes (``PipelineStage`` + ``Schedule*``).
The byte moving and waiting live in the compiled core, ``pipeline_ext._C``.
"""
from __future__ import annotations

from pipeline_ext._ext import _C  # noqa: F401  (fails with a clear message if unbuilt)

__version__ = "0.1.0"
