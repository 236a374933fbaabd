"""Cut a list of layers into contiguous stages that minimise the simulated step time of a schedule.

Why not equal layer counts, or equal cost sums: a pipeline's step is set by
its schedule, not by the largest stage alone. Under 1F1B the warm-up and
cool-down cross every stage once while the steady state runs at the pace of
the slowest; on a V schedule a rank holds two stages whose loads add up; the
embedding and the LM head (with the loss) make the first and last stages heavy
however many blocks they hold. So the objective here is the makespan that
:func:`~pipeline_ext.schedules.simulate` gives for the chosen schedule under
per-stage costs summed from per-layer costs, optionally under a per-rank
memory budget (the simulator's peak of live activations, weighted by each
stage's bytes, plus the parameters the rank holds).

The search: every split when there are few (``exhaustive_limit``), else the
exact min-max split of the per-layer totals (dynamic programme) and the equal
count split as starting points, then a local search that moves one cut point
at a time by up to ``max_shift`` layers while the simulated step time (then the
largest stage) improves. Pure Python on numbers, so it lives with the
schedules (no torch): the torch side measures the costs
(``pipeline_ext.training.profiling.profile_layers``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations
from typing import Optional, Sequence, Union

from pipeline_ext.schedules.builtin import build
from pipeline_ext.schedules.ir import Schedule, ScheduleError
from pipeline_ext.schedules.simulate import Cost, Costs, SimResult, simulate

__all__ = ["LayerCost", "Balance", "balance_stages", "equal_sizes", "evaluate_split", "split_min_max", "stage_costs"]


@dataclass(frozen=True)
class LayerCost:
    """What one layer costs for one microbatch: forward, input-grad backward, weight-grad backward (seconds or any
    common unit), the activation bytes its forward leaves for the backward (its inputs included, as
    ``pe.activation_bytes`` counts them), the bytes of those inputs (shared with the previous layer when both sit
    in one stage, so counted once there), and its parameter bytes."""

    f: float
    b: float
    w: float = 0.0
    activation_bytes: float = 0.0
    input_bytes: float = 0.0
    param_bytes: float = 0.0

    @property
    def total(self) -> float:
        return self.f + self.b + self.w


def split_min_max(costs: Sequence[float], n: int) -> list[int]:
    """Sizes of ``n`` contiguous non-empty blocks of ``costs`` minimising the largest block sum.

    Exact dynamic programme, O(n * len(costs)^2): layer counts are small.
    """
    k = len(costs)
    if not 1 <= n <= k:
        raise ValueError(f"cannot split {k} layers into {n} stages: need 1 <= stages <= layers")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[j][i]: minimal max-block cost splitting the first i layers into j blocks
    best = [[inf] * (k + 1) for _ in range(n + 1)]
    cut = [[0] * (k + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for j in range(1, n + 1):
        for i in range(j, k - (n - j) + 1):
            for t in range(j - 1, i):
                v = max(best[j - 1][t], prefix[i] - prefix[t])
                if v < best[j][i]:
                    best[j][i], cut[j][i] = v, t
    sizes, i = [], k
    for j in range(n, 0, -1):
        t = cut[j][i]
        sizes.append(i - t)
        i = t
    return sizes[::-1]


def equal_sizes(num_layers: int, num_stages: int) -> list[int]:
    """Layer counts as even as possible, the extra layers on the first stages (``demo.gpt_stages``' rule)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages")
    q, r = divmod(num_layers, num_stages)
    return [q + (1 if i < r else 0) for i in range(num_stages)]


def _ranges(sizes: Sequence[int]) -> list[tuple[int, int]]:
    out, lo = [], 0
    for s in sizes:
        out.append((lo, lo + s))
        lo += s
    return out


def stage_costs(layers: Sequence[LayerCost], sizes: Sequence[int], comm: Cost = 0.0) -> Costs:
    """Per-stage ``Costs`` (sums of the layers' f, b, w) of the split ``sizes``."""
    if sum(sizes) != len(layers) or any(s < 1 for s in sizes):
        raise ValueError(f"sizes {list(sizes)} do not split {len(layers)} layers into non-empty stages")
    parts = [layers[lo:hi] for lo, hi in _ranges(sizes)]
    return Costs(f=[sum(x.f for x in p) for p in parts], b=[sum(x.b for x in p) for p in parts],
                 w=[sum(x.w for x in p) for p in parts], comm=comm)


def _stage_bytes(layers: Sequence[LayerCost], sizes: Sequence[int]) -> tuple[list[float], list[float]]:
    """(activation bytes, parameter bytes) per stage; a layer's input inside a stage is the previous one's output."""
    act, par = [], []
    for lo, hi in _ranges(sizes):
        act.append(sum(x.activation_bytes for x in layers[lo:hi]) - sum(x.input_bytes for x in layers[lo + 1:hi]))
        par.append(sum(x.param_bytes for x in layers[lo:hi]))
    return act, par


@dataclass
class Balance:
    """A split and what the simulator says of it. ``sizes[s]``: layers of stage s; ``peak_bytes[r]``: rank r's
    most activation bytes alive at once plus its parameter bytes; ``layers``: the per-layer costs it was found
    for (to judge another split by them: ``evaluate_split(b.schedule, b.layers, sizes)``)."""

    sizes: list[int]
    schedule: Schedule
    costs: Costs
    result: SimResult
    peak_bytes: list[float]
    layers: list[LayerCost]

    @property
    def makespan(self) -> float:
        return self.result.makespan

    @property
    def bubble_rate(self) -> float:
        return self.result.bubble_rate

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """``[(first layer, end layer)]`` per stage, end exclusive."""
        return _ranges(self.sizes)


def evaluate_split(schedule: Schedule, layers: Sequence[LayerCost], sizes: Sequence[int],
                   comm: Cost = 0.0) -> Balance:
    """Simulate ``schedule`` with the stages ``sizes`` cuts ``layers`` into."""
    if len(sizes) != schedule.num_stages:
        raise ValueError(f"{len(sizes)} stage sizes for a schedule of {schedule.num_stages} stages")
    costs = stage_costs(layers, sizes, comm)
    res = simulate(schedule, costs)
    act, par = _stage_bytes(layers, sizes)
    peaks = res.peak_bytes(act) if any(act) else [0.0] * schedule.num_ranks
    held = [0.0] * schedule.num_ranks
    for s, r in enumerate(schedule.compute_only().stage_to_rank):
        held[r] += par[s]
    return Balance(list(sizes), schedule, costs, res, [a + p for a, p in zip(peaks, held)], list(layers))


def _compositions(k: int, n: int):
    for cuts in combinations(range(1, k), n - 1):
        b = (0, *cuts, k)
        yield [b[i + 1] - b[i] for i in range(n)]


def _count(k: int, n: int) -> int:
    return math.comb(k - 1, n - 1)


def balance_stages(layers: Sequence[LayerCost], schedule: Union[str, Schedule] = "1f1b",
                   num_ranks: Optional[int] = None, microbatches: Optional[int] = None,
                   stages_per_rank: Optional[int] = None, comm: Cost = 0.0,
                   budget_bytes: Optional[float] = None, exhaustive_limit: int = 300,
                   max_shift: int = 2) -> Balance:
    """The split of ``layers`` into the schedule's stages with the least simulated step time.

    ``schedule``: a built-in name (then ``num_ranks``, ``microbatches`` and
    ``stages_per_rank`` as in ``schedules.build``) or a ``Schedule``. ``comm``:
    one transfer's cost (a number, or one per stage). ``budget_bytes``: each
    rank's peak (see :class:`Balance`) must stay within it; splits that break
    it are not taken, and if none is found a ``ScheduleError`` says how close
    the best came. Ties in step time go to the split with the smaller largest
    stage. Exact when the splits number at most ``exhaustive_limit``; a local
    search from the min-max split otherwise (see the module doc).
    """
    if isinstance(schedule, str):
        if num_ranks is None or microbatches is None:
            raise ValueError("a schedule given by name needs num_ranks and microbatches")
        schedule = build(schedule, num_ranks, microbatches, stages_per_rank=stages_per_rank)
    n, k = schedule.num_stages, len(layers)
    if not 1 <= n <= k:
        raise ScheduleError(f"cannot split {k} layers into the {n} stages of {schedule.name!r}")
    cache: dict[tuple[int, ...], tuple[tuple[float, float], Balance]] = {}

    def score(sizes: Sequence[int]) -> tuple[tuple[float, float], Balance]:
        key = tuple(sizes)
        if key not in cache:
            bal = evaluate_split(schedule, layers, sizes, comm)
            over = budget_bytes is not None and max(bal.peak_bytes) > budget_bytes
            biggest = max(bal.costs._get("f", s) + bal.costs._get("b", s) + bal.costs._get("w", s) for s in range(n))
            # over budget: worse than any split within it, and the smaller the excess the better
            cache[key] = ((math.inf, max(bal.peak_bytes)) if over else (bal.makespan, biggest), bal)
        return cache[key]

    def better(a: tuple[float, float], b: tuple[float, float]) -> bool:
        if math.isinf(a[0]) and math.isinf(b[0]):
            return a[1] < b[1]
        tol = 1e-9 * abs(b[0]) if math.isfinite(b[0]) else 0.0
        if a[0] < b[0] - tol:
            return True
        return abs(a[0] - b[0]) <= tol and a[1] < b[1] * (1 - 1e-9)

    if _count(k, n) <= exhaustive_limit:
        candidates = list(_compositions(k, n))
    else:
        candidates = [split_min_max([x.total for x in layers], n), equal_sizes(k, n)]
    best = candidates[0]
    for c in candidates[1:]:
        if better(score(c)[0], score(best)[0]):
            best = c
    if _count(k, n) > exhaustive_limit:
        improved = True
        while improved:
            improved = False
            for cut in range(n - 1):
                for delta in [d for s in range(1, max_shift + 1) for d in (s, -s)]:
                    trial = list(best)
                    trial[cut] -= delta
                    trial[cut + 1] += delta
                    if min(trial[cut], trial[cut + 1]) < 1:
                        continue
                    if better(score(trial)[0], score(best)[0]):
                        best, improved = trial, True
    key, bal = score(best)
    if not math.isfinite(key[0]):
        raise ScheduleError(f"no split of {k} layers into {n} stages found within budget_bytes={budget_bytes:g}: "
                            f"the best found peaks at {max(bal.peak_bytes):g} bytes on a rank")
    return bal
