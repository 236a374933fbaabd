"""The torchgpipe front end: ``Pipe``, one process driving every device.

``pipe.py`` is the module users call (``Pipe(module, balance, devices)``,
``forward``, ``step``); ``placement.py`` checks its arguments and cuts the
Sequential into stages on devices; ``call.py`` is what one call's stages
share and how a stage runs a microbatch in it; ``partition.py`` balances
layers over devices; ``recompute.py`` is torchgpipe's checkpointing
(recompute a microbatch's forward in its backward); ``batchnorm.py`` keeps
BatchNorm statistics those of the whole batch; ``connected.py`` joins the
stages' autograd graphs for a plain ``pipe(x).backward()``; ``threads.py``
runs one executor per device on its own thread and cancels them together. Below it: the same ``runtime`` executor the
multi-process front end runs, over in-process channels.
"""
from pipeline_ext.pipe.partition import balance_by_params, balance_by_size, balance_by_time
from pipeline_ext.pipe.pipe import Pipe, PipeBusyError
from pipeline_ext.pipe.placement import MULTI_STAGE_SCHEDULES
from pipeline_ext.pipe.recompute import is_checkpointing, is_recomputing

__all__ = ["Pipe", "PipeBusyError", "MULTI_STAGE_SCHEDULES", "balance_by_params", "balance_by_size", "balance_by_time",
           "is_checkpointing", "is_recomputing"]
