"""When an FSDP-sharded stage's parameters are gathered and freed: UNSHARD, RESHARD, REDUCE_GRAD placed in a schedule.

At scale each pipeline stage is sharded over its data-parallel group (FSDP2's
``fully_shard``), and what decides memory and speed is when a rank all-gathers
a stage's parameters, frees them, and reduce-scatters its gradients. A
pipeline rank holds several stages (interleaved, V), and a schedule visits
them in an order known in advance, so the placement is data about one step,
written into the rank's list like torch.distributed.pipelining writes it:

- ``sUNSHARD`` issues stage s's all-gather; it is asynchronous, and the first
  compute action of s after it waits for it;
- ``sRESHARD`` frees s's gathered parameters (once a pending all-gather of s
  is done); the stage's unsharded gradients survive it;
- ``sREDUCE_GRAD`` reduce-scatters s's gradients of the step and frees them:
  once per step, after the stage's last gradient write on the rank (B or W;
  I writes none).

A stage is *active* from its UNSHARD to its RESHARD, its all-gather in flight
included (its memory is allocated when the all-gather is issued). A budget
bounds the active stages of a rank at every point of its list: at most
``max_active_stages`` of them, or at most ``max_unsharded_bytes`` of their
parameters (``stage_bytes`` per stage).

:func:`plan_fsdp` places the actions. Compute actions run one *unit* at a time
(an overlapped pair, ``Schedule.overlapped``, is one unit that needs both its
stages); when a unit needs a stage that is not active and the budget is full,
the active stage whose next use is furthest away is resharded (Belady's rule:
with stages of equal size it gathers the fewest times any placement can; with
a byte budget it is a heuristic). A stage is resharded right after its last
use of the step, which is the REDUCE_GRAD of a stage with a backward, so the
step ends with every stage sharded (the optimizer steps on shards, and the
next step starts from the same state). ``prefetch`` moves each unit's
RESHARD/UNSHARD decisions one compute unit earlier when the budget has room
for it then (and the stage to free is not used by that unit), so the
all-gather overlaps the compute before it; the decisions themselves, and so
the number of all-gathers, are the same either way.

Positions in a lowered list: the actions that go between two compute units
sit right after the first unit and the SENDs that follow it, before the
RECVs of the next (the all-gather is issued before the rank blocks on a
message; a send, on another rank's critical path, leaves first). Lowering an
unlowered plan puts them at the same places, so ``plan_fsdp(lower(s)) ==
lower(plan_fsdp(s))``.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from pipeline_ext.schedules.ir import Action, ActionKind, Schedule, ScheduleError, check_structure

__all__ = ["Budget", "plan_fsdp", "strip_fsdp", "unshard_counts", "all_gathers_per_rank", "GRADIENT_KINDS"]

UNSHARD, RESHARD, REDUCE_GRAD = ActionKind.UNSHARD, ActionKind.RESHARD, ActionKind.REDUCE_GRAD
#: the compute kinds that write a stage's parameter gradients (I computes input gradients only)
GRADIENT_KINDS = frozenset({ActionKind.B, ActionKind.W})


@dataclass(frozen=True)
class Budget:
    """How many of a rank's stages may be active at once: by count, by parameter bytes, or without limit.

    Built by :meth:`of`, which checks the arguments; :meth:`fits` says whether a set of active stages is within.
    """

    max_active_stages: Optional[int] = None
    max_unsharded_bytes: Optional[float] = None
    stage_bytes: tuple[float, ...] = ()

    @classmethod
    def of(cls, schedule: Schedule, max_active_stages: Optional[int] = None,
           max_unsharded_bytes: Optional[float] = None,
           stage_bytes: Union[None, float, Sequence[float]] = None) -> "Budget":
        """The budget the arguments describe, or :class:`ScheduleError` naming what is wrong with them."""
        where = f"schedule {schedule.name!r}"
        if max_active_stages is not None and max_unsharded_bytes is not None:
            raise ScheduleError(f"{where}: give max_active_stages or max_unsharded_bytes, not both")
        sizes: tuple[float, ...] = ()
        if stage_bytes is not None:
            n = schedule.num_stages
            values = [stage_bytes] * n if isinstance(stage_bytes, (int, float)) else list(stage_bytes)
            if len(values) != n:
                raise ScheduleError(f"{where}: stage_bytes has {len(values)} entries but the schedule has {n} stages")
            if not all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in values):
                raise ScheduleError(f"{where}: stage_bytes must be finite, non-negative numbers (got {stage_bytes!r})")
            sizes = tuple(float(x) for x in values)
        if max_active_stages is not None:
            if isinstance(max_active_stages, bool) or not isinstance(max_active_stages, int):
                raise ScheduleError(f"{where}: max_active_stages must be an integer (got {max_active_stages!r})")
            if max_active_stages < 1:
                raise ScheduleError(f"{where}: max_active_stages={max_active_stages} is below 1: a stage computes "
                                    "only while its parameters are unsharded, so every rank needs at least one")
        if max_unsharded_bytes is not None:
            if not sizes:
                raise ScheduleError(f"{where}: max_unsharded_bytes needs stage_bytes, the unsharded parameter "
                                    "bytes of each stage")
            if not (isinstance(max_unsharded_bytes, (int, float)) and max_unsharded_bytes > 0
                    and math.isfinite(max_unsharded_bytes)):
                raise ScheduleError(f"{where}: max_unsharded_bytes must be a positive number of bytes "
                                    f"(got {max_unsharded_bytes!r})")
        return cls(max_active_stages, None if max_unsharded_bytes is None else float(max_unsharded_bytes), sizes)

    @property
    def limited(self) -> bool:
        return self.max_active_stages is not None or self.max_unsharded_bytes is not None

    def fits(self, active) -> bool:
        """Whether the stages in ``active`` may be active at once."""
        if self.max_active_stages is not None:
            return len(active) <= self.max_active_stages
        if self.max_unsharded_bytes is not None:
            return sum(self.stage_bytes[s] for s in active) <= self.max_unsharded_bytes * (1 + 1e-12)
        return True

    def __str__(self) -> str:
        if self.max_active_stages is not None:
            return f"max_active_stages={self.max_active_stages}"
        if self.max_unsharded_bytes is not None:
            return f"max_unsharded_bytes={self.max_unsharded_bytes:g}"
        return "no budget"

    def require_runnable(self, schedule: Schedule) -> None:
        """Refuse a budget under which some rank cannot run one of its compute units at all.

        A unit needs all its stages at once: one stage, or both stages of an overlapped pair (DualPipeV's F&B
        pairs), so a count of 1 cannot run a pair and a byte budget must hold the largest stage or pair.
        """
        for rank in range(schedule.num_ranks):
            for stages, actions in _units(schedule, rank):
                if self.fits(stages):
                    continue
                if self.max_active_stages is not None:
                    need = f"{len(stages)} active stages"
                else:
                    need = f"{sum(self.stage_bytes[s] for s in stages):g} bytes"
                what = (f"stage {stages[0]}: it needs {need}" if len(stages) == 1 else
                        f"the overlapped pair ({actions[0]};{actions[1]}): its two halves run at once, so stages "
                        f"{stages[0]} and {stages[1]} must both be unsharded ({need})")
                raise ScheduleError(f"schedule {schedule.name!r}, rank {rank}: {self} is too small for {what}")


def plan_fsdp(schedule: Schedule, max_active_stages: Optional[int] = None,
              max_unsharded_bytes: Optional[float] = None,
              stage_bytes: Union[None, float, Sequence[float]] = None, prefetch: bool = True) -> Schedule:
    """``schedule`` (lowered or not) with UNSHARD / RESHARD / REDUCE_GRAD placed on every rank (module doc).

    No budget: each stage is unsharded once, one compute unit before its first use (``prefetch``; else right
    before it), and resharded right after its REDUCE_GRAD: one all-gather per stage per step. A budget
    (``max_active_stages``, or ``max_unsharded_bytes`` with ``stage_bytes``) bounds the active stages of every
    rank; Belady's rule chooses what to free. Raises :class:`ScheduleError` for a schedule that already places
    parameters (plan ``strip_fsdp(schedule)``) and for a budget some rank cannot run under.
    """
    check_structure(schedule)
    if schedule.has_fsdp:
        raise ScheduleError(f"schedule {schedule.name!r} already has UNSHARD/RESHARD/REDUCE_GRAD actions; plan "
                            "strip_fsdp(schedule) to place them anew")
    budget = Budget.of(schedule, max_active_stages, max_unsharded_bytes, stage_bytes)
    budget.require_runnable(schedule)
    rows = [_plan_rank(schedule, rank, budget, prefetch) for rank in range(schedule.num_ranks)]
    return schedule.with_actions(rows)


def strip_fsdp(schedule: Schedule) -> Schedule:
    """``schedule`` without its FSDP actions (the rest, overlapped pairs included, as it is)."""
    return schedule.with_actions([[a for a in acts if not a.is_fsdp] for acts in schedule.actions])


def unshard_counts(schedule: Schedule) -> dict[int, int]:
    """All-gathers per stage in one step: the number of UNSHARDs of each stage (0 for one never unsharded)."""
    counts = Counter(a.stage for acts in schedule.actions for a in acts if a.kind is UNSHARD)
    return {s: counts[s] for s in range(schedule.num_stages)}


def all_gathers_per_rank(schedule: Schedule) -> list[int]:
    """All-gathers each rank issues in one step (its UNSHARDs)."""
    return [sum(a.kind is UNSHARD for a in acts) for acts in schedule.actions]


def _units(schedule: Schedule, rank: int) -> list[tuple[tuple[int, ...], tuple[Action, ...]]]:
    """A rank's compute units in order: (stages needed, actions); an overlapped pair is one unit of two actions."""
    second_of = dict(schedule.overlapped)
    units: list[tuple[tuple[int, ...], tuple[Action, ...]]] = []
    for a in schedule.actions[rank]:
        if not a.is_compute:
            continue
        if units and len(units[-1][1]) == 1 and second_of.get(units[-1][1][0]) == a:
            first = units[-1][1][0]
            stages = (first.stage,) if first.stage == a.stage else (first.stage, a.stage)
            units[-1] = (stages, (first, a))
        else:
            units.append(((a.stage,), (a,)))
    return units


