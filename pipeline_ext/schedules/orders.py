"""Building blocks for per-rank action orders, shared by the built-in generators.

Most pipeline schedules are the same three moves in different proportions:
a warm-up of forwards, a steady phase pairing one forward with one backward,
and a drain of backwards; zero-bubble variants additionally split the backward
and delay its W half. Writing those moves once here keeps each generator in
:mod:`.builtin` a few lines long and keeps their loops from being copies of
each other (the failure mode of one-class-per-schedule designs).
"""
from __future__ import annotations

from collections import Counter, deque
from typing import Iterator, Sequence

from pipeline_ext.schedules.ir import Action, ActionKind

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W


def pipeline_order(
    forwards: Sequence[Action],
    backwards: Sequence[Sequence[Action]],
    warmup: int,
    backward_first: bool = False,
) -> list[Action]:
    """``warmup`` forwards, then alternate one forward with one backward group, then drain.

    ``backwards`` is a list of groups (a B, or an I followed by any W passes
    placed with it); group k pairs with forward ``warmup + k``. With
    ``backward_first`` each steady step runs the group before the forward
    (ZB-H2's I, W, F) instead of after it (1F1B's F, B). ``warmup = len(forwards)``
    gives fill-drain (GPipe).
    """
    warmup = min(warmup, len(forwards))
    out = list(forwards[:warmup])
    steady = len(forwards) - warmup
    for k in range(steady):
        step = [[forwards[warmup + k]], list(backwards[k])]
        for part in reversed(step) if backward_first else step:
            out.extend(part)
    for group in backwards[steady:]:
        out.extend(group)
    return out


def split_backward(stage: int, m: int, lag: int) -> list[list[Action]]:
    """Backward groups for one stage with the W of microbatch j placed after the I of j + lag.

    A lag of L keeps L more microbatches' activations alive but lets the I
    passes (the critical path) run L steps earlier; the last group carries every
    W still owed, so the tail of the rank is W passes that fill what would be
    idle time.
    """
    return split_backward_of([(stage, j) for j in range(m)], lag)


def split_backward_of(order: Sequence[tuple[int, int]], lag: int) -> list[list[Action]]:
    """:func:`split_backward` over any (stage, microbatch) order: the k-th I carries the W of the (k - lag)-th."""
    owed = [Action(s, W, j) for s, j in order]
    groups = [[Action(s, I, j)] + ([owed[k - lag]] if k >= lag else []) for k, (s, j) in enumerate(order)]
    groups[-1].extend(owed[max(len(order) - lag, 0):])
    return groups


def depth_first(rank: int, p: int, v: int, m: int, reverse: bool, group: int = 0) -> Iterator[tuple[int, int]]:
    """(stage, microbatch) pairs of one rank in Megatron's interleaved order.

    Microbatches pass through the rank's v stages (s = rank + k*p, loop
    placement) in groups of ``group`` (default p): ``group`` microbatches on the
    first local stage, the same ones on the next, ..., then the next group.
    ``reverse`` walks the local stages last to first, as the backward does.
    """
    g = group or p
    for k in range(m * v):
        chunk = (k // g) % v
        if reverse:
            chunk = v - 1 - chunk
        yield rank + chunk * p, (k // (g * v)) * g + k % g


def interleaved_rounds(p: int, m: int) -> tuple[int, int]:
    """(rounds, microbatches per round) of an interleaved order, as torch counts them.

    ``max(1, m // p)`` rounds of ``m // rounds`` microbatches, so any m that
    the rounds divide works (2 microbatches on 4 ranks, or 10 on 4), not only
    multiples of p.
    """
    rounds = max(1, m // p)
    return rounds, m // rounds


class RankBuilder:
    """Appends a rank's actions phase by phase, numbering microbatches itself.

    Phase-structured schedules (ZB-V, DualPipeV) say "a forward on my first
    stage, then a backward on my second" rather than naming microbatches; the
    builder hands out the next microbatch per (stage, kind) and keeps a FIFO of
    W passes owed by split backwards, like the weight-grad store of the runtime.
    """

    def __init__(self, m: int) -> None:
        self.m = m
        self.actions: list[Action] = []
        self._next: Counter = Counter()
        self._owed_w: deque[Action] = deque()

    def count(self, stage: int, kind: ActionKind) -> int:
        """How many forwards (``F``) or backwards (``B``/``I``, counted together) were emitted."""
        return self._next[(stage, B if kind is I else kind)]

    def emit(self, *items: tuple[int, ActionKind]) -> None:
        """Append the next (stage, kind) of each item; a W is the stage's oldest owed W.

        A forward or backward past the last microbatch (and a W of a stage
        with nothing owed, once its backwards are all out) is skipped, so a
        phase sized for many microbatches shrinks gracefully when there are
        few (ZB-V with fewer microbatches than ranks, as torch allows).
        """
        for stage, kind in items:
            if kind is not W and self._next[(stage, B if kind is I else kind)] >= self.m:
                continue
            if kind is W:
                owed = next((a for a in self._owed_w if a.stage == stage), None)
                if owed is None:
                    if self._next[(stage, B)] >= self.m:
                        continue
                    raise ValueError(f"a W of stage {stage} was asked for with none owed (a generator bug)")
                self._owed_w.remove(owed)
                self.actions.append(owed)
                continue
            key = (stage, B if kind is I else kind)
            action = Action(stage, kind, self._next[key])
            self._next[key] += 1
            self.actions.append(action)
            if kind is I:
                self._owed_w.append(Action(stage, W, action.microbatch))

    def repeat(self, n: int, *items: tuple[int, ActionKind]) -> None:
        for _ in range(n):
            self.emit(*items)

    def backward(self, stage: int, split: bool = False) -> None:
        """A full B, or an I whose W is owed until :meth:`pop_w` / :meth:`finish_w`."""
        self.emit((stage, I if split else B))

    def pop_w(self) -> None:
        """Run the oldest owed W, whatever its stage."""
        self.actions.append(self._owed_w.popleft())

    def finish_w(self, *stages: int) -> None:
        """Run every owed W: those of ``stages`` first, in that order, then the rest oldest first."""
        for stage in stages:
            while any(a.stage == stage for a in self._owed_w):
                self.emit((stage, W))
        while self._owed_w:
            self.pop_w()
