"""Timed simulation of a schedule: makespan, bubble rate, peak live activations.

Choosing a schedule is a trade between idle time and memory, and both can be
known before any device runs: this module replays the per-rank action lists
under the cost model of docs/schedules.md ("Simulator"), the one the Zero Bubble paper
(Qi et al., ICLR 2024) uses for its bubble-rate table, so its numbers come out
exactly and the generators can be checked against closed forms.

The model: an F of stage s starts at max(rank free, end of the F of stage s-1
on that microbatch + c); a B or I of stage s starts at max(rank free, end of
the B/I of stage s+1 + c), or after the stage's own F on the last stage; a W
starts when its rank is free. c is charged only between stages on different
ranks. A B that is not split costs B+W, or ``Costs.whole`` where a measured
whole backward is known (the split is rarely free: I + W usually costs more than
the B it replaces, see docs/performance.md). SEND/RECV actions of a lowered schedule
take no time here: the runtime posts receives early, so only the transfer
time c, charged on the dependency, matters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence, Union

from pipeline_ext.schedules.inorder import run_in_order
from pipeline_ext.schedules.ir import Action, ActionKind, Schedule, ScheduleError, check_structure, dependencies, done_key

Cost = Union[float, Sequence[float]]


@dataclass(frozen=True)
class Costs:
    """Durations of F, of B (the input-grad half), of W and of one transfer.

    Each is a number or a per-stage sequence. A per-stage ``comm`` entry is the
    cost of any message leaving that stage (forward or backward).

    ``whole``: the duration of an unsplit backward (a B action), where it was
    measured; None charges a B ``b + w``, as if splitting the backward into I
    and W cost nothing. On real compute it does cost something (two engine
    calls instead of one, what I keeps for W read back, a recomputation
    shared between them), so a schedule that splits and one that does not are
    compared fairly only with ``whole`` set to the measured B.
    """

    f: Cost = 1.0
    b: Cost = 1.0
    w: Cost = 1.0
    comm: Cost = 0.0
    whole: Optional[Cost] = None

    @classmethod
    def parse(cls, text: str) -> "Costs":
        """``"f,b,w,c"`` as on the command line, e.g. ``"18.522,18.086,9.337,0.601"``."""
        try:
            values = [float(v) for v in text.split(",")]
        except ValueError:
            values = []
        if len(values) != 4:
            raise ScheduleError(f"costs must be four numbers f,b,w,c (got {text!r})")
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise ScheduleError(f"costs must be finite and non-negative (got {text!r})")
        return cls(*values)

    def per_stage_of(self, stages_per_rank: int) -> "Costs":
        """These costs, taken as one rank's share of the model, split over v stages per rank.

        Comparing a 1-stage-per-rank schedule with a v-stage one at equal model
        cost means each of the v stages costs 1/v (transfers keep their cost).
        """
        def split(value: Cost) -> Cost:
            if isinstance(value, (int, float)):
                return value / stages_per_rank
            return [x / stages_per_rank for x in value]

        return Costs(split(self.f), split(self.b), split(self.w), self.comm,
                     None if self.whole is None else split(self.whole))

    def _get(self, which: str, stage: int) -> float:
        value = getattr(self, which)
        if isinstance(value, (int, float)):
            out = float(value)
        else:
            if stage >= len(value):
                raise ScheduleError(f"costs.{which} has {len(value)} entries but the schedule has stage {stage}")
            out = float(value[stage])
        if not out >= 0:
            raise ScheduleError(f"costs.{which} for stage {stage} must be >= 0 (got {out})")
        return out

    def duration(self, action: Action) -> float:
        """Time an action occupies its rank (0 for SEND/RECV)."""
        s, kind = action.stage, action.kind
        if kind is ActionKind.F:
            return self._get("f", s)
        if kind is ActionKind.I:
            return self._get("b", s)
        if kind is ActionKind.W:
            return self._get("w", s)
        if kind is ActionKind.B:
            return self.backward(s)
        return 0.0

    def backward(self, stage: int) -> float:
        """The duration of an unsplit backward of ``stage``: ``whole`` where given, else ``b + w``."""
        if self.whole is None:
            return self._get("b", stage) + self._get("w", stage)
        return self._get("whole", stage)

    def transfer(self, from_stage: int) -> float:
        return self._get("comm", from_stage)


class Span(NamedTuple):
    """One executed compute action on the simulated timeline."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass
