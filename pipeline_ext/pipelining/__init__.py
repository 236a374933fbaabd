"""The ``torch.distributed.pipelining`` front end: one process per rank, started by ``torchrun``.

torch's twin, module for module: replacing ``torch.distributed.pipelining`` by
``pipeline_ext.pipelining`` in any import gives the name, or an error saying
why not (docs/parity.md). ``stage.py`` is ``PipelineStage`` and
``build_stage``; ``schedules.py`` holds torch's ``Schedule*`` classes over
``PipelineSchedule`` (``_schedule_base.py``), which runs any schedule on this
rank's stages through a ``comm.Session``; ``microbatch.py`` is torch's
microbatch names over ``runtime/microbatch.py``; ``model_split.py`` is
torch's tracer front end (``pipeline``, ``SplitPoint``); ``dw_builder.py``
runs torch's custom weight-gradient builders; ``custom_function.py``
adapts torch's ``register_custom_function``; ``mesh.py`` lays pipeline and
data-parallel ranks out on a DeviceMesh.

The names here are those modules' ``__all__`` (read from their sources,
``_lazy.exports``), so nothing is listed twice.
"""

from pipeline_ext._lazy import exports, lazy_names

_EXPORTS = exports(__name__, ["stage", "schedules", "microbatch", "model_split", "mesh"])
#: the modules torch's package has as attributes, with the same names
_SUBMODULES = {name: f"{__name__}.{name}" for name in ("schedules", "stage", "microbatch")}
#: torch's private modules: nothing of theirs is here under their names
_GAPS = {name: f"torch's private module {name}; its public names are in pipeline_ext.pipelining's modules, and torch's "
               "tracer (pipeline, Pipe, SplitPoint) is used as it is (model_split.py)"
         for name in ("_IR", "_backward", "_debug", "_unflatten", "_utils")}
__all__ = sorted(_EXPORTS) + sorted(_SUBMODULES)
__getattr__, __dir__ = lazy_names(__name__, _EXPORTS, __all__, _SUBMODULES, gaps=_GAPS)
