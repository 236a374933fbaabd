"""This rank's stages, as the training tools see them.

The tools in ``pipeline_ext.training`` (tied parameters, clipping, checkpoints)
act on "what this rank holds of the pipeline". Users hold that in different
shapes: a ``PipelineSchedule`` (which also knows the stage->rank layout and the
pipeline's process group), one ``PipelineStage`` or a list of them, or, for the
unsplit reference model, a plain ``nn.Module``. This module turns each of them
into one description, so every tool accepts the same things and none repeats
the unpacking.

Stages may be wrapped (DDP, ``torch.compile``): parameter names are looked up
on the wrapped module, so ``"embed.weight"`` means the same parameter whether
or not the stage was wrapped in DDP (whose names gain a ``module.`` prefix).
FSDP2's ``fully_shard`` keeps the names, so it needs no unwrapping.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch.distributed as dist
from torch import nn

from pipeline_ext.pipelining.schedules import PipelineSchedule
from pipeline_ext.pipelining.stage import PipelineStage

__all__ = ["LocalStages", "local_stages", "unwrap"]

# attribute under which a wrapper keeps the module it wraps: DDP, torch.compile
_WRAPPED = ("module", "_orig_mod")


def unwrap(module: nn.Module) -> nn.Module:
    """The user's module inside DDP / ``torch.compile`` wrappers (parameter names as the user wrote them)."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(module, DistributedDataParallel):
            module = module.module
        elif type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod"):
            module = module._orig_mod
        else:
            return module


@dataclass
class LocalStages:
    """What this rank holds: ``{stage_index: module}``, the pipeline's group, and who holds the other stages.

    ``stage_to_rank`` maps every stage index to its rank *in ``group``*; it is
    None when only stages were given (the tools then find it out with one
    collective, see ``stage_ranks``). ``group`` is the pipeline (pp) group:
    None means the default group.
    """

    modules: dict[int, nn.Module]
    num_stages: int
    group: Optional[dist.ProcessGroup]
    stage_to_rank: Optional[list[int]] = None
    schedule: Any = None  # the PipelineSchedule, when one was given

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def stage_ranks(self) -> list[int]:
        """Rank (in ``group``) of every stage; one all-gather over the group when no schedule was given."""
        if self.stage_to_rank is None:
            if not self.distributed:
                self.stage_to_rank = [0] * self.num_stages
            else:
                mine = sorted(self.modules)
                gathered: list[Any] = [None] * dist.get_world_size(self.group)
                dist.all_gather_object(gathered, mine, group=self.group)
                owner: dict[int, int] = {}
                for r, stages in enumerate(gathered):
                    for s in stages:
                        if s in owner:
                            raise ValueError(f"stage {s} is held by ranks {owner[s]} and {r} of the pipeline group")
                        owner[s] = r
                missing = sorted(set(range(self.num_stages)) - set(owner))
                if missing:
                    raise ValueError(f"no rank of the pipeline group holds stages {missing}")
                self.stage_to_rank = [owner[s] for s in range(self.num_stages)]
        return self.stage_to_rank

    def global_rank(self, group_rank: int) -> int:
        if not self.distributed or self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if self.distributed else 0


def local_stages(obj: Any, group: Optional[dist.ProcessGroup] = None) -> LocalStages:
    """Describe ``obj``: a ``PipelineSchedule``, a ``PipelineStage``, a list of stages, or an ``nn.Module``.

    A plain ``nn.Module`` is the unsplit model: one stage, no pipeline group.
    ``group`` overrides the pipeline group (else the schedule's / stages').
    """
    if isinstance(obj, PipelineSchedule):
        return LocalStages({i: s.submod for i, s in obj.stages.items()}, obj.num_stages,
                           group if group is not None else obj.group, list(obj.schedule.stage_to_rank), obj)
    if isinstance(obj, PipelineStage):
        obj = [obj]
    if isinstance(obj, nn.Module):
        return LocalStages({0: obj}, 1, group)
    if isinstance(obj, Sequence) and obj and all(isinstance(s, PipelineStage) for s in obj):
        stages: Sequence[PipelineStage] = obj
        if len({s.stage_index for s in stages}) != len(stages):
            raise ValueError("the same stage_index was given twice")
        if len({s.num_stages for s in stages}) != 1:
            raise ValueError("the stages disagree on num_stages")
        return LocalStages({s.stage_index: s.submod for s in stages}, stages[0].num_stages,
                           group if group is not None else stages[0].group)
    raise TypeError(
        "expected a PipelineSchedule, a PipelineStage, a list of PipelineStages or an nn.Module, "
        f"got {type(obj).__name__}"
    )
