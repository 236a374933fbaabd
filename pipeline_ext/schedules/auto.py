"""A greedy zero-bubble scheduler for a given cost profile and memory limit.

The hand-made schedules are optimal only for the costs they were drawn for
(ZB-H1/H2 assume F = B = W). Given measured costs and the number of
activations a rank can hold, this builds a schedule in the spirit of the Zero
Bubble paper's heuristic: replay time under the simulator's model, and
whenever a rank is free, run the input-grad pass I if its gradient has arrived
(it is on the critical path), else a forward if its input has arrived and the
memory limit allows, else a deferred W to fill the wait. The result is an
ordinary :class:`Schedule` (one stage per rank, backward split).
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from pipeline_ext.schedules.ir import Action, ActionKind, Schedule, ScheduleError
from pipeline_ext.schedules.lowering import loop_placement
from pipeline_ext.schedules.simulate import Costs, simulate

F, I, W = ActionKind.F, ActionKind.I, ActionKind.W
INF = float("inf")


@dataclass
class _Rank:
    """What the greedy loop knows about one rank while it builds the schedule."""

    m: int
    free: float = 0.0
    next_f: int = 0
    next_i: int = 0
    owed_w: deque = field(default_factory=deque)
    input_at: dict[int, float] = field(default_factory=dict)  # microbatch -> when its F may start
    grad_at: dict[int, float] = field(default_factory=dict)  # microbatch -> when its I may start
    actions: list[Action] = field(default_factory=list)
    last_compute: ActionKind = F  # the last F or I run (W excluded)

    @property
    def live(self) -> int:
        return self.next_f - (len(self.actions) - self.next_f - self.next_i)

    @property
    def done(self) -> bool:
        return self.next_i == self.m and not self.owed_w

    def options(self, limit: int, ahead: int, w_cost: float, patient: bool, eta: float) -> dict[ActionKind, float]:
        """Earliest start of each kind of action this rank could run next, as far as is known.

        F needs its input, room under ``limit`` and fewer than ``ahead`` forwards
        waiting for their I. W is offered when memory forces it, or to fill a
        wait (with ``patient``, only a wait at least as long as the W, judged by
        the earliest known arrival or ``eta``).
        """
        out: dict[ActionKind, float] = {}
        if self.next_i < self.next_f and self.next_i in self.grad_at:
            out[I] = max(self.free, self.grad_at[self.next_i])
        if (self.next_f < self.m and self.live < limit and self.next_f - self.next_i < ahead
                and self.next_f in self.input_at):
            out[F] = max(self.free, self.input_at[self.next_f])
        if self.owed_w:
            soon = min(out.values(), default=eta)
            forced = self.live >= limit
            if not patient or forced or soon >= self.free + w_cost:
                out[W] = self.free
        return out


def auto(p: int, m: int, costs: Costs = Costs(), max_activations: Optional[int] = None) -> Schedule:
    """Greedy zero-bubble schedule for ``p`` ranks, ``m`` microbatches and ``costs``.

    ``max_activations`` caps live activations per rank (default ``p``, the
    memory of 1F1B's first rank; at least 1). The greedy rule has two knobs
    that the paper's heuristic also varies: how many forwards a rank may run
    ahead of its backwards (more fills the warm-up, less leaves memory to
    defer W into the tail) and whether a W may start when a known input is due
    before it would finish. A few settings are tried and the one with the
    shortest simulated makespan wins. On the Zero Bubble paper's profiles it
    matches ZB-H1 with a limit of p and beats it with 2p; it is a heuristic,
    so other profiles (e.g. W much slower than B) can favour a hand schedule.
    """
    limit = p if max_activations is None else max_activations
    if p < 1 or m < 1 or limit < 1:
        raise ScheduleError(
            f"auto needs p >= 1, m >= 1 and max_activations >= 1 (got p={p}, m={m}, max_activations={limit})"
        )
    best: Optional[tuple[float, float, Schedule]] = None
    for extra in sorted({0, 1, 2, 3, p // 4, p // 2, p - 1}):
        for patient in (False, True):
            candidate = _greedy(p, m, costs, limit, extra, patient)
            result = simulate(candidate, costs)
            key = (round(result.bubble_rate, 12), result.makespan)
            if best is None or key < best[:2]:
                best = (*key, candidate)
    assert best is not None
    return best[2]


def _greedy(p: int, m: int, costs: Costs, limit: int, extra: int, patient: bool) -> Schedule:
    """One greedy pass: rank r keeps at most p-r+min(extra, p-r-1) forwards ahead of its I passes."""
    ranks = [_Rank(m) for _ in range(p)]
    ranks[0].input_at.update({j: 0.0 for j in range(m)})
    dur = {(idx, k): costs.duration(Action(idx, k, 0)) for idx in range(p) for k in (F, I, W)}
    hop = [costs.transfer(idx) for idx in range(p)]
    # A rank's next choice only changes when it or a neighbour acts: keep the
    # choices in a heap and drop entries whose rank has acted since (stale version).
    version = [0] * p
    heap: list[tuple[float, int, int, ActionKind]] = []

    def refresh(idx: int) -> None:
        version[idx] += 1
        choice = _choose(ranks, idx, dur, hop, limit, p - idx + min(extra, p - idx - 1), patient)
        if choice is not None:
            heapq.heappush(heap, (choice[0], idx, version[idx], choice[1]))

    for idx in range(p):
        refresh(idx)
    while heap:
        start, idx, ver, kind = heapq.heappop(heap)
        if ver != version[idx]:
            continue
        _run(ranks, idx, kind, start, dur, hop)
        for near in range(max(idx - 1, 0), min(idx + 2, p)):
            refresh(near)
    if not all(r.done for r in ranks):  # pragma: no cover - the last rank can always make progress
        raise ScheduleError(f"auto scheduler is stuck (p={p}, m={m}, max_activations={limit})")
    return Schedule([r.actions for r in ranks], loop_placement(p, 1), m, "auto")


def _choose(ranks: list[_Rank], idx: int, dur: dict, hop: list[float], limit: int, ahead: int,
            patient: bool) -> Optional[tuple[float, ActionKind]]:
    """(start, kind) of the action rank ``idx`` would run next, or None if it must wait."""
    rank = ranks[idx]
    eta = INF  # earliest the awaited gradient could arrive, for the patience rule
    if idx + 1 < len(ranks) and rank.next_i < rank.next_f:
        eta = ranks[idx + 1].free + dur[(idx + 1, I)] + hop[idx + 1]
    options = rank.options(limit, ahead, dur[(idx, W)], patient, eta)
    if not options:
        return None
    start = min(options.values())
    # Alternate F and I once both flow (1F1B's steady state); W only fills.
    order = (F, I, W) if rank.last_compute is I else (I, F, W)
    return start, next(k for k in order if options.get(k, INF) <= start)


def _run(ranks: list[_Rank], idx: int, kind: ActionKind, start: float, dur: dict, hop: list[float]) -> None:
    """Append one action to rank ``idx`` and publish when its results reach the neighbours."""
    rank = ranks[idx]
    if kind is F:
        j = rank.next_f
        rank.next_f += 1
    elif kind is I:
        j = rank.next_i
        rank.next_i += 1
        rank.owed_w.append(j)
    else:
        j = rank.owed_w.popleft()
    rank.actions.append(Action(idx, kind, j))
    if kind is not W:
        rank.last_compute = kind
    rank.free = start + dur[(idx, kind)]
    if kind is F and idx + 1 < len(ranks):
        ranks[idx + 1].input_at[j] = rank.free + hop[idx]
    elif kind is F:
        rank.grad_at[j] = rank.free
    elif kind is I and idx > 0:
        ranks[idx - 1].grad_at[j] = rank.free + hop[idx]
