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

FSDP actions (:mod:`.fsdp`) run on one communication stream per rank, in
the order the rank issues them, overlapping compute: an UNSHARD issued when
the rank reaches it (its previous compute action ended) starts when the
stream is free and takes ``Costs.all_gather``; the next compute action of
that stage waits for it. A REDUCE_GRAD likewise takes ``Costs.reduce_scatter``
and is waited for at the step's end, so a rank's step lasts until its
stream is done. A RESHARD takes no time. Memory: an active stage holds its
unsharded parameters (``Costs.param_bytes``) from its UNSHARD's issue to its
RESHARD (once a pending all-gather is done), and its unsharded gradients
(``Costs.grad_bytes``) from the start of its first B or W to the end of its
REDUCE_GRAD; ``SimResult.peak_unsharded_bytes`` is the most a rank holds at
once. A schedule without FSDP actions simulates as before.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
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
    #: FSDP (a schedule with UNSHARD / REDUCE_GRAD actions): the all-gather and reduce-scatter time of a stage,
    #: where known; None derives it from the bytes and ``fsdp_bandwidth`` (0 without them)
    unshard: Optional[Cost] = None
    reduce_grad: Optional[Cost] = None
    #: a stage's parameters unsharded (what an UNSHARD makes the rank hold), and its unsharded gradients (None:
    #: as many as its parameters; a reduce dtype wider than the parameters' holds more)
    param_bytes: Optional[Cost] = None
    grad_bytes: Optional[Cost] = None
    #: bytes per cost unit an all-gather or a reduce-scatter moves (the effective bandwidth of the stage's
    #: data-parallel collectives), for the times not given
    fsdp_bandwidth: Optional[float] = None
    #: sequence pieces (``schedules/pieces.py``: unit u of the schedule is piece u % K of a sequence): piece k's
    #: F, B, I and W cost ``pieces[k]`` times their stage's cost above (K = len(pieces); ``piece_costs`` derives
    #: them from the pieces' lengths, ``runtime/trace.measure_costs`` from traced steps). None: every unit alike
    pieces: Optional[Sequence[float]] = None

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

        def maybe(value: Optional[Cost]) -> Optional[Cost]:
            return None if value is None else split(value)

        return replace(self, f=split(self.f), b=split(self.b), w=split(self.w), whole=maybe(self.whole),
                       unshard=maybe(self.unshard), reduce_grad=maybe(self.reduce_grad),
                       param_bytes=maybe(self.param_bytes), grad_bytes=maybe(self.grad_bytes))

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
        """Time an action occupies its rank (0 for SEND/RECV); a piece's its stage's times its weight."""
        s, kind = action.stage, action.kind
        if kind is ActionKind.F:
            cost = self._get("f", s)
        elif kind is ActionKind.I:
            cost = self._get("b", s)
        elif kind is ActionKind.W:
            cost = self._get("w", s)
        elif kind is ActionKind.B:
            cost = self.backward(s)
        else:
            return 0.0
        return cost if self.pieces is None else cost * self.piece_weight(action.microbatch)

    def piece_weight(self, unit: int) -> float:
        """The cost weight of ``unit``'s piece (1 without ``pieces``)."""
        if self.pieces is None:
            return 1.0
        if not len(self.pieces):
            raise ScheduleError("costs.pieces is empty: give one weight per piece, or None")
        weight = float(self.pieces[unit % len(self.pieces)])
        if not (math.isfinite(weight) and weight >= 0):
            raise ScheduleError(f"costs.pieces must be finite and non-negative (got {list(self.pieces)!r})")
        return weight

    def backward(self, stage: int) -> float:
        """The duration of an unsplit backward of ``stage``: ``whole`` where given, else ``b + w``."""
        if self.whole is None:
            return self._get("b", stage) + self._get("w", stage)
        return self._get("whole", stage)

    def transfer(self, from_stage: int) -> float:
        return self._get("comm", from_stage)

    def params(self, stage: int) -> float:
        """Unsharded parameter bytes of ``stage`` (0 when ``param_bytes`` is not given)."""
        return 0.0 if self.param_bytes is None else self._get("param_bytes", stage)

    def grads(self, stage: int) -> float:
        """Unsharded gradient bytes of ``stage``: ``grad_bytes``, else its parameter bytes."""
        return self.params(stage) if self.grad_bytes is None else self._get("grad_bytes", stage)

    def all_gather(self, stage: int) -> float:
        """The duration of ``stage``'s all-gather (an UNSHARD): ``unshard``, else its bytes over the bandwidth."""
        if self.unshard is not None:
            return self._get("unshard", stage)
        return self._over_bandwidth(self.params(stage))

    def reduce_scatter(self, stage: int) -> float:
        """The duration of ``stage``'s reduce-scatter (a REDUCE_GRAD): ``reduce_grad``, else bytes over bandwidth."""
        if self.reduce_grad is not None:
            return self._get("reduce_grad", stage)
        return self._over_bandwidth(self.grads(stage))

    def _over_bandwidth(self, nbytes: float) -> float:
        if self.fsdp_bandwidth is None or nbytes == 0:
            return 0.0
        if not (math.isfinite(self.fsdp_bandwidth) and self.fsdp_bandwidth > 0):
            raise ScheduleError(f"costs.fsdp_bandwidth must be a positive number (got {self.fsdp_bandwidth!r})")
        return nbytes / self.fsdp_bandwidth


