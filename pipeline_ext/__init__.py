"""pipeline_ext: pipeline-parallel training for PyTorch.

Schedules are data (``pipeline_ext.schedules``); one executor runs them in a
single process (``Pipe``) or across processes (``PipelineStage`` + ``Schedule*``).
The byte moving and waiting live in the compiled core, ``pipeline_ext._C``.

The names here are what a training script needs: torch's pipelining names
(stage, schedules, tracer front end), ``Pipe``, and the errors a step raises.
Everything else lives in its subpackage (``training``: ties, clipping,
checkpoints, losses, layer balance; ``schedules``: the IR, simulator and
``select``; ``runtime``: split backward, overlap, memory; ``pipelining``:
torch's modules, module for module, and mesh layouts; ``pipe``: torchgpipe's
balancing); the names of ``pipelining``, ``runtime``, ``training`` and
``pipe`` resolve here too (``pe.tie_parameters``).

Names are resolved lazily (PEP 562): ``import pipeline_ext.schedules`` needs
neither torch nor the compiled core, so schedule tooling starts fast; the first
use of a runtime name loads them.
"""
from __future__ import annotations

from pipeline_ext._lazy import lazy_names, module_aliases

__version__ = "0.1.0"

#: the public surface (``__all__``): what a training script needs, by the subpackage (or module) whose ``__all__``
#: lists each name, where it resolves from (tests/stages/test_public_api.py checks that it is listed there)
_PUBLIC = {
    "pipeline_ext.pipelining": [
        "PipelineStage", "PipelineSchedule", "get_schedule_class", "pipeline", "SplitPoint", "pipe_split",
        "build_stage", "PipeliningShapeError", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
        "ScheduleInterleavedZeroBubble", "ScheduleLoopedBFS", "ScheduleZBH1", "ScheduleZBH2", "ScheduleZBVZeroBubble",
        "ScheduleDualPipeV", "ScheduleVHalf", "ScheduleVMin"],
    "pipeline_ext.runtime": ["TensorChunkSpec", "ChannelError", "ChannelTimeout"],
    "pipeline_ext.pipe": ["Pipe"],
    "pipeline_ext.comm.agreement": ["StepAgreementError", "StepRejectedError"],
}
#: subpackages every name of whose ``__all__`` also resolves here, the first that lists it winning
#: (``pe.tie_parameters`` is ``pe.training.tie_parameters``): the lighter ones first, since a name is looked for
#: in each in turn and ``pipe`` imports torch
_REACHABLE = ("pipeline_ext.pipelining", "pipeline_ext.runtime", "pipeline_ext.training", "pipeline_ext.pipe")
#: subpackages, and the modules users reach as ``pipeline_ext.<name>`` (``from pipeline_ext import ops``)
_SUBMODULES = {
    "schedules": "pipeline_ext.schedules",
    "skip": "pipeline_ext.skip",
    "runtime": "pipeline_ext.runtime",
    "comm": "pipeline_ext.comm",
    "pipelining": "pipeline_ext.pipelining",
    "pipe": "pipeline_ext.pipe",
    "training": "pipeline_ext.training",
    "ops": "pipeline_ext.runtime.ops",
    "microbatch": "pipeline_ext.runtime.microbatch",
}
#: ``import pipeline_ext.microbatch`` / ``.ops`` give the module at its home (``_lazy.module_aliases``)
module_aliases({f"pipeline_ext.{name}": _SUBMODULES[name] for name in ("ops", "microbatch")})

__all__ = sorted(n for names in _PUBLIC.values() for n in names) + sorted(_SUBMODULES)
__getattr__, __dir__ = lazy_names(__name__, {n: home for home, names in _PUBLIC.items() for n in names}, __all__,
                                  _SUBMODULES, search=_REACHABLE)
