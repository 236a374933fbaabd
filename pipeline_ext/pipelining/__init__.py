"""The ``torch.distributed.pipelining`` front end: one process per rank, started by ``torchrun``.

``stage.py`` is ``PipelineStage``; ``schedule.py`` is ``PipelineSchedule``,
which runs any schedule on this rank's stages through a ``dist.Session``;
``schedule_classes.py`` holds torch's ``Schedule*`` names over it;
``model_split.py`` is torch's tracer front end (``pipeline``, ``SplitPoint``,
``build_stage``); ``dw_builder.py`` runs torch's custom weight-gradient
builders; ``mesh.py`` lays pipeline and data-parallel ranks out on a DeviceMesh.
"""

from pipeline_ext._lazy import lazy_names

_SC = "pipeline_ext.pipelining.schedule_classes"
_EXPORTS = {
    "PipelineStage": "pipeline_ext.pipelining.stage",
    "PipeliningMetadataError": "pipeline_ext.pipelining.stage",
    "PipeliningShapeError": "pipeline_ext.pipelining.stage",
    "PipelineSchedule": "pipeline_ext.pipelining.schedule",
    "PipelineScheduleSingle": _SC,
    "PipelineScheduleMulti": _SC,
    "get_schedule_class": _SC,
    "pipeline": "pipeline_ext.pipelining.model_split",
    "SplitPoint": "pipeline_ext.pipelining.model_split",
    "pipe_split": "pipeline_ext.pipelining.model_split",
    "build_stage": "pipeline_ext.pipelining.model_split",
    "pipeline_mesh": "pipeline_ext.pipelining.mesh",
    "pipeline_layout": "pipeline_ext.pipelining.mesh",
    "PipelineLayout": "pipeline_ext.pipelining.mesh",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_names(__name__, _EXPORTS, __all__)
