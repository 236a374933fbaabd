"""One rank's engine: stage runners, the executor, in-process channels, kernels, traces.

Nothing here knows about processes: the executor runs one rank's actions of a
lowered schedule (``pipeline_ext.schedules``) over whatever ``StepContext`` it
is handed (``runtime/channel.py``): ``local.LocalStep`` between the threads of
one process (the ``pipe`` front end), or ``comm.session.Step`` between
processes (the ``pipelining`` front end).
"""

from pipeline_ext._lazy import lazy_names

#: what users reach here (``pipeline_ext.runtime.split_backend``); the modules stay importable as they are
_EXPORTS = {
    "ChannelError": "pipeline_ext.runtime.channel",
    "ChannelTimeout": "pipeline_ext.runtime.channel",
    "TensorChunkSpec": "pipeline_ext.runtime.microbatch",
    "split_args_kwargs_into_chunks": "pipeline_ext.runtime.microbatch",
    "merge_chunks": "pipeline_ext.runtime.microbatch",
    **dict.fromkeys(["UnsplitBackwardWarning", "SplitFunction", "split_check", "once_only_hooks", "split_backend"],
                    "pipeline_ext.runtime.split"),
    "comm_region": "pipeline_ext.runtime.overlap",
    "overlap_point": "pipeline_ext.runtime.overlap",
    "in_overlap": "pipeline_ext.runtime.overlap",
    "activation_bytes": "pipeline_ext.runtime.memory",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_names(__name__, _EXPORTS, __all__)
