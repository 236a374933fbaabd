"""V-shape schedules with a per-rank activation limit: V-Half and V-Min (controllable memory).

Qi et al., "Pipeline Parallelism with Controllable Memory" (NeurIPS 2024),
observe that a schedule's peak activation memory is set by how long each
activation lives, and that the V placement (rank r holds stage r and stage
2p-1-r, as in ZB-V) lets a rank's two stages balance each other: the first
stage's activations live long (down the V and back), the second stage's
short, and the sum is the same on every rank. Repeating one microbatch's
pattern every F+F+B+B+W+W of a rank's time, activations live for about 4p
stage passes at the tightest (V-Min: about 2p/3 stage activations per rank, a
third of 1F1B's bytes) or 6p with room to absorb warm-up and drain (V-Half:
about p, half of 1F1B's bytes). ZB-V (:func:`.builtin.zbv`) is the same
family at 2p, 1F1B's bytes.

This module builds them by list scheduling under a per-rank limit on live
stage activations: it replays time under the simulator's model and, whenever
a rank is free, starts the action that can start earliest among an input-grad
pass I (the critical path), a forward F (only if the rank then holds at most
``limit`` stage activations) and a deferred weight-grad W (which frees one).
Two kinds of variants are tried and the smallest simulated bubble wins: free
choice, where a first-stage F (a new microbatch on the rank) must also leave
one slot for the second-stage F of a microbatch already in flight, so the
ranks cannot all fill up and stall; and F/I passes kept in the order of the
paper's repeated one-microbatch pattern (V-Min's or V-Half's), which reaches
the tight steady state that free choice misses. Every F checks the limit, so
a schedule's peak is at most ``limit`` by construction; a limit no variant
completes within raises :class:`ScheduleError`.

The bounds (stage activations per rank; halve for rank-microbatch units):
V-Half 2*ceil(p/2) + 2, V-Min 2*ceil((p-1)/3) + 2; ZB-V holds 2p, 1F1B's
first rank p whole-rank activations (2p stage-sized ones). The small constant
is what a list schedule needs to keep its steady state free of bubbles; at
p = 2 all three V schedules hold the same.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

from pipeline_ext.schedules.ir import Action, ActionKind, Schedule, ScheduleError
from pipeline_ext.schedules.lowering import v_placement
from pipeline_ext.schedules.simulate import Costs, bubble_rates, peak_live_activations

F, I, W = ActionKind.F, ActionKind.I, ActionKind.W
INF = float("inf")
Step = tuple[ActionKind, int]  # (F or I, stage)


def v_half_limit(p: int) -> int:
    """V-Half's bound on stage activations per rank: 2 ceil(p/2) + 2, i.e. ceil(p/2) + 1 rank-microbatch units."""
    return 2 * math.ceil(p / 2) + 2


def v_min_limit(p: int) -> int:
    """V-Min's bound on stage activations per rank: 2 ceil((p-1)/3) + 2, i.e. ceil((p-1)/3) + 1 units."""
    return 2 * math.ceil((p - 1) / 3) + 2


@dataclass
class _VRank:
    """What the list scheduler knows about one rank (two stages, ``lo`` = r and ``hi`` = 2p-1-r)."""

    lo: int
    hi: int
    m: int
    sequence: Optional[Sequence[Step]] = None  # the order of this rank's F and I passes, if fixed
    free: float = 0.0
    live: int = 0
    n_w: int = 0
    next_f: dict[int, int] = field(default_factory=dict)
    next_i: dict[int, int] = field(default_factory=dict)
    input_at: dict[int, dict[int, float]] = field(default_factory=dict)  # stage -> microbatch -> when its F may start
    grad_at: dict[int, dict[int, float]] = field(default_factory=dict)  # stage -> microbatch -> when its I may start
    owed_w: deque = field(default_factory=deque)
    actions: list[Action] = field(default_factory=list)
    first: float = 0.0  # when the rank's first action started
    busy: float = 0.0  # the compute time of its actions so far

    def __post_init__(self) -> None:
        for s in (self.lo, self.hi):
            self.next_f[s] = self.next_i[s] = 0
            self.input_at[s], self.grad_at[s] = {}, {}

    @property
    def done(self) -> bool:
        return all(self.next_i[s] == self.m for s in (self.lo, self.hi)) and not self.owed_w

    def options(self, limit: int, reserve: int) -> dict[tuple[ActionKind, int], float]:
        """Earliest known start of each (kind, stage) this rank could run next (stage -1 for the oldest owed W).

        An F needs its input and room: afterwards at most ``limit`` stage
        activations, and ``reserve`` more left free when it is a first-stage F
        (a new microbatch on this rank). With a fixed sequence only its next
        F or I is offered.
        """
        out: dict[tuple[ActionKind, int], float] = {}
        k = len(self.actions) - self.n_w
        nxt = self.sequence[k] if self.sequence is not None and k < len(self.sequence) else None
        for s in (self.hi, self.lo):
            j = self.next_i[s]
            if j < self.next_f[s] and j in self.grad_at[s] and nxt in (None, (I, s)):
                out[(I, s)] = max(self.free, self.grad_at[s][j])
            j = self.next_f[s]
            room = limit - (reserve if s == self.lo else 0)
            if j < self.m and j in self.input_at[s] and self.live < room and nxt in (None, (F, s)):
                out[(F, s)] = max(self.free, self.input_at[s][j])
        if self.owed_w:
            out[(W, -1)] = self.free
        return out