class SimResult:
    """What :func:`simulate` found; ``timeline`` is sorted by (rank, start)."""

    schedule: Schedule
    costs: Costs
    timeline: list[Span]
    makespan: float
    bubble_rate: float
    bubble_rate_per_rank: list[float]
    peak_activations: list[int]

    def spans_of(self, rank: int) -> list[Span]:
        return [s for s in self.timeline if s.rank == rank]

    def peak_bytes(self, activation_bytes: Cost) -> list[float]:
        """Most activation bytes alive at once on each rank.

        ``activation_bytes`` is what one microbatch's activations of a stage
        occupy: one number for every stage, or a sequence with one entry per
        stage (stages of different sizes, e.g. an embedding stage). With one
        number this is ``peak_activations`` times it; with a sequence the
        peak is taken over the rank's timeline of live activations, weighted.
        """
        n_stages = self.schedule.num_stages
        if isinstance(activation_bytes, (int, float)):
            sizes = [float(activation_bytes)] * n_stages
        else:
            sizes = [float(x) for x in activation_bytes]
            if len(sizes) != n_stages:
                raise ScheduleError(f"activation_bytes has {len(sizes)} entries but the schedule has {n_stages} stages")
        if not all(math.isfinite(x) and x >= 0 for x in sizes):
            raise ScheduleError(f"activation_bytes must be finite and non-negative (got {activation_bytes!r})")
        plain = self.schedule.compute_only()
        return [peak_live_activations(acts, sizes) for acts in plain.actions]


def simulate(schedule: Schedule, costs: Costs = Costs()) -> SimResult:
    """Replay ``schedule`` (lowered or not) under ``costs``.

    ``bubble_rate`` is the mean over ranks of (T - busy_r) / T, where T is the
    longest span of any rank from its first action's start to its last action's
    end and busy_r the compute time of rank r. When every rank does the same
    work, m(F+B+W), this is exactly (T - m(F+B+W)) / T; with
    non-uniform per-rank work it averages the idle fraction over ranks.
    ``bubble_rate_per_rank`` has the individual (T - busy_r) / T.

    ``peak_activations[r]`` counts stage-microbatch activations alive at once on
    rank r: an F makes one live, its B (or its W when the backward is split)
    frees it. Raises :class:`ScheduleError` if the schedule cannot run.
    """
    check_structure(schedule)
    plain = schedule.compute_only()
    stage_to_rank = plain.stage_to_rank
    n_stages = plain.num_stages
    end: dict[Action, float] = {}
    free = [0.0] * plain.num_ranks
    timeline: list[Span] = []

    def blocked_on(rank: int, action: Action):
        for dep in dependencies(action, n_stages):
            if dep not in end:
                return dep
        return None

    def run(rank: int, action: Action) -> None:
        ready = 0.0
        for dep in dependencies(action, n_stages):
            hop = costs.transfer(dep.stage) if stage_to_rank[dep.stage] != rank else 0.0
            ready = max(ready, end[dep] + hop)
        start = max(free[rank], ready)
        free[rank] = start + costs.duration(action)
        end[done_key(action)] = free[rank]
        timeline.append(Span(rank, action, start, free[rank]))

    run_in_order(plain.actions, blocked_on, run, f"schedule {plain.name!r} cannot run")
    timeline.sort(key=lambda s: (s.rank, s.start))
    spans = [[s for s in timeline if s.rank == r] for r in range(plain.num_ranks)]
    per_rank = bubble_rates([sum(s.end - s.start for s in ss) for ss in spans],
                            [ss[-1].end - ss[0].start if ss else 0.0 for ss in spans])
    makespan = max((s.end for s in timeline), default=0.0) - min((s.start for s in timeline), default=0.0)
    return SimResult(
        schedule=schedule,
        costs=costs,
        timeline=timeline,
        makespan=makespan,
        bubble_rate=sum(per_rank) / len(per_rank) if per_rank else 0.0,
        bubble_rate_per_rank=per_rank,
        peak_activations=[peak_live_activations(acts) for acts in plain.actions],
    )


def bubble_rates(busy: Sequence[float], lengths: Sequence[float]) -> list[float]:
    """Per rank, (T - busy_r) / T, T the longest of the ranks' ``lengths`` (first start to last end)."""
    longest = max(lengths, default=0.0)
    return [(longest - b) / longest if longest > 0 else 0.0 for b in busy]


def peak_live_activations(actions: Sequence[Action], sizes: Optional[Sequence[float]] = None):
    """Most stage-microbatch activations alive at once along one rank's list (weighted by ``sizes[stage]`` if given)."""
    live = peak = 0
    for action in actions:
        size = 1 if sizes is None else sizes[action.stage]
        if action.kind is ActionKind.F:
            live += size
            peak = max(peak, live)
        elif action.kind in (ActionKind.B, ActionKind.W):
            live -= size
    return peak
