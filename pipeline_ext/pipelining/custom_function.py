"""torch's custom functions (``register_custom_function``) on this library's executor: the adapter.

torchtitan's DualPipeV overlap registers a function per computation type and
expects torch's objects: its ``_Action`` (an OVERLAP_F_B pair as stage -1 with
``sub_actions``, forward first), its ``_PipelineContext`` (the schedule as
``schedule_ref``, the step's microbatches, targets and losses), and the
schedule's ``fwd_recv_ops`` / ``bwd_recv_ops``. The executor knows none of
that: it calls a plain callable per compute kind with our actions and a
``GroupRun`` (``runtime/group_run.py``). This module translates between the
two and nothing else: torch's computation types to our keys (``custom_key``),
our actions to torch's (``torch_action``, from schedules/csv_io.py, which
makes torch's ``pipeline_order`` with it), torch's receive bookkeeping as a
view of what the step has received (``ReceivedView``), and, per step, the
callables that bind the stages to the ``GroupRun`` and call the user's
function with torch's context (``bind_custom_functions``). Its own module so
that the step API does not handle torch's private objects:
``PipelineSchedule`` (schedule.py) keeps the registration and the step. Why a registered function
cannot change the messages: [Note: custom functions change when, not what]
in ``runtime/executor.py``.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from pipeline_ext import schedules as S
from pipeline_ext.schedules.csv_io import torch_action
from pipeline_ext.schedules.ir import OVERLAP_F_B

__all__ = ["custom_key", "ReceivedView", "bind_custom_functions"]


_TORCH_KINDS = {"F": S.ActionKind.F, "B": S.ActionKind.B, "I": S.ActionKind.I, "W": S.ActionKind.W,
                "OVERLAP_F_B": OVERLAP_F_B, "UNSHARD": S.ActionKind.UNSHARD, "RESHARD": S.ActionKind.RESHARD,
                "REDUCE_GRAD": S.ActionKind.REDUCE_GRAD}
_TORCH_NAMES = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def custom_key(computation_type: Any) -> Any:
    """Our key for torch's computation type (or its spelling)."""
    name = computation_type.value if isinstance(computation_type, S.ActionKind) else str(computation_type)
    torch_name = getattr(computation_type, "name", None)  # torch's _ComputationType: FORWARD, OVERLAP_F_B, ...
    if isinstance(torch_name, str) and not isinstance(computation_type, S.ActionKind):
        name = _TORCH_NAMES.get(torch_name, torch_name)
    if name not in _TORCH_KINDS:
        raise ValueError(f"Invalid computation type {computation_type}. Only FORWARD, FULL_BACKWARD, BACKWARD_INPUT, "
                         "BACKWARD_WEIGHT, OVERLAP_F_B, UNSHARD, RESHARD and REDUCE_GRAD are supported.")
    return _TORCH_KINDS[name]


class _Done:
    """A finished receive, for torch's ``_wait_batch_p2p`` (the executor waited on it already)."""

    def wait(self, *args: Any) -> bool:
        return True


class ReceivedView:
    """torch's ``fwd_recv_ops`` / ``bwd_recv_ops`` inside a custom function: keys whose input is here.

    ``schedule``: the ``PipelineSchedule`` whose stages run the step.
    """

    def __init__(self, schedule: Any, forward: bool) -> None:
        self._schedule, self._forward = schedule, forward

    def _run(self) -> Any:
        return next((st._run for st in self._schedule.stages.values() if st._run is not None), None)

    def __contains__(self, key: Any) -> bool:
        run, (stage, mb) = self._run(), key
        kind = S.ActionKind.F if self._forward else S.ActionKind.B
        return run is not None and run.ready(S.Action(stage, kind, mb))

    def pop(self, key: Any, *default: Any) -> list:
        if key not in self and not default:
            raise KeyError(key)
        return [_Done()] if key in self else default[0]


def bind_custom_functions(schedule: Any, functions: dict[Any, Callable[[Any, Any], None]], step_inputs: Any,
                          losses: Optional[list]) -> dict[Any, Callable[..., None]]:
    """Per kind, the plain callable the executor calls for one step: builds torch's context, binds the stages.

    ``functions``: the user's, by our key (``custom_key``); ``schedule``: the
    ``PipelineSchedule`` running the step (torch's ``schedule_ref``).
    """
    from torch.distributed.pipelining.schedules import _PipelineContext

    n = schedule.n_microbatches
    ctx = _PipelineContext(schedule, list(step_inputs.args) or [()] * n, list(step_inputs.kwargs) or [{}] * n,
                           list(step_inputs.targets) or None, losses)
    schedule.backward_counter.clear()

    def call(fn: Callable[[Any, Any], None], actions: tuple, run: Any) -> None:
        action = torch_action(actions)
        for stage in schedule.stages.values():
            stage._bind(run)
        try:
            fn(action, ctx)
        finally:
            for stage in schedule.stages.values():
                stage._bind(None)

    return {key: functools.partial(call, fn) for key, fn in functions.items()}
