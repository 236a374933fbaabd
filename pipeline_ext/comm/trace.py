"""Execution traces across processes: every rank's spans gathered on one rank (a collective)."""
from __future__ import annotations

from typing import Optional

from pipeline_ext.runtime.trace import Tracer
from pipeline_ext.schedules import Action, ActionKind
from pipeline_ext.schedules.simulate import Span

__all__ = ["gather_steps", "gather_trace"]


def gather_steps(tracer: Tracer, group: Optional[object] = None, dst: int = 0) -> Optional[list[list[Span]]]:
    """Every rank's spans, step by step, merged on group rank ``dst`` (None elsewhere).

    A collective: every rank of ``group`` must call it, after the same number
    of traced steps. Without torch.distributed initialised, the local spans.
    """
    got = gather_trace(tracer, group, dst)
    return None if got is None else got[0]


def gather_trace(tracer: Tracer, group: Optional[object] = None,
                 dst: int = 0) -> Optional[tuple[list[list[Span]], dict[int, Optional[str]]]]:
    """``gather_steps``, and every rank's ``Tracer.split`` merged (what each stage's I/W split did)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return [sorted(s, key=lambda x: x.start) for s in tracer.steps], dict(tracer.split)
    world = dist.get_world_size(group)
    mine = ([[(sp.rank, tuple(sp.action), sp.start, sp.end) for sp in step] for step in tracer.steps],
            dict(tracer.split))
    gathered: Optional[list] = [None] * world if dist.get_rank(group) == dst else None
    dst_global = dist.get_global_rank(group, dst) if group is not None else dst
    dist.gather_object(mine, gathered, dst=dst_global, group=group)
    if gathered is None:
        return None
    split = {s: why for _, per_rank in gathered for s, why in per_rank.items()}
    gathered = [steps for steps, _ in gathered]
    counts = {len(steps) for steps in gathered}
    if len(counts) != 1:
        raise RuntimeError(f"ranks traced different numbers of steps: {[len(s) for s in gathered]}")
    merged: list[list[Span]] = []
    for i in range(counts.pop()):
        spans = [Span(r, Action(a[0], ActionKind(a[1]), a[2]), s, e) for steps in gathered for r, a, s, e in steps[i]]
        merged.append(sorted(spans, key=lambda x: (x.rank, x.start)))
    return merged, dict(sorted(split.items()))
