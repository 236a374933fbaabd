"""Parameters tied across pipeline stages (input embedding = output head).

Why this exists: a language model that ties its input embedding to its output
projection has, once cut into a pipeline, two copies of one weight: one on the
first stage, one on the last. Each copy only receives the gradient of its own
use, so unless the two gradients are summed before the optimizer, the copies
train apart and the model is silently wrong (measured: gradient error 1.07).
Neither torch.distributed.pipelining nor DDP does this for you.

What ``tie_parameters`` guarantees, per tie:
- the copies start equal (the lowest stage's copy is broadcast at construction);
- after every training ``step()`` of the schedule, each copy's ``.grad`` holds
  the sum of every copy's gradient of that step, so an optimizer (the same one,
  with the same hyper-parameters, on every copy) keeps them identical;
- accumulation over several ``step()`` calls before one optimizer step stays
  exact: before a step, every copy but the first one's gradient is zeroed (they
  all hold the same sum then), so each step adds only its own contribution;
- copies on one rank (V schedules put the first and last stage together) are
  summed in memory, no communication; one Parameter used by two stages needs
  nothing at all (autograd already accumulates both uses into one ``.grad``);
- copies on different ranks are summed with one all-reduce per tie over the
  ranks holding them *within this pipeline* (a subgroup of the pipeline group).

Order with data parallelism: the tie sum runs over the pipeline axis, the DP
reduction (DDP's all-reduce, FSDP2's reduce-scatter, or a manual all-reduce
over the DP group after ``step()``) over the DP axis. Both are sums of
gradients over disjoint sets of ranks, so their order does not change the
result; each happens exactly once per step. With FSDP2 or tensor parallelism
both copies must be sharded alike (same placements on meshes of one shape,
checked at construction: a TP embedding with ``RowwiseParallel`` and a head
with ``ColwiseParallel`` are both ``Shard(0)`` of the (vocab, dim) weight): the
tie then sums the local shards over the pipeline ranks of each shard's
position, each gradient first laid out as its parameter is (see
``_grad_as_param``).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

from pipeline_ext.pipelining.schedules import PipelineSchedule
from pipeline_ext.comm.groups import GroupMaker
from pipeline_ext.training.stages import LocalStages, local_stages, unwrap

__all__ = ["TiedParameters", "tie_parameters", "ties_of"]

# schedule -> its TiedParameters (so clip_grad_norm_ counts tied copies once without being told)
_REGISTRY: "weakref.WeakKeyDictionary[Any, list[TiedParameters]]" = weakref.WeakKeyDictionary()


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (the local shard of a DTensor)."""
    return t.to_local() if hasattr(t, "to_local") else t


@dataclass
class _Tie:
    name: str
    fqns: dict[int, str]  # stage index -> parameter name in that stage's module
    owner_stage: int
    ranks: list[int]  # group ranks (pipeline group) holding a copy, ascending
    params: list[nn.Parameter] = field(default_factory=list)  # this rank's distinct copies, owner's first
    owns: bool = False  # this rank holds the owner stage's copy (params[0])
    group: Optional[dist.ProcessGroup] = None  # over `ranks`; None when they are all this rank


