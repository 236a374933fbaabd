"""pipeline_ext: pipeline-parallel training for PyTorch.

Schedules are data (``pipeline_ext.schedules``); one executor runs them in a
single process (``Pipe``) or across processes (``PipelineStage`` + ``Schedule*``).
The byte moving and waiting live in the compiled core, ``pipeline_ext._C``.

The names here are what a training script needs: torch's pipelining names
(stage, schedules, tracer front end), ``Pipe``, and the errors a step raises.
Everything else lives in its subpackage (``training``: ties, clipping,
checkpoints, losses, layer balance; ``schedules``: the IR, simulator and
``select``; ``runtime``: split backward, overlap, memory; ``pipelining``: mesh
layouts; ``pipe``: torchgpipe's balancing), and stays reachable here by the
name it had.

Names are resolved lazily (PEP 562): ``import pipeline_ext.schedules`` needs
neither torch nor the compiled core, so schedule tooling starts fast; the first
use of a runtime name loads them.
"""
from __future__ import annotations

from pipeline_ext._lazy import lazy_names, moved_modules

__version__ = "0.1.0"

_SC = "pipeline_ext.pipelining.schedule_classes"
#: the public surface (``__all__``); each resolves through the subpackage that lists it, or its module
_EXPORTS = {
    **dict.fromkeys(["PipelineStage", "PipelineSchedule", "get_schedule_class", "pipeline", "SplitPoint",
                     "pipe_split", "build_stage", "PipeliningShapeError"], "pipeline_ext.pipelining"),
    **dict.fromkeys(["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
                     "ScheduleLoopedBFS", "ScheduleZBH1", "ScheduleZBH2", "ScheduleZBVZeroBubble",
                     "ScheduleDualPipeV", "ScheduleVHalf", "ScheduleVMin"], _SC),
    **dict.fromkeys(["TensorChunkSpec", "ChannelError", "ChannelTimeout"], "pipeline_ext.runtime"),
    "Pipe": "pipeline_ext.pipe",
    **dict.fromkeys(["StepAgreementError", "StepRejectedError"], "pipeline_ext.comm.agreement"),
}
#: names whose home is a subpackage (listed there): not in ``__all__``, still reachable as ``pipeline_ext.<name>``
_ELSEWHERE = {
    **dict.fromkeys(["PipeliningMetadataError", "PipelineScheduleSingle", "PipelineScheduleMulti", "pipeline_mesh",
                     "pipeline_layout", "PipelineLayout"], "pipeline_ext.pipelining"),
    **dict.fromkeys(["ScheduleZBV", "_ScheduleForwardOnly", "_PipelineScheduleRuntime"], _SC),
    **dict.fromkeys(["split_args_kwargs_into_chunks", "merge_chunks", "UnsplitBackwardWarning", "SplitFunction",
                     "once_only_hooks", "split_backend",
                     "comm_region", "overlap_point", "in_overlap", "activation_bytes"], "pipeline_ext.runtime"),
    **dict.fromkeys(["balance_by_params", "balance_by_time", "balance_by_size", "is_checkpointing",
                     "is_recomputing"], "pipeline_ext.pipe"),
    **dict.fromkeys(["tie_parameters", "TiedParameters", "clip_grad_norm_", "save_checkpoint", "load_checkpoint",
                     "TokenMeanLoss", "profile_layers", "balance_layers", "stage_modules", "block_ranges",
                     "sizes_with_ends", "LayerChain"], "pipeline_ext.training"),
    **dict.fromkeys(["balance_stages", "LayerCost"], "pipeline_ext.schedules"),
    "UnsupportedWrapperError": "pipeline_ext.comm.data_parallel",
}
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

#: module paths users import that live elsewhere: ``import pipeline_ext.microbatch`` is the module at its home
#: (torch users write ``torch.distributed.pipelining.microbatch``); see ``_lazy.moved_modules``
_MOVED = {f"pipeline_ext.{name}": _SUBMODULES[name] for name in ("ops", "microbatch")}
#: module paths of an earlier release that moved, kept for one release: importing one warns and gives the
#: module at its new home (the same object); ``pipeline_ext.<name>`` reaches the top-level ones too
_MOVED_DEPRECATED = {
    "pipeline_ext.launch": "pipeline_ext.comm.launch",
    "pipeline_ext.distributed": "pipeline_ext.pipelining",  # PipelineStage, PipelineSchedule and their errors
    "pipeline_ext.schedule_classes": "pipeline_ext.pipelining.schedule_classes",
    "pipeline_ext.tracer": "pipeline_ext.pipelining.model_split",
    "pipeline_ext.mesh": "pipeline_ext.pipelining.mesh",
    "pipeline_ext.partition": "pipeline_ext.pipe.partition",
    "pipeline_ext.checkpoint": "pipeline_ext.pipe.recompute",  # the Pipe's checkpointing
    "pipeline_ext.batchnorm": "pipeline_ext.pipe.batchnorm",
    "pipeline_ext.demo_model": "pipeline_ext.demo.model",
    "pipeline_ext.training.balance": "pipeline_ext.training.profiling",
}
moved_modules(_MOVED, _MOVED_DEPRECATED)

#: old names of renamed subpackages, kept for one release: not in ``__all__``; importing one warns (``dist.py``)
_DEPRECATED = {
    "dist": "pipeline_ext.dist",  # now ``comm``
    **{old.split(".")[1]: old for old in _MOVED_DEPRECATED if old.count(".") == 1},
}

__all__ = sorted(_EXPORTS) + sorted(_SUBMODULES)
__getattr__, __dir__ = lazy_names(__name__, {**_EXPORTS, **_ELSEWHERE}, __all__, {**_SUBMODULES, **_DEPRECATED})