def v_schedule(p: int, m: int, limit: int, name: str = "v_custom", costs: Costs = Costs()) -> Schedule:
    """A V-placed schedule for ``p`` ranks and ``m`` microbatches holding at most ``limit`` stage activations per rank.

    The variant with the smallest simulated bubble under ``costs`` (per-stage
    costs) among: free list scheduling with two tie-breaking orders, and list
    scheduling that keeps each rank's F and I passes in the order of V-Min's
    or V-Half's repeated one-microbatch pattern (W passes still fill in).
    Raises :class:`ScheduleError` when ``limit`` is under 2 (a rank holds a
    microbatch on both its stages) or no variant completes within it.
    """
    if p < 1 or m < 1 or limit < 2:
        raise ScheduleError(f"{name} needs num_ranks >= 1, n_microbatches >= 1 and a limit of at least 2 stage "
                            f"activations per rank (got num_ranks={p}, n_microbatches={m}, limit={limit})")
    best: Optional[tuple[float, int, float, Schedule]] = None
    failures = []
    for order, reserve, sequences in _variants(p, m):
        try:
            sched, key = _list_schedule(p, m, limit, reserve, order, sequences, costs, name)
        except ScheduleError as exc:
            failures.append(str(exc))
            continue
        if best is None or key < best[:3]:
            best = (*key, sched)
    if best is None:
        raise ScheduleError(f"{name} cannot be built for num_ranks={p}, n_microbatches={m} within {limit} stage "
                            f"activations per rank: {failures[0]}")
    return best[3]


#: Tie-breaking among actions that could start at the same time: input-grad passes first (the critical path, and
#: the way to the W that frees memory), second-stage forwards (microbatches already in flight on this rank) before
#: first-stage ones (new microbatches), W last; or the two I passes the other way round.
_ORDERS = (
    ((I, "hi"), (I, "lo"), (F, "hi"), (F, "lo"), (W, "")),
    ((I, "lo"), (I, "hi"), (F, "hi"), (F, "lo"), (W, "")),
)


def _variants(p: int, m: int):
    """(tie-breaking order, first-stage reserve, fixed F/I sequences or None) of each variant tried.

    The fixed orders need no reserve: the pattern admits a new microbatch only
    when an old one has left, and a rank that would exceed the limit stalls
    (that variant fails) rather than overrun it.
    """
    for order in _ORDERS:
        yield order, 1, None
    for shape in ("min", "half"):
        for delay in (0, 2):
            yield _ORDERS[0], 0, _pattern_order(p, m, shape, delay)


def _pattern_order(p: int, m: int, shape: str, delay: int) -> list[list[Step]]:
    """Per rank, the F and I passes in the order of a one-microbatch pattern repeated every 6 time steps.

    Times at unit cost per pass; microbatch j's passes come 6j later (a rank's
    F, F, I, I, W, W). "min": the critical path itself, down the V one stage
    per step and straight back up (activations live as short as possible);
    "half": forwards down the first stages at half speed and the second
    stages' backwards at half speed, which leaves slack for warm-up and drain.
    ``delay`` shifts the backwards later (V-Min needs it when 3 divides p,
    where the plain pattern puts an F and an I of one rank on the same step).
    """
    out = []
    for r in range(p):
        lo, hi = r, 2 * p - 1 - r
        if shape == "min":
            base = [(r, F, lo), (2 * p - 1 - r, F, hi), (2 * p + r + delay, I, hi), (4 * p - 1 - r + delay, I, lo)]
        else:
            base = [(2 * r, F, lo), (3 * p - 2 - r, F, hi), (3 * p - 1 + 2 * r + delay, I, hi),
                    (6 * p - 2 - r + delay, I, lo)]
        events = sorted((t + 6 * j, kind is F, j, kind, s) for j in range(m) for t, kind, s in base)
        out.append([(kind, s) for *_, kind, s in events])
    return out


