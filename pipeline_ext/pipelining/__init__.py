"""The ``torch.distributed.pipelining`` front end: one process per rank, started by ``torchrun``.

``stage.py`` is ``PipelineStage``; ``schedule.py`` is ``PipelineSchedule``,
which runs any schedule on this rank's stages through a ``dist.Session``;
``schedule_classes.py`` holds torch's ``Schedule*`` names over it;
``model_split.py`` is torch's tracer front end (``pipeline``, ``SplitPoint``,
``build_stage``); ``dw_builder.py`` runs torch's custom weight-gradient
builders; ``mesh.py`` lays pipeline and data-parallel ranks out on a DeviceMesh.
"""
