"""Pick a schedule for a memory budget: the fastest simulated schedule whose activations fit on every rank.

Users choose a schedule by what fits in their device's memory, then by speed.
Both are known before anything runs: the simulator replays each candidate
under the given costs and counts the activations each rank holds at its peak.

Memory is counted in *rank-microbatch units*: the activations one microbatch
leaves on a rank that holds a 1/p share of the model (what 1F1B's first rank
holds p of, GPipe's m). A schedule with v stages per rank holds stage-sized
activations, each 1/v of a unit, so its peak count is divided by v. Costs are
one rank's share too (``Costs.per_stage_of`` splits them over v stages), so
every candidate is timed on the same model.

A budget in bytes (``budget_bytes``) needs ``activation_bytes``, the bytes
one rank-microbatch unit occupies (one microbatch's activations on a 1/p
share of the model); the budget is then ``budget_bytes / activation_bytes``
units and the table and errors speak bytes.

Candidates: every built-in at its default stages per rank, and the greedy
zero-bubble schedule (``auto``) with the budget as its activation limit. A
candidate that cannot be built for (p, m) is listed with the constraint it
breaks; one over the budget with its peak.

The zero-bubble schedules count on each stage's backward splitting into I
and W. Where it cannot (``runtime/split/obstacles.py``: a reentrant
checkpoint, a ``torch.compile``'d region, an unknown once-only hook or custom
Function; ``pe.runtime.split_check`` asks a stage, a run's ``split_report``
says what happened), I runs the whole backward and W nothing. ``split`` tells
``select`` so: per rank share of the model (the stages of a
one-stage-per-rank schedule), None where the split holds, else the reason; a
stage of a schedule with v stages per rank takes the entry of the share it
lies in. Such stages are simulated with I costing b + w and W nothing, and
each candidate that splits says where its split holds and where it falls
back (``Candidate.split``; the table lists the reasons).

Splitting is not free. Two engine calls instead of one, what I keeps for W
read back, under checkpointing a recomputation that both halves wait on: on
real compute I + W often costs more than the whole backward B it replaces
(docs/performance.md measures it). With ``Costs.whole`` set to the measured
B, schedules that run B (1F1B, interleaved 1F1B, ...) are simulated at it and
those that split at the measured I and W, so where the split costs more than
the bubble it removes a schedule without it wins, and ``Selection.reason``
says so with the numbers: I + W against B, and the two schedules' times.
Measured costs come from traces (``runtime.trace.measure_costs``): a
zero-bubble run gives F, I, W, a 1F1B run gives B;
``dataclasses.replace(split_costs, whole=unsplit_costs.b)`` joins them.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence, Union

from pipeline_ext.schedules.auto import auto
from pipeline_ext.schedules.builtin import available, build, default_stages_per_rank
from pipeline_ext.schedules.ir import ActionKind, Schedule, ScheduleError
from pipeline_ext.schedules.simulate import Costs, simulate

__all__ = ["Candidate", "Selection", "select"]


@dataclass(frozen=True)
class Candidate:
    """One schedule considered: its simulated time and memory, and whether it was kept."""

    name: str
    stages_per_rank: int
    makespan: float = math.inf
    bubble_rate: float = math.nan
    peak_units: float = math.inf  # most rank-microbatch units of activations held at once, over the ranks
    verdict: str = ""  # "fits", or why it was rejected
    peak_bytes: Optional[float] = None  # peak_units times activation_bytes, when select was given it
    #: the I/W split of a candidate that runs I and W, when select was told about it (``split``): "held",
    #: or "falls back on stages [...]"; "" for a candidate without I/W actions or when nothing was told
    split: str = ""
    #: whether the candidate splits every backward into I and W (no whole B; DualPipeV runs B in its
    #: overlapped middle and splits only at its ends, so it counts with the schedules that run B)
    splits: bool = False

    @property
    def fits(self) -> bool:
        return self.verdict == "fits"


@dataclass
class Selection:
    """The chosen schedule and every candidate, fastest first."""

    schedule: Schedule
    chosen: Candidate
    candidates: list[Candidate] = field(default_factory=list)
    #: why the I/W split falls back, per rank share of the model (as given to ``select``; empty: not told)
    split_reasons: dict[int, str] = field(default_factory=dict)
    #: why the chosen one, in words: the fastest that fits, and where ``Costs.whole`` was given, whether the I/W
    #: split pays for itself (I + W against B, the fastest schedule with the split and without it)
    reason: str = ""

    def table(self) -> str:
        """The candidates as a text table, the chosen one marked with ``*`` (with a bytes column if bytes were given,
        an I/W split column and its reasons if ``split`` was)."""
        in_bytes = self.chosen.peak_bytes is not None
        told = any(c.split for c in self.candidates)
        lines = [f"  {'schedule':<18}{'v':>2} {'makespan':>10} {'bubble':>8} {'peak units':>11}"
                 + (f" {'peak bytes':>11}" if in_bytes else "") + (f" {'I/W split':<28}" if told else "")
                 + "  verdict"]
        for c in self.candidates:
            mark = "*" if c == self.chosen else " "
            timed = math.isfinite(c.makespan)
            peak_bytes = f" {(format_bytes(c.peak_bytes) if timed and c.peak_bytes is not None else '-'):>11}"
            lines.append(f"{mark} {c.name:<18}{c.stages_per_rank:>2} "
                         f"{(f'{c.makespan:.2f}' if timed else '-'):>10} "
                         f"{(f'{c.bubble_rate:.3f}' if timed else '-'):>8} "
                         f"{(f'{c.peak_units:.2f}' if timed else '-'):>11}"
                         + (peak_bytes if in_bytes else "") + (f" {c.split or '-':<28}" if told else "")
                         + f"  {c.verdict}")
        for share, why in sorted(self.split_reasons.items()):
            lines.append(f"  I/W split falls back on rank share {share}: {why}")
        if self.reason:
            lines.append(f"  chosen: {self.reason}")
        return "\n".join(lines)


def format_bytes(n: float) -> str:
    """``n`` bytes with a binary unit: ``512 B``, ``1.5 KiB``, ``2 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.4g} {unit}"
        n /= 1024
    return f"{n:.4g} TiB"  # pragma: no cover - the loop returns