def _plan_rank(schedule: Schedule, rank: int, budget: Budget, prefetch: bool) -> list[Action]:
    """One rank's list with its FSDP actions: Belady on demand, then each unit's decisions moved earlier."""
    units = _units(schedule, rank)
    n = len(units)
    uses: dict[int, list[int]] = {}
    last_grad: dict[int, int] = {}
    for k, (stages, actions) in enumerate(units):
        for s in stages:
            uses.setdefault(s, []).append(k)
        for a in actions:
            if a.kind in GRADIENT_KINDS:
                last_grad[a.stage] = k

    def next_use(s: int, k: int) -> float:
        """Index of the first unit at or after ``k`` that needs ``s`` (infinity: none)."""
        ks = uses[s]
        i = bisect_left(ks, k)
        return ks[i] if i < len(ks) else math.inf

    # Demand pass: what each unit frees and gathers right before it, and the set active while it runs.
    evict: list[list[int]] = [[] for _ in range(n)]
    fetch: list[list[int]] = [[] for _ in range(n)]
    during: list[frozenset[int]] = []
    done_after: list[list[int]] = [[] for _ in range(n)]  # stages whose last use is unit k: resharded after it
    active: set[int] = set()
    for k, (stages, _) in enumerate(units):
        for s in stages:
            if s in active:
                continue
            while not budget.fits(active | {s}):
                candidates = [x for x in active if x not in stages]
                if not candidates:  # require_runnable refused such budgets; a guard for the invariant
                    raise ScheduleError(f"schedule {schedule.name!r}, rank {rank}: {budget} cannot hold the "
                                        f"stages {sorted(stages)} of unit {k}")
                victim = max(candidates, key=lambda x: (next_use(x, k), x))
                active.remove(victim)
                evict[k].append(victim)
            active.add(s)
            fetch[k].append(s)
        during.append(frozenset(active))
        for s in stages:
            if next_use(s, k + 1) == math.inf:
                active.discard(s)
                done_after[k].append(s)

    # Prefetch: unit k+1's decisions go before unit k when they fit then and free nothing unit k uses.
    early = [False] * n
    if prefetch:
        for k in range(n - 1):
            if not fetch[k + 1] or set(evict[k + 1]) & set(units[k][0]):
                continue
            if budget.fits((during[k] - set(evict[k + 1])) | set(fetch[k + 1])):
                early[k + 1] = True

    def decisions(k: int) -> list[Action]:
        return [Action.fsdp(s, RESHARD) for s in evict[k]] + [Action.fsdp(s, UNSHARD) for s in fetch[k]]

    gaps: list[list[Action]] = [[] for _ in range(n + 1)]  # gaps[k]: right before unit k (gaps[n]: the end)
    for k in range(n):
        if not early[k]:
            gaps[k].extend(decisions(k))
        if k + 1 < n and early[k + 1]:
            gaps[k].extend(decisions(k + 1))
        after = gaps[k + 1]  # filled first: the end of unit k comes before unit k+1's own decisions
        after.extend(Action.fsdp(s, REDUCE_GRAD) for s in sorted(last_grad) if last_grad[s] == k)
        after.extend(Action.fsdp(s, RESHARD) for s in done_after[k])
    return _insert(schedule.actions[rank], units, gaps)


def _insert(row: list[Action], units, gaps: list[list[Action]]) -> list[Action]:
    """``row`` with ``gaps[k]`` before unit k: after the previous unit and the SENDs right after it."""
    last_of = {u[1][-1]: k for k, u in enumerate(units)}
    out: list[Action] = list(gaps[0])
    pending: Optional[int] = None  # the gap waiting for the current run of SENDs to end
    for a in row:
        if pending is not None and a.kind not in (ActionKind.SEND_F, ActionKind.SEND_B):
            out.extend(gaps[pending])
            pending = None
        out.append(a)
        if a in last_of:
            pending = last_of[a] + 1
    if pending is not None:
        out.extend(gaps[pending])
    return out
