"""pipeline_ext: pipeline-parallel training for PyTorch.

Schedules are data (``pipeline_ext.schedules``); one executor runs them in a
single process (``Pipe``) or across processes (``PipelineStage`` + ``Schedule*``).
The byte moving and waiting live in the compiled core, ``pipeline_ext._C``.

The package itself does not import ``_C`` (nor torch): ``pipeline_ext.schedules``
is pure Python and must import fast and work where the extension is not built
(CI lint jobs, schedule tooling, a fresh checkout). Modules that need the
compiled core import it from ``pipeline_ext._ext``, which raises one clear error
when it is missing.
"""
from __future__ import annotations

__version__ = "0.1.0"
