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

from pipeline_ext._lazy import lazy_names

__version__ = "0.1.0"

_SC = "pipeline_ext.pipelining.schedule_classes"
_SPLIT = "pipeline_ext.pipelining.model_split"
#: the public surface (``__all__``)
_EXPORTS = {
    "PipelineStage": "pipeline_ext.pipelining.stage",
    "PipelineSchedule": "pipeline_ext.pipelining.schedule",
    "ScheduleGPipe": _SC,
    "Schedule1F1B": _SC,
    "ScheduleInterleaved1F1B": _SC,
    "ScheduleInterleavedZeroBubble": _SC,
    "ScheduleLoopedBFS": _SC,
    "ScheduleZBH1": _SC,
    "ScheduleZBH2": _SC,
    "ScheduleZBVZeroBubble": _SC,
    "ScheduleDualPipeV": _SC,
    "ScheduleVHalf": _SC,
    "ScheduleVMin": _SC,
    "get_schedule_class": _SC,
    "pipeline": _SPLIT,
    "SplitPoint": _SPLIT,
    "pipe_split": _SPLIT,
    "build_stage": _SPLIT,
    "TensorChunkSpec": "pipeline_ext.runtime.microbatch",
    "Pipe": "pipeline_ext.pipe",
    "ChannelError": "pipeline_ext.runtime.channel",
    "ChannelTimeout": "pipeline_ext.runtime.channel",
    "StepAgreementError": "pipeline_ext.dist.agreement",
    "StepRejectedError": "pipeline_ext.dist.agreement",
    "PipeliningShapeError": "pipeline_ext.pipelining.stage",
}
#: names whose home is a subpackage: not listed, still reachable as ``pipeline_ext.<name>``
_ELSEWHERE = {
    "PipeliningMetadataError": "pipeline_ext.pipelining.stage",
    "PipelineScheduleSingle": _SC,
    "PipelineScheduleMulti": _SC,
    "ScheduleZBV": _SC,
    "_ScheduleForwardOnly": _SC,
    "_PipelineScheduleRuntime": _SC,
    "split_args_kwargs_into_chunks": "pipeline_ext.runtime.microbatch",
    "merge_chunks": "pipeline_ext.runtime.microbatch",
    "UnsupportedWrapperError": "pipeline_ext.dist.data_parallel",
    "UnsplitBackwardWarning": "pipeline_ext.runtime.split_backward",
    "split_backend": "pipeline_ext.runtime.compiled_split",
    "comm_region": "pipeline_ext.runtime.overlap",
    "overlap_point": "pipeline_ext.runtime.overlap",
    "in_overlap": "pipeline_ext.runtime.overlap",
    "activation_bytes": "pipeline_ext.runtime.memory",
    "pipeline_mesh": "pipeline_ext.pipelining.mesh",
    "pipeline_layout": "pipeline_ext.pipelining.mesh",
    "PipelineLayout": "pipeline_ext.pipelining.mesh",
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
__getattr__, __dir__ = lazy_names(__name__, {**_EXPORTS, **_ELSEWHERE}, __all__, _SUBMODULES)