def _split_shares(split: Union[None, str, Sequence[Optional[str]]], p: int) -> list[Optional[str]]:
    """``split`` as one entry per rank share: None where the I/W split holds, else why it falls back."""
    if split is None or isinstance(split, str):
        return [split] * p
    shares = list(split)
    if len(shares) != p or not all(x is None or isinstance(x, str) for x in shares):
        raise ScheduleError(f"split must be None, a reason, or {p} entries (one per rank share of the model, None "
                            f"where the I/W split holds), got {split!r}")
    return shares


def _with_fallbacks(costs: Costs, n: int, falls_back: list[bool]) -> Costs:
    """``costs`` for ``n`` stages with W folded into I where the stage's split falls back."""
    if not any(falls_back):
        return costs
    b = [costs.backward(s) if falls_back[s] else costs._get("b", s) for s in range(n)]
    w = [0.0 if falls_back[s] else costs._get("w", s) for s in range(n)]
    return replace(costs, b=b, w=w)


def _by_share(costs: Costs, p: int, n: int) -> Costs:
    """Per-rank-share cost lists (p entries, as measured on a one-stage-per-rank run) spread over ``n`` stages:
    stage s covers the part of the model in share ``s * p // n``. Numbers and lists of any other length pass as
    they are."""
    def spread(value):
        if isinstance(value, (int, float)) or value is None or len(value) != p:
            return value
        return [value[s * p // n] for s in range(n)]

    return replace(costs, f=spread(costs.f), b=spread(costs.b), w=spread(costs.w), comm=spread(costs.comm),
                   whole=spread(costs.whole))


def _measure(name: str, schedule: Schedule, v: int, costs: Costs, budget: Optional[float],
             unit_bytes: Optional[float], shares: Optional[list[Optional[str]]] = None) -> Candidate:
    if v > 1:
        costs = _by_share(costs, schedule.num_ranks, schedule.num_stages).per_stage_of(v)
    note = ""
    kinds = {a.kind for acts in schedule.actions for a in acts}
    splits = ActionKind.I in kinds and ActionKind.B not in kinds
    if shares is not None:
        n, p = schedule.num_stages, len(shares)
        falls_back = [shares[s * p // n] is not None for s in range(n)]
        costs = _with_fallbacks(costs, n, falls_back)
        if ActionKind.I in kinds:
            back = [s for s in range(n) if falls_back[s]]
            note = "held" if not back else f"falls back on stages {back}" if len(back) < n else "falls back everywhere"
    result = simulate(schedule, costs)
    peak = max(result.peak_activations) / v
    peak_bytes = None if unit_bytes is None else max(result.peak_bytes(unit_bytes / v))
    over = budget is not None and peak > budget + 1e-9
    if not over:
        verdict = "fits"
    elif peak_bytes is not None:
        verdict = f"over budget: peak {format_bytes(peak_bytes)} > {format_bytes(budget * unit_bytes)}"
    else:
        verdict = f"over budget: peak {peak:g} > {budget:g} units"
    return Candidate(name, v, result.makespan, result.bubble_rate, peak, verdict, peak_bytes, note, splits)


def _with_parameters(c: Candidate, schedule: Schedule, param_bytes: float, max_active: Optional[int],
                     budget_bytes: Optional[float]) -> Candidate:
    """``c`` with its peak plus the most FSDP bytes its rank holds at once (parameters gathered within the budget
    and unsharded gradients, each stage ``param_bytes / v``), and its verdict against ``budget_bytes``."""
    from pipeline_ext.schedules.fsdp import plan_fsdp

    v = c.stages_per_rank
    try:
        planned = plan_fsdp(schedule, max_active_stages=None if max_active is None else min(max_active, v))
    except ScheduleError as exc:
        return dataclasses.replace(c, verdict=f"cannot run under max_active_stages={max_active}: {exc}")
    held = max(simulate(planned, Costs(param_bytes=param_bytes / v)).peak_unsharded_bytes)
    peak = (c.peak_bytes or 0.0) + held
    verdict = c.verdict
    if budget_bytes is not None and (verdict == "fits" or verdict.startswith("over budget")):
        over = peak > budget_bytes * (1 + 1e-12)
        verdict = (f"over budget: peak {format_bytes(peak)} (parameters and gradients {format_bytes(held)}) > "
                   f"{format_bytes(budget_bytes)}") if over else "fits"
    return dataclasses.replace(c, peak_bytes=peak, verdict=verdict)


def _reason(chosen: Candidate, candidates: Sequence[Candidate], costs: Costs, p: int) -> str:
    """Why ``chosen``: the fastest that fits, and with ``costs.whole``, whether the I/W split pays for itself."""
    text = f"{chosen.name} is the fastest simulated schedule that fits ({chosen.makespan:.4g})"
    if costs.whole is None:
        return text
    split = sum(costs._get("b", s) + costs._get("w", s) for s in range(p)) / p  # per rank share, averaged
    whole = sum(costs.backward(s) for s in range(p)) / p
    over = split / whole - 1 if whole > 0 else 0.0
    said = f"I + W = {split:.4g} against a whole backward B = {whole:.4g} per rank share ({over:+.0%})"
    other = next((c for c in candidates if c.fits and c.splits != chosen.splits), None)
    if other is None:
        return f"{text}, {said}; no schedule {'without' if chosen.splits else 'with'} the I/W split fits"
    if chosen.splits:
        return (f"{text}: the I/W split pays for itself, {said}, less than the bubble it removes "
                f"(the fastest schedule without it, {other.name}, takes {other.makespan:.4g})")
    return (f"{text}: the I/W split costs more than the bubble it removes, {said} (the fastest schedule "
            f"with it, {other.name}, takes {other.makespan:.4g})")


def select(num_ranks: int, n_microbatches: int, budget: Optional[float] = None,
           costs: Costs = Costs(), *, budget_bytes: Optional[float] = None,
           activation_bytes: Optional[float] = None,
           split: Union[None, str, Sequence[Optional[str]]] = None,
           param_bytes: Optional[float] = None, max_active_stages: Optional[int] = None) -> Selection:
    """The fastest schedule for ``num_ranks`` ranks and ``n_microbatches`` whose peak fits the budget on every rank.

    ``budget`` is in rank-microbatch units (module doc); or give
    ``budget_bytes`` and ``activation_bytes`` (the bytes of one unit), and
    every candidate's ``peak_bytes`` is filled in (``activation_bytes``
    alone adds the bytes to the table without a budget). No budget: no limit.
    ``split``: whether each rank share's I/W split holds (module doc; None: assume it does, and say nothing).
    ``costs.whole``: the measured whole backward B, against which the split's I + W is weighed (module doc).
    ``param_bytes`` (with ``activation_bytes``): the rank's share of the model is FSDP-sharded and P =
    ``param_bytes`` when gathered; each candidate's ``peak_bytes`` then adds what its stages hold at once under
    ``max_active_stages`` (None: all of a rank's stages), gathered parameters and unsharded gradients, simulated on
    the schedule with its UNSHARD / RESHARD / REDUCE_GRAD placed (``fsdp.plan_fsdp``); a schedule that cannot run
    under the budget (DualPipeV's pairs need 2) is rejected saying so.
    Ties in time go to the smaller bubble, then the smaller peak. Raises ``ScheduleError`` naming the
    smallest peak any candidate needs when none fits.
    """
    def positive(x) -> bool:
        return isinstance(x, (int, float)) and x > 0 and math.isfinite(x)

    if budget_bytes is not None:
        if budget is not None:
            raise ScheduleError("give the budget in units (budget) or in bytes (budget_bytes), not both")
        if activation_bytes is None:
            raise ScheduleError("budget_bytes needs activation_bytes, the bytes one rank-microbatch unit occupies")
        if not positive(budget_bytes):
            raise ScheduleError(f"budget_bytes must be a positive number of bytes, got {budget_bytes!r}")
    if activation_bytes is not None and not positive(activation_bytes):
        raise ScheduleError(f"activation_bytes must be a positive number of bytes, got {activation_bytes!r}")
    if budget is not None and not positive(budget):
        raise ScheduleError(f"budget must be a positive number of rank-microbatch units, got {budget!r}")
    if budget_bytes is not None:
        budget = budget_bytes / activation_bytes
    p, m = num_ranks, n_microbatches
    shares = None if split is None else _split_shares(split, p)
    candidates: list[Candidate] = []
    schedules: dict[tuple[str, int], Schedule] = {}
    for name in available():
        v = default_stages_per_rank(name)
        try:
            schedule = build(name, p, m, stages_per_rank=v)
        except ScheduleError as exc:
            candidates.append(Candidate(name, v, verdict=f"cannot build: {exc}"))
            continue
        schedules[(name, v)] = schedule
        candidates.append(_measure(name, schedule, v, costs, budget, activation_bytes, shares))
    limit = None if budget is None else math.floor(budget + 1e-9)
    if limit is None or limit >= 1:
        greedy_costs = costs if shares is None else _with_fallbacks(costs, p, [x is not None for x in shares])
        greedy = auto(p, m, greedy_costs, max_activations=limit)
        schedules[("auto", 1)] = greedy
        candidates.append(_measure("auto", greedy, 1, costs, budget, activation_bytes, shares))
    if param_bytes is not None:
        if activation_bytes is None or not positive(param_bytes):
            raise ScheduleError("param_bytes (a positive number of bytes) goes with activation_bytes: the peak "
                                "adds parameters and gradients to activations")
        candidates = [_with_parameters(c, schedules[(c.name, c.stages_per_rank)], param_bytes, max_active_stages,
                                       budget_bytes)
                      if (c.name, c.stages_per_rank) in schedules and c.peak_bytes is not None else c
                      for c in candidates]
    candidates.sort(key=lambda c: (not c.fits, c.makespan, c.bubble_rate, c.peak_units, c.name))
    if not candidates or not candidates[0].fits:
        smallest = min((c.peak_units for c in candidates if math.isfinite(c.peak_units)), default=math.inf)
        if budget_bytes is not None:
            raise ScheduleError(f"no schedule for {p} ranks and {m} microbatches fits a budget of "
                                f"{format_bytes(budget_bytes)}; the smallest peak is "
                                f"{format_bytes(smallest * activation_bytes)} ({smallest:g} units of "
                                f"{format_bytes(activation_bytes)})")
        raise ScheduleError(f"no schedule for {p} ranks and {m} microbatches fits a budget of {budget:g} units; "
                            f"the smallest peak is {smallest:g} units")
    chosen = candidates[0]
    reasons = {r: why for r, why in enumerate(shares or []) if why is not None}
    return Selection(schedules[(chosen.name, chosen.stages_per_rank)], chosen, candidates, reasons,
                     _reason(chosen, candidates, costs, p))
