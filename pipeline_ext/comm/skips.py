"""Skip routes between processes: every rank's declarations, announced in its step record and gathered once.

A rank's step record carries a digest of what its stages declare (0: nothing
crosses them); when the records of a step carry digests not seen before, every
rank gathers every rank's declarations (one ``all_gather_object``) and builds
the same routes from them (``runtime/skips.SkipRoutes``).
"""
from __future__ import annotations

from typing import Any

from pipeline_ext.comm.identity import stable_hash
from pipeline_ext.runtime.skips import SkipRoutes, StageSkips

__all__ = ["declarations_digest", "gather_routes"]


def declarations_digest(local: dict[int, StageSkips]) -> int:
    """What a rank puts in its step record (word 13): 0 when its stages declare no skip crossing them."""
    if not any(local.values()):
        return 0
    return stable_hash(repr(sorted((s, sorted(d.stashes), sorted(d.pops)) for s, d in local.items())))


def gather_routes(local: dict[int, StageSkips], num_stages: int, group: Any) -> SkipRoutes:
    """Every rank's declarations, gathered over ``group`` (a collective: every rank calls it), as routes.

    Every rank builds the same routes from the same declarations, so a
    mismatch raises the same ``SkipRouteError`` on every rank.
    """
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    per_stage = [StageSkips()] * num_stages
    for decls in gathered:
        for stage, decl in decls.items():
            per_stage[stage] = decl
    return SkipRoutes(per_stage)