class TiedParameters:
    """Copies of one weight on several stages, kept equal: gradients summed, values broadcast at start.

    ``ties`` maps a tie's name to ``{stage_index: parameter name in that
    stage's module}``, e.g. ``{"embed": {0: "embed.weight", 3: "head.weight"}}``.
    Every rank of the pipeline passes the same ``ties`` (ranks holding none of
    the stages of a tie take no part in it). Construction is a collective over
    the pipeline group.

    With a schedule, use ``tie_parameters`` (it hooks ``reduce_grads`` into
    every training step). Without one (stages driven by your own loop), call
    ``reduce_grads()`` once after the backward passes and before the optimizer.
    """

    def __init__(self, stages: Any, ties: Mapping[str, Mapping[int, str]], broadcast: bool = True) -> None:
        self._stages: LocalStages = local_stages(stages)
        if not isinstance(ties, Mapping) or not ties:
            raise TypeError("ties must be a non-empty mapping {name: {stage_index: parameter name}}")
        stage_to_rank = self._stages.stage_ranks()
        self.ties: list[_Tie] = [self._resolve(str(name), spec, stage_to_rank) for name, spec in sorted(ties.items())]
        self._make_groups()
        self._check_alike()
        if broadcast:
            self.broadcast_params()

    # -- construction ---------------------------------------------------------------------------
    def _resolve(self, name: str, spec: Mapping[int, str], stage_to_rank: list[int]) -> _Tie:
        if not isinstance(spec, Mapping) or len(spec) < 2:
            raise ValueError(f"tie {name!r}: needs {{stage_index: parameter name}} for at least two stages, got {spec!r}")
        fqns = {int(s): str(f) for s, f in spec.items()}
        for s in fqns:
            if not 0 <= s < self._stages.num_stages:
                raise ValueError(f"tie {name!r}: stage {s} is not in [0, {self._stages.num_stages})")
        owner = min(fqns)
        tie = _Tie(name, fqns, owner, sorted({stage_to_rank[s] for s in fqns}))
        me = self._stages.rank
        seen: set[int] = set()
        for s in sorted(fqns):  # owner stage first
            if stage_to_rank[s] != me:
                continue
            module = self._stages.modules.get(s)
            if module is None:
                raise ValueError(f"tie {name!r}: the schedule places stage {s} on this rank but it was not given")
            try:
                p = unwrap(module).get_parameter(fqns[s])
            except AttributeError as exc:
                names = [n for n, _ in unwrap(module).named_parameters()]
                raise ValueError(f"tie {name!r}: stage {s} has no parameter {fqns[s]!r} ({exc}); "
                                 f"its parameters: {names[:12]}{' ...' if len(names) > 12 else ''}") from None
            if s == owner:
                tie.owns = True
            if id(p) not in seen:  # one Parameter used by two local stages: nothing to tie
                seen.add(id(p))
                tie.params.append(p)
        return tie

    def _make_groups(self) -> None:
        """A process group per set of ranks (the pipeline group itself when a tie spans all of it).

        Collective over the default group (``GroupMaker``): every rank builds its ties together.
        """
        if not self._stages.distributed:
            return
        size = dist.get_world_size(self._stages.group)
        mine = [tie for tie in self.ties if len(tie.ranks) >= 2 and self._stages.rank in tie.ranks]
        # Groups of part of the pipeline are made with every rank of the default group (GroupMaker): made
        # by their members alone, torch would name them after how many groups each process already has,
        # and two ranks with different histories (say, two different ties) would wait for each other forever.
        keys = {tuple(tie.ranks): tuple(self._stages.global_rank(r) for r in tie.ranks) for tie in mine}
        made = GroupMaker().make(sorted({g for k, g in keys.items() if len(k) < size}))
        whole = self._stages.group if self._stages.group is not None else dist.group.WORLD
        for tie in mine:
            key = tuple(tie.ranks)
            tie.group = whole if len(key) == size else made[keys[key]]

    def _members(self):
        """Ties this rank takes part in, with their group (None: all copies are here)."""
        return [t for t in self.ties if t.params]

    def _check_alike(self) -> None:
        """Every copy of a tie has one shape and dtype (else a clear error, not a wrong broadcast)."""
        for tie in self._members():
            mine = {(tuple(_local(p).shape), str(p.dtype), "plain" if _placements(p) is None else str(_placements(p)))
                    for p in tie.params}
            if tie.group is not None:
                gathered: list[Any] = [None] * dist.get_world_size(tie.group)
                dist.all_gather_object(gathered, sorted(mine), group=tie.group)
                mine = {tuple(x) for g in gathered for x in g}
            if len(mine) != 1:
                raise ValueError(f"tie {tie.name!r}: the tied parameters {tie.fqns} differ in "
                                 f"(local shape, dtype, placements): "
                                 f"{sorted(mine)}")

    def _owner_global_rank(self, tie: _Tie) -> int:
        return self._stages.global_rank(self._stages.stage_ranks()[tie.owner_stage])

    # -- the work -------------------------------------------------------------------------------
    @torch.no_grad()
    def broadcast_params(self) -> None:
        """Make every copy equal to the owner's (the lowest stage's). A collective over each tie's ranks."""
        for tie in self._members():
            first = _local(tie.params[0])
            if tie.group is not None:
                dist.broadcast(first, src=self._owner_global_rank(tie), group=tie.group)
            for p in tie.params[1:]:
                _local(p).copy_(first)

    @torch.no_grad()
    def zero_copies(self) -> None:
        """Zero every copy's gradient but the owner's, before a step that accumulates (see the module doc)."""
        for tie in self._members():
            for p in tie.params[0 if not tie.owns else 1:]:
                if p.grad is not None:
                    p.grad.zero_()

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Sum the copies' gradients into every copy. A collective over each tie's ranks."""
        for tie in self._members():
            if tie.group is None and len(tie.params) == 1:
                continue  # one Parameter, one rank: autograd already summed
            total: Optional[torch.Tensor] = None
            for p in tie.params:
                g = _grad_as_param(p)
                if g is not None:
                    total = g.clone(memory_format=torch.contiguous_format) if total is None else total.add_(g)
            if total is None:
                total = torch.zeros_like(_local(tie.params[0]), memory_format=torch.contiguous_format)
            if tie.group is not None:
                dist.all_reduce(total, group=tie.group)
            for p in tie.params:
                if p.grad is None or _placements(p.grad) != _placements(p):
                    p.grad = _grad_like(p, total)
                else:
                    _local(p.grad).copy_(total)

    def copies(self) -> set[int]:
        """``id()`` of this rank's parameters that duplicate another copy (everything but the owner's)."""
        return {id(p) for tie in self._members() for p in tie.params[0 if not tie.owns else 1:]}

    @torch.no_grad()
    def max_difference(self) -> float:
        """Largest |difference| between copies of any tie, same on every member rank (a collective)."""
        worst = torch.zeros(())
        for tie in self._members():
            ref = _local(tie.params[0]).detach().clone()
            if tie.group is not None:
                dist.broadcast(ref, src=self._owner_global_rank(tie), group=tie.group)
            for p in tie.params:
                worst = torch.maximum(worst, (_local(p).detach() - ref).abs().max().float().cpu())
            if tie.group is not None:
                dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=tie.group)
        return float(worst)

    def __repr__(self) -> str:
        return "TiedParameters(" + ", ".join(f"{t.name}: {t.fqns} on ranks {t.ranks}" for t in self.ties) + ")"


def _placements(t: torch.Tensor) -> Optional[tuple]:
    """A DTensor's placements (None for a plain tensor)."""
    return tuple(t.placements) if hasattr(t, "placements") else None


