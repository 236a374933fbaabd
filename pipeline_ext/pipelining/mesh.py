"""Pipeline x data parallel layout on torch's ``DeviceMesh``.

Why this exists: with pp x dp, each rank needs two groups (its pipeline: the
other stages of its replica; its data-parallel group: the same stage in the
other replicas) and the list of stages it holds under the chosen schedule.
The mesh is torch's own (``init_device_mesh``) so DDP, FSDP2 and DCP take its
sub-meshes directly; this module only fixes the dimension names and says,
for this rank, what it holds::

    mesh = pe.pipeline_mesh(pp=2, dp=2)                # dims ("dp", "pp"), ranks row-major
    layout = pe.pipeline_layout(mesh, "zbv")            # this rank's pp/dp ranks and stages
    for s in layout.stages:
        mod = DistributedDataParallel(chunks[s], process_group=layout.dp_group)   # or
        # mod = fully_shard(chunks[s], mesh=mesh["dp"])
        stage = pe.PipelineStage(mod, s, layout.num_stages, device, group=mesh["pp"])

Ranks ``r`` with the same ``r // pp`` form one pipeline (consecutive ranks,
usually one host's GPUs); ranks with the same ``r % pp`` hold the same stages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipeline_ext import schedules as S

__all__ = ["pipeline_mesh", "pipeline_layout", "PipelineLayout"]


def pipeline_mesh(pp: int, dp: int = 1, device_type: Optional[str] = None) -> DeviceMesh:
    """``init_device_mesh(device_type, (dp, pp), mesh_dim_names=("dp", "pp"))``, checked against the world size.

    ``device_type`` defaults to ``"cuda"`` when a GPU is visible, else ``"cpu"``.
    """
    if pp < 1 or dp < 1:
        raise ValueError(f"pp and dp must be >= 1, got pp={pp}, dp={dp}")
    if not dist.is_initialized():
        raise RuntimeError("pipeline_mesh needs torch.distributed to be initialised (init_process_group) first")
    world = dist.get_world_size()
    if pp * dp != world:
        raise ValueError(f"pp * dp = {pp} * {dp} = {pp * dp}, but the world has {world} ranks")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (dp, pp), mesh_dim_names=("dp", "pp"))


@dataclass(frozen=True)
class PipelineLayout:
    """What this rank holds in a pp x dp mesh under one schedule."""

    mesh: DeviceMesh
    pp_rank: int  # position in the pipeline (the schedule's rank)
    dp_rank: int  # which replica
    stages: tuple[int, ...]  # stage indices held here, in order
    num_stages: int

    @property
    def pp_size(self) -> int:
        return self.mesh["pp"].size()

    @property
    def dp_size(self) -> int:
        return self.mesh["dp"].size()

    @property
    def pp_group(self) -> dist.ProcessGroup:
        """The pipeline group: ``PipelineStage(group=...)``."""
        return self.mesh["pp"].get_group()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The data-parallel group: ``DistributedDataParallel(process_group=...)``."""
        return self.mesh["dp"].get_group()


def pipeline_layout(
    mesh: DeviceMesh, schedule: Union[str, S.Schedule] = "1f1b", stages_per_rank: Optional[int] = None
) -> PipelineLayout:
    """This rank's place in ``mesh`` (dims "dp" and "pp") and the stages it holds under ``schedule``.

    ``schedule`` is a built-in name (``stages_per_rank`` as in
    ``schedules.build``; V schedules place stage s and 2p-1-s together) or a
    hand-written ``Schedule`` for ``mesh["pp"].size()`` ranks.
    """
    names = mesh.mesh_dim_names or ()
    if "pp" not in names or "dp" not in names:
        raise ValueError(f"the mesh needs dims named 'dp' and 'pp' (see pipeline_mesh), got {names}")
    pp = mesh["pp"].size()
    if isinstance(schedule, str):
        v = stages_per_rank
        schedule = S.build(schedule, pp, 2 * pp, stages_per_rank=v)  # placement does not depend on m
    if schedule.num_ranks != pp:
        raise ValueError(f"schedule {schedule.name!r} is for {schedule.num_ranks} ranks, the mesh has pp={pp}")
    pp_rank = mesh["pp"].get_local_rank()
    stages = tuple(s for s, r in enumerate(schedule.stage_to_rank) if r == pp_rank)
    return PipelineLayout(mesh, pp_rank, mesh["dp"].get_local_rank(), stages, schedule.num_stages)
