"""Skip routes: which stage sends which skip to which stage, what names a skip message, and how one is packed.

A skip stashed on stage i and popped on stage j > i travels directly from i to
j (never through the stages between), and its gradient directly back. Routes
are built from what every stage *declares* (its ``@skippable`` layers), so
they are known before anything runs: a Pipe builds them from its partitions,
a multi-process pipeline from the declarations every rank gathers in its first
step (``comm/skips.py``; every rank then builds the same routes).

[Note: skips need no schedule change]
Why direct sends need no change to the schedule: a skip is sent right after
the stashing stage's F (its gradient right after the popping stage's B or I)
and received right before the popping stage's F (the stashing stage's B or
I). Any valid schedule already runs F of stage i before F of stage j, and the
backward of j before that of i, for the same microbatch; sends never block.
So the skip is always on its way before it is waited for, whatever the schedule.
Messages are matched by tag (``runtime/tags.py`` gives skips their own
tags), which Gloo and the in-process channels do; NCCL matches by order only,
so skips between processes are refused there.

The executor moves the messages (a stage's F and B/I send and receive them,
``runtime/executor.py``); what identifies one (``SkipMessage``: stashing
stage, popping stage, microbatch, direction) and what it carries
(``pack_skips``, ``pack_skip_grads``) are here, with the routes they follow.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch
from torch import nn

from pipeline_ext.skip.skippable import Skippable, SkipRouteError
from pipeline_ext.skip.tracker import SkipKey

__all__ = ["StageSkips", "SkipRoutes", "SkipRouteError", "SkipMessage", "declared_skips", "pack_skips",
           "unpack_skips", "pack_skip_grads"]


@dataclass(frozen=True)
class StageSkips:
    """The skips that cross one stage's boundary: stashed here for a later stage, popped here from an earlier one."""

    stashes: frozenset[SkipKey] = frozenset()
    pops: frozenset[SkipKey] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.stashes or self.pops)


def declared_skips(module: nn.Module) -> StageSkips:
    """What a stage module declares; a skip stashed and popped inside the stage stays inside it."""
    stashes: set[SkipKey] = set()
    pops: set[SkipKey] = set()
    for m in module.modules():
        if isinstance(m, Skippable):
            stashes.update(m.key(n) for n in m.stashable_names)
            pops.update(m.key(n) for n in m.poppable_names)
    inside = stashes & pops
    return StageSkips(frozenset(stashes - inside), frozenset(pops - inside))


class SkipRoutes:
    """Every skip's (source stage, destination stage), checked; per stage, grouped by peer stage.

    ``sources(j)`` / ``destinations(i)`` map a peer stage to the keys of the
    one message between the two per microbatch, in the order every rank packs
    them (``SkipKey.order``).
    """

    def __init__(self, per_stage: Sequence[StageSkips]) -> None:
        src: dict[SkipKey, int] = {}
        dst: dict[SkipKey, int] = {}
        problems: list[str] = []
        for s, decl in enumerate(per_stage):
            for key, where, verb in [(k, src, "stashed") for k in decl.stashes] + [(k, dst, "popped") for k in decl.pops]:
                if key in where:
                    problems.append(f"skip {key} is {verb} on stage {where[key]} and again on stage {s} "
                                    "(isolate the second use with a Namespace)")
                else:
                    where[key] = s
        for key in sorted(src.keys() - dst.keys(), key=lambda k: k.order):
            problems.append(f"skip {key} is stashed on stage {src[key]} but no later stage pops it"
                            + _random_namespace_hint(key, dst))
        for key in sorted(dst.keys() - src.keys(), key=lambda k: k.order):
            problems.append(f"skip {key} is popped on stage {dst[key]} but no stage stashes it"
                            + _random_namespace_hint(key, src))
        for key in sorted(src.keys() & dst.keys(), key=lambda k: k.order):
            if dst[key] <= src[key]:
                problems.append(f"skip {key} is popped on stage {dst[key]}, before stage {src[key]} stashes it")
        if problems:
            raise SkipRouteError("the pipeline's skip connections do not pair up:\n" + "\n".join(f"* {p}" for p in problems))
        self.edges: dict[SkipKey, tuple[int, int]] = {k: (src[k], dst[k]) for k in sorted(src, key=lambda k: k.order)}
        self.num_stages = len(per_stage)
        self._by_dst: dict[int, dict[int, list[SkipKey]]] = {}
        self._by_src: dict[int, dict[int, list[SkipKey]]] = {}
        for key, (i, j) in self.edges.items():
            self._by_dst.setdefault(j, {}).setdefault(i, []).append(key)
            self._by_src.setdefault(i, {}).setdefault(j, []).append(key)

    def __bool__(self) -> bool:
        return bool(self.edges)

    def __repr__(self) -> str:
        return "SkipRoutes(" + ", ".join(f"{k}: {i}->{j}" for k, (i, j) in self.edges.items()) + ")"

    def moving_stages(self) -> set[int]:
        """The stages that send or receive a skip."""
        return set(self._by_dst) | set(self._by_src)

    def sources(self, stage: int) -> dict[int, list[SkipKey]]:
        """Stages that send ``stage`` skips, and the keys of each one's message."""
        return self._by_dst.get(stage, {})

    def destinations(self, stage: int) -> dict[int, list[SkipKey]]:
        """Stages ``stage`` sends skips to, and the keys of each message."""
        return self._by_src.get(stage, {})

    @classmethod
    def of_modules(cls, modules: Sequence[nn.Module]) -> "SkipRoutes":
        return cls([declared_skips(m) for m in modules])


def _random_namespace_hint(key: SkipKey, other_side: dict[SkipKey, int]) -> str:
    if key.namespace is None or not any(k.name == key.name and k.namespace != key.namespace for k in other_side):
        return ""
    return (f"; a skip named {key.name!r} exists under another namespace: between processes a namespace must be "
            "named (Namespace('...')) so every rank builds the same one")


class SkipMessage(NamedTuple):
    """A skip message (or its gradient) between a stashing and a popping stage: not an action of the schedule."""

    src: int
    dst: int
    microbatch: int
    gradient: bool


def pack_skips(keys: Sequence[SkipKey], values: dict[SkipKey, Optional[torch.Tensor]]) -> list[torch.Tensor]:
    """One skip message: a mask of which keys are None, then the other tensors in key order."""
    missing = [str(k) for k in keys if k not in values]
    if missing:
        raise RuntimeError(f"skips {', '.join(missing)} were declared but not stashed by this forward")
    mask = torch.tensor([values[k] is None for k in keys], dtype=torch.bool)
    return [mask] + [values[k] for k in keys if values[k] is not None]  # type: ignore[misc]


def unpack_skips(keys: Sequence[SkipKey], tensors: Sequence[torch.Tensor]) -> dict[SkipKey, Optional[torch.Tensor]]:
    """Inverse of :func:`pack_skips`."""
    mask, rest = tensors[0].tolist(), iter(tensors[1:])
    return {k: None if is_none else next(rest) for k, is_none in zip(keys, mask)}


def pack_skip_grads(keys: Sequence[SkipKey], grads: dict[SkipKey, Optional[torch.Tensor]]) -> list[torch.Tensor]:
    """One gradient per key, in key order; an empty tensor where the skip has no gradient (None, integer)."""
    return [g if g is not None else torch.empty(0) for g in (grads.get(k) for k in keys)]