def _grad_as_param(p: nn.Parameter) -> Optional[torch.Tensor]:
    """This rank's part of ``p.grad`` laid out as ``p`` is, so every copy of a tie contributes alike.

    A DTensor gradient need not have its parameter's placements: a tensor-parallel embedding (``RowwiseParallel``,
    weight ``Shard(0)``) gets a ``Replicate`` gradient from torch's embedding backward, whose local tensor is the
    whole weight, while the head's (``ColwiseParallel``) is ``Shard(0)``. Summing the local tensors as they are
    would add a whole weight to a shard; redistributing to the parameter's placements first (a local slice for
    Replicate, a reduce-scatter over the mesh for Partial, which every rank of that mesh runs, tie by tie in
    one order) makes the local parts match.
    """
    g = p.grad
    if g is None:
        return None
    if _placements(g) is not None and _placements(p) is not None and _placements(g) != _placements(p):
        g = g.redistribute(p.device_mesh, p.placements)
    return _local(g)


def _grad_like(p: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """A new ``.grad`` for ``p`` holding ``local`` (wrapped as a DTensor like ``p`` when ``p`` is one)."""
    if hasattr(p, "to_local"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local.clone(), p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())
    return local.clone()


def tie_parameters(schedule: Any, ties: Mapping[str, Mapping[int, str]], broadcast: bool = True) -> TiedParameters:
    """Tie parameters across the stages of ``schedule`` and keep them tied on every training step.

    ``ties``: ``{name: {stage_index: parameter name in that stage's module}}``.
    The copies are made equal now (``broadcast``); every ``schedule.step()``
    then zeroes the duplicate copies' gradients before it runs and sums all
    copies' gradients after its backward (see the module doc). Given stages
    instead of a schedule, nothing is hooked: call ``reduce_grads()`` yourself.
    """
    tied = TiedParameters(schedule, ties, broadcast=broadcast)
    if isinstance(schedule, PipelineSchedule):
        schedule.register_step_pre_hook(lambda: tied.zero_copies())
        schedule.register_step_post_hook(lambda: tied.reduce_grads())
        _REGISTRY.setdefault(schedule, []).append(tied)
    return tied


def ties_of(schedule: Any) -> list[TiedParameters]:
    """The ties ``tie_parameters`` registered on ``schedule`` (none for other objects)."""
    try:
        return list(_REGISTRY.get(schedule, []))
    except TypeError:  # not weak-referenceable: nothing was registered
        return []