class Span(NamedTuple):
    """One executed action on the simulated timeline: a compute action, or an FSDP action on its stream."""

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
    #: FSDP: every UNSHARD (its all-gather), REDUCE_GRAD (its reduce-scatter) and RESHARD (when it frees: no
    #: duration) on the rank's communication stream, sorted by (rank, start); empty without FSDP actions
    fsdp_timeline: list[Span] = field(default_factory=list)
    #: per rank: the most bytes of unsharded parameters and gradients held at once, and of parameters alone
    #: (0 without FSDP actions: parameters placed by no action are not modelled)
    peak_unsharded_bytes: list[float] = field(default_factory=list)
    peak_unsharded_params: list[float] = field(default_factory=list)
    #: per rank: the all-gathers (UNSHARDs) of the step
    all_gathers: list[int] = field(default_factory=list)

    def spans_of(self, rank: int) -> list[Span]:
        return [s for s in self.timeline if s.rank == rank]

    def peak_bytes(self, activation_bytes: Cost, pieces: Optional[Sequence[float]] = None) -> list[float]:
        """Most activation bytes alive at once on each rank.

        ``activation_bytes`` is what one microbatch's activations of a stage
        occupy: one number for every stage, or a sequence with one entry per
        stage (stages of different sizes, e.g. an embedding stage). With one
        number this is ``peak_activations`` times it; with a sequence the
        peak is taken over the rank's timeline of live activations, weighted.
        ``pieces``: a schedule over sequence pieces, each piece's activations
        relative to the mean piece's (``schedules.pieces.piece_sizes``), the
        mean piece's being ``activation_bytes``.
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
        if pieces is not None and not (len(pieces) and all(math.isfinite(x) and x >= 0 for x in pieces)):
            raise ScheduleError(f"pieces must be finite, non-negative piece sizes (got {pieces!r})")
        plain = self.schedule.compute_only()
        return [peak_live_activations(acts, sizes, pieces) for acts in plain.actions]


def simulate(schedule: Schedule, costs: Costs = Costs()) -> SimResult:
    """Replay ``schedule`` (lowered or not) under ``costs``.

    ``bubble_rate`` is the mean over ranks of (T - busy_r) / T, where T is the
    longest span of any rank from its first action's start to its last action's
    end and busy_r the compute time of rank r. When every rank does the same
    work, m(F+B+W), this is exactly (T - m(F+B+W)) / T; with
    non-uniform per-rank work it averages the idle fraction over ranks.
    ``bubble_rate_per_rank`` has the individual (T - busy_r) / T. With FSDP
    actions a rank's span also covers its all-gathers and reduce-scatters
    that take time (an exposed all-gather is step time).

    ``peak_activations[r]`` counts stage-microbatch activations alive at once on
    rank r: an F makes one live, its B (or its W when the backward is split)
    frees it. FSDP's timeline, memory peaks and all-gather counts are in
    ``fsdp_timeline``, ``peak_unsharded_bytes``, ``peak_unsharded_params`` and
    ``all_gathers`` (module doc). Raises :class:`ScheduleError` if the schedule
    cannot run.
    """
    check_structure(schedule)
    if schedule.pieces > 1 and costs.pieces is not None and len(costs.pieces) != schedule.pieces:
        raise ScheduleError(f"schedule {schedule.name!r} is over seq_chunks={schedule.pieces} pieces, but costs.pieces "
                            f"has {len(costs.pieces)} weights: give one per piece")
    plain = schedule.compute_only()
    stage_to_rank = plain.stage_to_rank
    n_stages, n_ranks = plain.num_stages, plain.num_ranks
    rows = [[a for a in acts if not a.is_comm] for acts in schedule.actions] if schedule.has_fsdp else plain.actions
    end: dict[Action, float] = {}
    free = [0.0] * n_ranks
    timeline: list[Span] = []
    fsdp = _FsdpStreams(costs, n_ranks, schedule.has_fsdp)

    def blocked_on(rank: int, action: Action):
        if action.is_fsdp:
            return None
        for dep in dependencies(action, n_stages):
            if dep not in end:
                return dep
        return None

    def run(rank: int, action: Action) -> None:
        if action.is_fsdp:
            fsdp.issue(rank, action, free[rank])
            return
        ready = fsdp.gathered(action.stage)
        for dep in dependencies(action, n_stages):
            hop = costs.transfer(dep.stage) if stage_to_rank[dep.stage] != rank else 0.0
            ready = max(ready, end[dep] + hop)
        start = max(free[rank], ready)
        free[rank] = start + costs.duration(action)
        end[done_key(action)] = free[rank]
        timeline.append(Span(rank, action, start, free[rank]))
        fsdp.computed(rank, action, start)

    run_in_order(rows, blocked_on, run, f"schedule {plain.name!r} cannot run")
    timeline.sort(key=lambda s: (s.rank, s.start))
    fsdp.timeline.sort(key=lambda s: (s.rank, s.start))
    # the rank's span: its compute, and the FSDP collectives that take time (zero-time ones change nothing)
    spans = [[s for s in timeline + fsdp.timeline if s.rank == r and (s.end > s.start or s.action.is_compute)]
             for r in range(n_ranks)]
    busy = [sum(s.end - s.start for s in timeline if s.rank == r) for r in range(n_ranks)]
    lengths = [max(s.end for s in ss) - min(s.start for s in ss) if ss else 0.0 for ss in spans]
    per_rank = bubble_rates(busy, lengths)
    every = [s for ss in spans for s in ss]
    makespan = max((s.end for s in every), default=0.0) - min((s.start for s in every), default=0.0)
    return SimResult(
        schedule=schedule,
        costs=costs,
        timeline=timeline,
        makespan=makespan,
        bubble_rate=sum(per_rank) / len(per_rank) if per_rank else 0.0,
        bubble_rate_per_rank=per_rank,
        peak_activations=[peak_live_activations(acts) for acts in plain.actions],
        fsdp_timeline=fsdp.timeline,
        peak_unsharded_bytes=[fsdp.peak(r) for r in range(n_ranks)],
        peak_unsharded_params=[fsdp.peak(r, params_only=True) for r in range(n_ranks)],
        all_gathers=fsdp.all_gathers,
    )


class _FsdpStreams:
    """Each rank's FSDP communication stream and the unsharded bytes it makes the rank hold (module doc)."""

    def __init__(self, costs: Costs, n_ranks: int, placed: bool) -> None:
        self.costs = costs
        self.placed = placed  # whether the schedule places parameters: else no bytes are modelled
        self.stream = [0.0] * n_ranks  # when each rank's stream is free
        self.pending: dict[int, float] = {}  # stage -> end of its latest all-gather
        self.grads_held: set[int] = set()
        self.timeline: list[Span] = []
        self.all_gathers = [0] * n_ranks
        # per rank: (time, order, bytes of parameters, bytes of gradients), allocations positive
        self.events: list[list[tuple[float, int, float, float]]] = [[] for _ in range(n_ranks)]

    def _collective(self, rank: int, action: Action, issued: float, duration: float) -> float:
        start = max(issued, self.stream[rank])
        self.stream[rank] = start + duration
        self.timeline.append(Span(rank, action, start, self.stream[rank]))
        return self.stream[rank]

    def _hold(self, rank: int, when: float, params: float = 0.0, grads: float = 0.0) -> None:
        self.events[rank].append((when, len(self.events[rank]), params, grads))

    def issue(self, rank: int, action: Action, issued: float) -> None:
        """The rank reaches an FSDP action at ``issued`` (its previous compute action's end)."""
        s, kind = action.stage, action.kind
        if kind is ActionKind.UNSHARD:
            self.all_gathers[rank] += 1
            self._hold(rank, issued, params=self.costs.params(s))
            self.pending[s] = self._collective(rank, action, issued, self.costs.all_gather(s))
        elif kind is ActionKind.RESHARD:
            when = max(issued, self.pending.pop(s, 0.0))
            self.timeline.append(Span(rank, action, when, when))
            self._hold(rank, when, params=-self.costs.params(s))
        else:
            done = self._collective(rank, action, issued, self.costs.reduce_scatter(s))
            if s in self.grads_held:
                self.grads_held.discard(s)
                self._hold(rank, done, grads=-self.costs.grads(s))

    def gathered(self, stage: int) -> float:
        """When the stage's parameters are gathered (0: no all-gather pending)."""
        return self.pending.get(stage, 0.0)

    def computed(self, rank: int, action: Action, start: float) -> None:
        """A compute action started: the stage's first gradient write allocates its unsharded gradients."""
        if self.placed and action.kind in (ActionKind.B, ActionKind.W) and action.stage not in self.grads_held:
            self.grads_held.add(action.stage)
            self._hold(rank, start, grads=self.costs.grads(action.stage))

    def peak(self, rank: int, params_only: bool = False) -> float:
        """The most bytes held at once; events at one instant in the order the rank issued them."""
        held = peak = 0.0
        for _, _, params, grads in sorted(self.events[rank]):
            held += params + (0.0 if params_only else grads)
            peak = max(peak, held)
        return peak


def bubble_rates(busy: Sequence[float], lengths: Sequence[float]) -> list[float]:
    """Per rank, (T - busy_r) / T, T the longest of the ranks' ``lengths`` (first start to last end)."""
    longest = max(lengths, default=0.0)
    return [(longest - b) / longest if longest > 0 else 0.0 for b in busy]


def peak_live_activations(actions: Sequence[Action], sizes: Optional[Sequence[float]] = None,
                          pieces: Optional[Sequence[float]] = None):
    """Most stage-microbatch activations alive at once along one rank's list (weighted by ``sizes[stage]`` and,
    over sequence pieces, by ``pieces[unit % K]`` if given)."""
    live = peak = 0
    for action in actions:
        size = 1 if sizes is None else sizes[action.stage]
        if pieces is not None:
            size *= pieces[action.microbatch % len(pieces)]
        if action.kind is ActionKind.F:
            live += size
            peak = max(peak, live)
        elif action.kind in (ActionKind.B, ActionKind.W):
            live -= size
    return peak