def _list_schedule(p: int, m: int, limit: int, reserve: int, order, sequences: Optional[list[list[Step]]],
                   costs: Costs, name: str) -> tuple[Schedule, tuple[float, int, float]]:
    """One pass of list scheduling: repeatedly run the action that can start earliest on any rank.

    Returns the schedule and its (bubble rate rounded to 12 digits, peak stage
    activations, makespan) as :func:`.simulate` defines them. Each action
    starts when its rank is free and its input (or gradient) has arrived, the
    rule by which :func:`.simulate` replays a schedule, so the times here are
    the simulated ones and the variants need no replay
    (``tests/schedules/test_schedules_builtin.py`` compares the two).
    """
    placement = v_placement(p)
    n_stages = 2 * p
    ranks = [_VRank(r, n_stages - 1 - r, m, None if sequences is None else sequences[r]) for r in range(p)]
    ranks[0].input_at[0].update({j: 0.0 for j in range(m)})
    dur = {(s, k): costs.duration(Action(s, k, 0)) for s in range(n_stages) for k in (F, I, W)}
    # A rank's next choice only changes when it acts or a result is published to it: keep the choices in a heap
    # and drop entries whose rank has changed since (stale version), as the greedy zero-bubble scheduler does.
    version = [0] * p
    heap: list[tuple[float, int, int, int, ActionKind, int]] = []

    def refresh(r: int) -> None:
        version[r] += 1
        rank = ranks[r]
        opts = rank.options(limit, reserve)
        if not opts:
            return
        start = min(opts.values())
        for pos, (kind, which) in enumerate(order):
            stage = -1 if kind is W else (rank.hi if which == "hi" else rank.lo)
            if opts.get((kind, stage), INF) <= start:
                heapq.heappush(heap, (start, pos, r, version[r], kind, stage))
                return

    for r in range(p):
        refresh(r)
    while heap:
        start, _, r, ver, kind, stage = heapq.heappop(heap)
        if ver != version[r]:
            continue
        dest = _run(ranks, placement, r, kind, stage, start, dur, costs)
        refresh(r)
        if dest is not None and dest != r:
            refresh(dest)
    stuck = [r for r, rank in enumerate(ranks) if not rank.done]
    if stuck:
        raise ScheduleError(f"{name}: no rank can go on within {limit} stage activations per rank (num_ranks={p}, "
                            f"n_microbatches={m}; rank {stuck[0]} is full and waiting)")
    return Schedule([rank.actions for rank in ranks], placement, m, name), _measure(ranks)


def _measure(ranks: list[_VRank]) -> tuple[float, int, float]:
    """(bubble rate rounded to 12 digits, peak stage activations, makespan) of a finished list schedule."""
    per_rank = bubble_rates([rank.busy for rank in ranks],
                            [rank.free - rank.first if rank.actions else 0.0 for rank in ranks])
    bubble = sum(per_rank) / len(per_rank)
    makespan = max(rank.free for rank in ranks) - min(rank.first for rank in ranks)
    return round(bubble, 12), max(peak_live_activations(rank.actions) for rank in ranks), makespan


def _run(ranks: list[_VRank], placement: list[int], r: int, kind: ActionKind, stage: int, start: float,
         dur: dict, costs: Costs) -> Optional[int]:
    """Append one action to rank ``r`` and publish when its result reaches the stage that needs it.

    Returns the rank it was published to (None: nothing published, a W or the last stage's F's own gradient).
    """
    rank = ranks[r]
    if kind is F:
        j = rank.next_f[stage]
        rank.next_f[stage] += 1
        rank.live += 1
    elif kind is I:
        j = rank.next_i[stage]
        rank.next_i[stage] += 1
        rank.owed_w.append(Action(stage, W, j))
    else:
        action = rank.owed_w.popleft()
        stage, j = action.stage, action.microbatch
        rank.live -= 1
        rank.n_w += 1
    if not rank.actions:
        rank.first = start
    rank.actions.append(Action(stage, kind, j))
    rank.free = start + dur[(stage, kind)]
    rank.busy += rank.free - start  # as the simulator sums its spans
    last = len(placement) - 1
    if kind is F and stage < last:
        dest = placement[stage + 1]
        hop = costs.transfer(stage) if dest != r else 0.0
        ranks[dest].input_at[stage + 1][j] = rank.free + hop
        return dest
    if kind is F:
        rank.grad_at[stage][j] = rank.free
        return r
    if kind is I and stage > 0:
        dest = placement[stage - 1]
        hop = costs.transfer(stage) if dest != r else 0.0
        ranks[dest].grad_at[stage - 1][j] = rank.free + hop
        return dest
    return None

