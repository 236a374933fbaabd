"""A parameter budget for fully_shard (FSDP2) stages: what a schedule class does with ``max_active_stages=``.

Why a budget: a rank holding V stages of an FSDP-sharded model decides its
memory and its communication by when each stage's parameters are gathered
and freed. FSDP's own hooks know one stage at a time: with
``reshard_after_forward=True`` (its default for every module but the root)
they gather a stage before each of its forwards and backwards, about two
all-gathers per microbatch; with ``False`` every stage stays gathered, with
its unsharded gradients, until the step ends. The planner
(``schedules/fsdp.py``) sees the whole step's order instead: it places
UNSHARD / RESHARD / REDUCE_GRAD actions so that at most N stages are
gathered at once, resharding the stage used furthest ahead, gathering the
next one a compute action early, and reduce-scattering each stage right
after its last B or W. The runner carries them out ([Note: parameters placed
by the schedule] in runtime/stage.py).

This module is the front end's part: the checks of the arguments, the
warning for FSDP's default without a budget, and the stage sizes the byte
budget needs from every rank.
"""
from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence

import torch.distributed as dist

from pipeline_ext import schedules as S
from pipeline_ext.schedules.fsdp import plan_fsdp

__all__ = ["FSDPReshardWarning", "ParamBudget", "param_budget"]


class FSDPReshardWarning(UserWarning):
    """A fully_shard stage frees its parameters after every forward under a pipeline schedule with no budget."""


class ParamBudget:
    """``max_active_stages`` or ``max_unsharded_bytes`` of one schedule, and the stage sizes the bytes need."""

    def __init__(self, max_active_stages: Optional[int], max_unsharded_bytes: Optional[int],
                 stage_bytes: Optional[list[int]]) -> None:
        self.max_active_stages = max_active_stages
        self.max_unsharded_bytes = max_unsharded_bytes
        self.stage_bytes = stage_bytes

    def plan(self, schedule: S.Schedule) -> S.Schedule:
        """``schedule`` (lowered) with the parameter actions placed; refused by name when it cannot run so."""
        planned = plan_fsdp(schedule, max_active_stages=self.max_active_stages,
                            max_unsharded_bytes=self.max_unsharded_bytes, stage_bytes=self.stage_bytes)
        S.validate(planned, max_active_stages=self.max_active_stages, max_unsharded_bytes=self.max_unsharded_bytes,
                   stage_bytes=self.stage_bytes)
        return planned

    def plan_forward(self, schedule: S.Schedule) -> S.Schedule:
        """A forward-only ``schedule`` (``eval()``'s) with UNSHARD / RESHARD placed under the same budget (no
        REDUCE_GRAD: no gradients): an eval gathers no more at once than a training step."""
        return plan_fsdp(schedule, max_active_stages=self.max_active_stages,
                         max_unsharded_bytes=self.max_unsharded_bytes, stage_bytes=self.stage_bytes)


def param_budget(stages: Sequence[Any], max_active_stages: Optional[int], max_unsharded_bytes: Optional[int],
                 group: Optional[dist.ProcessGroup], num_stages: int) -> Optional[ParamBudget]:
    """The schedule's budget (None without one), checked against this rank's ``stages`` (``PipelineStage``s).

    Without a budget, a stage whose fully_shard modules reshard after
    forward gets an ``FSDPReshardWarning`` naming the cost and the budget to
    use instead. With ``max_unsharded_bytes`` every rank's stage sizes are
    gathered over ``group`` (the planner places every rank's actions).
    """
    sharded = {s.stage_index: s.grad_sync for s in stages
               if getattr(s, "grad_sync", None) is not None and s.grad_sync.shards}
    if max_active_stages is None and max_unsharded_bytes is None:
        resharding = sorted(i for i, sync in sharded.items() if sync.reshards_after_forward())
        if resharding:
            warnings.warn(
                f"stage(s) {resharding} are fully_shard'ed with reshard_after_forward=True (FSDP's default for "
                "every module but the root): under a pipeline schedule FSDP then all-gathers a stage's parameters "
                "again before each of its forwards and backwards, about two all-gathers per parameter group and "
                "microbatch. Give the schedule a parameter budget (max_active_stages=N: at most N of this rank's "
                "stages gathered at once, each gathered only when the budget needs it), or fully_shard them with "
                "reshard_after_forward=False to gather each once per step", FSDPReshardWarning, stacklevel=4)
        return None
    # the values themselves are checked by the planner (schedules/fsdp.py ``Budget.of``), when the schedule is set
    plain = sorted(s.stage_index for s in stages if s.stage_index not in sharded)
    if plain:
        raise ValueError(
            f"a parameter budget (max_active_stages / max_unsharded_bytes) places the all-gathers of fully_shard "
            f"(FSDP2) stages, but stage(s) {plain} on this rank are not fully_shard'ed")
    stage_bytes = None
    if max_unsharded_bytes is not None:
        mine = {i: sync.param_bytes() for i, sync in sharded.items()}
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        stage_bytes = [0] * num_stages
        for part in everyone:
            for i, b in part.items():
                stage_bytes[i] = b
    return ParamBudget(max_active_stages, max_unsharded_bytes, stage_bytes)
