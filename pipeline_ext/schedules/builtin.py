"""The built-in schedules: one small generator function each, registered by name.

A schedule is data, so each generator only decides the order of F / B (or I
and W) actions on every rank and returns an unlowered :class:`Schedule`;
lowering, validation, simulation and execution are shared. The orders that
several schedules have in common (warm-up forwards, then one forward and one
backward alternately, then the remaining backwards; W passes deferred by a
fixed lag) are helpers, not copies.

Bubble figures below are at F = B = W = 1 and c = 0 per stage (B is the
input-grad half, a full backward costs B + W); memory is counted in
stage-microbatch activations on a rank (a stage of a V or looped schedule
holds 1/v of a rank's layers, so its activations are 1/v as large).
"""
from __future__ import annotations

from typing import Callable, Optional

from pipeline_ext.schedules.ir import Action, ActionKind, Schedule, ScheduleError
from pipeline_ext.schedules.lowering import loop_placement, v_placement
from pipeline_ext.schedules.orders import (
    RankBuilder,
    depth_first,
    interleaved_rounds,
    pipeline_order,
    split_backward,
    split_backward_of,
)
from pipeline_ext.schedules.vmem import v_half_limit, v_min_limit, v_schedule

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W

Generator = Callable[[int, int, int], Schedule]
_REGISTRY: dict[str, tuple[Generator, int, bool]] = {}


def register(name: str, stages_per_rank: int = 1, multi_stage: bool = False) -> Callable[[Generator], Generator]:
    """Add a generator ``fn(p, m, v) -> Schedule`` under ``name``.

    ``stages_per_rank`` is the default v; ``multi_stage`` says whether other
    values of v are accepted (interleaved and looped schedules).
    """

    def deco(fn: Generator) -> Generator:
        _REGISTRY[name] = (fn, stages_per_rank, multi_stage)
        return fn

    return deco


def available() -> list[str]:
    """Names accepted by :func:`build`, in registration order."""
    return list(_REGISTRY)


def default_stages_per_rank(name: str) -> int:
    """The v a built-in schedule uses unless told otherwise (2 for interleaved, looped and V-shaped ones)."""
    if name not in _REGISTRY:
        raise ScheduleError(f"unknown schedule {name!r}; available: {', '.join(available())}")
    return _REGISTRY[name][1]


def build(name: str, num_ranks: int, n_microbatches: int, stages_per_rank: Optional[int] = None) -> Schedule:
    """Generate the named schedule (unlowered: compute actions only).

    ``stages_per_rank`` defaults to 1 for single-stage schedules and 2 for the
    interleaved, looped and V-shaped ones. Violated constraints raise
    :class:`ScheduleError` naming the constraint and the values.
    """
    if name == "auto":  # select() names its greedy schedule so; it is built from a budget and costs, not a name
        raise ScheduleError("'auto' is not a built-in: it is built for a memory budget and costs. Pass the "
                            "Schedule itself (select(...).schedule, or schedules.auto(...)) instead of its name")
    if name not in _REGISTRY:
        raise ScheduleError(f"unknown schedule {name!r}; available: {', '.join(available())}")
    fn, default_v, multi_stage = _REGISTRY[name]
    v = default_v if stages_per_rank is None else stages_per_rank
    _require(num_ranks >= 1, name, "num_ranks >= 1", num_ranks=num_ranks)
    _require(n_microbatches >= 1, name, "n_microbatches >= 1", n_microbatches=n_microbatches)
    if multi_stage:  # v = 1 runs as torch does: the same order with one stage per rank
        _require(v >= 1, name, "stages_per_rank >= 1", stages_per_rank=v)
    else:
        _require(v == default_v, name, f"stages_per_rank == {default_v}", stages_per_rank=v)
    return fn(num_ranks, n_microbatches, v)


def _require(ok: bool, name: str, constraint: str, **values: int) -> None:
    if not ok:
        got = ", ".join(f"{k}={v}" for k, v in values.items())
        raise ScheduleError(f"{name} needs {constraint} (got {got})")


def _make(name: str, m: int, stage_to_rank: list[int], per_rank: Callable[[int], list[Action]]) -> Schedule:
    n_ranks = max(stage_to_rank) + 1
    return Schedule([per_rank(r) for r in range(n_ranks)], stage_to_rank, m, name)


def _forwards(stage: int, m: int) -> list[Action]:
    return [Action(stage, F, j) for j in range(m)]


def _full_backwards(stage: int, microbatches) -> list[list[Action]]:
    return [[Action(stage, B, j)] for j in microbatches]


@register("gpipe")
def gpipe(p: int, m: int, v: int = 1) -> Schedule:
    """GPipe (Huang et al. 2019): every forward, then every backward.

    Bubble (p-1)/(m+p-1). Peak activations m on every rank. Any p >= 1, m >= 1.
    """
    return _make("gpipe", m, loop_placement(p, 1),
                 lambda r: pipeline_order(_forwards(r, m), _full_backwards(r, range(m)), warmup=m))


@register("1f1b")
def one_f_one_b(p: int, m: int, v: int = 1) -> Schedule:
    """1F1B (PipeDream-Flush): p-1-r warm-up forwards, then one forward and one backward alternately.

    Bubble (p-1)/(m+p-1), as GPipe. Peak activations p-r on rank r (p on rank 0).
    Needs m >= p.
    """
    _require(m >= p, "1f1b", "n_microbatches >= num_ranks", n_microbatches=m, num_ranks=p)
    return _make("1f1b", m, loop_placement(p, 1),
                 lambda r: pipeline_order(_forwards(r, m), _full_backwards(r, range(m)), warmup=p - 1 - r))


def _interleaved_order(name: str, p: int, m: int, v: int, split: bool) -> Schedule:
    """Interleaved 1F1B's depth-first order; ``split``: every backward as I and W, rank r's W delayed by r."""
    rounds, g = interleaved_rounds(p, m)
    _require(m % rounds == 0, name, "n_microbatches to be a multiple of its rounds, max(1, n_microbatches // "
             "num_ranks)", n_microbatches=m, num_ranks=p)

    def rank(r: int) -> list[Action]:
        fwd = [Action(s, F, j) for s, j in depth_first(r, p, v, m, reverse=False, group=g)]
        order = list(depth_first(r, p, v, m, reverse=True, group=g))
        bwd = split_backward_of(order, lag=r) if split else [[Action(s, B, j)] for s, j in order]
        return pipeline_order(fwd, bwd, warmup=min((p - 1 - r) * 2 + (v - 1) * g, m * v))

    return _make(name, m, loop_placement(p, v), rank)


@register("interleaved_1f1b", stages_per_rank=2, multi_stage=True)
def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021), depth-first order.

    Stage s on rank s % p (v stages per rank); microbatches go through a rank's
    stages in rounds of g = m // max(1, m // p) (p when m is a multiple of p),
    as torch counts them. Warm-up (p-1-r)*2 + (v-1)*g forwards on rank r.
    Bubble (p-1)/(v*m+p-1) when m is a multiple of p. Peak activations on rank
    0: (v-1)*g + 2(p-1) + 1 stage-activations (each 1/v of a rank's layers).
    Needs m to be a multiple of its rounds (any m <= p, any multiple of p, ...).
    """
    return _interleaved_order("interleaved_1f1b", p, m, v, split=False)


@register("interleaved_zb", stages_per_rank=2, multi_stage=True)
def interleaved_zb(p: int, m: int, v: int = 2) -> Schedule:
    """Interleaved zero bubble (ZB1P with several stages per rank; torch's ScheduleInterleavedZeroBubble).

    Interleaved 1F1B's order (:func:`interleaved_1f1b`), with every backward
    split into I and W and rank r's W passes delayed by r backwards, as ZB-H1
    does for one stage per rank: the I passes (the critical path) run earlier
    and the owed W passes fill the drain. Same warm-up, placement and
    constraints as interleaved 1F1B; r more stage-activations held on rank r.
    """
    return _interleaved_order("interleaved_zb", p, m, v, split=True)


@register("looped_bfs", stages_per_rank=2, multi_stage=True)
def looped_bfs(p: int, m: int, v: int = 2) -> Schedule:
    """Looped BFS (Lamy-Poirier 2023, "breadth-first"): GPipe over each local stage in turn.

    Stage s on rank s % p. Each rank runs all microbatches through its first
    stage, then its next, ...; backwards in reverse stage and microbatch order.
    Bubble (p-1)/(v*m+p-1) at c = 0 (comm can overlap, which this model does
    not credit). Peak activations v*m on every rank. Needs v >= 2, m >= 1.
    """

    def rank(r: int) -> list[Action]:
        stages = [r + k * p for k in range(v)]
        fwd = [a for s in stages for a in _forwards(s, m)]
        bwd = [g for s in reversed(stages) for g in _full_backwards(s, reversed(range(m)))]
        return pipeline_order(fwd, bwd, warmup=len(fwd))

    return _make("looped_bfs", m, loop_placement(p, v), rank)


@register("zb_h1")
def zb_h1(p: int, m: int, v: int = 1) -> Schedule:
    """ZB-H1 (Qi et al. 2024): 1F1B with the backward split and rank r's W delayed by r.

    Bubble (p-1)/(3m+p-1), a third of 1F1B's; in general (p-1)(F+B-W) plus
    comm. Peak activations p on every rank, as 1F1B's rank 0. Needs m >= p.
    """
    _require(m >= p, "zb_h1", "n_microbatches >= num_ranks", n_microbatches=m, num_ranks=p)
    return _make("zb_h1", m, loop_placement(p, 1),
                 lambda r: pipeline_order(_forwards(r, m), split_backward(r, m, lag=r), warmup=p - 1 - r))


@register("zb_h2")
def zb_h2(p: int, m: int, v: int = 1) -> Schedule:
    """ZB-H2 (Qi et al. 2024): 2p-1-2r warm-up forwards, then I, W, F; W delayed by 2r.

    The extra warm-up forwards fill the bubble before the first backward and the
    W passes pushed to the tail turn the trapezoid into a parallelogram. Bubble
    0 when m >= 2p-1; in general (p-1)(F+B-2W) plus comm. Peak activations
    2p-1 on every rank. Needs m >= p.
    """
    _require(m >= p, "zb_h2", "n_microbatches >= num_ranks", n_microbatches=m, num_ranks=p)
    return _make("zb_h2", m, loop_placement(p, 1),
                 lambda r: pipeline_order(_forwards(r, m), split_backward(r, m, lag=2 * r),
                                          warmup=min(2 * p - 1 - 2 * r, m), backward_first=True))


@register("zbv", stages_per_rank=2)
def zbv(p: int, m: int, v: int = 2) -> Schedule:
    """ZB-V (Qi et al. 2024): two stages per rank in a V, backward split, W filling the gaps.

    Rank r holds stage r and stage 2p-1-r, so rank 0 runs the first and the last
    stage and the stage hand-over at the bottom of the V is local. Bubble 0 when
    m >= 2p. Peak activations 2p stage-activations on rank 0, each half a
    rank's layers: the same bytes as 1F1B's p. Fewer microbatches than ranks
    also run (torch allows it): the phases shrink.
    """

    def rank(r: int) -> list[Action]:
        lo, hi = r, 2 * p - 1 - r
        rb = RankBuilder(m)
        rb.repeat(2 * (p - r) - 1, (lo, F))
        rb.repeat(r, (hi, F), (lo, F))
        rb.repeat(p - r, (hi, F), (hi, I), (hi, W))
        while rb.count(hi, F) < m:
            rb.emit((lo, F), (lo, I), (lo, W), (hi, F), (hi, I), (hi, W))
        rb.repeat(r, (lo, I), (hi, I))
        rb.repeat(p - r, (lo, I), (lo, W))
        rb.finish_w(hi, lo)
        return rb.actions

    return _make("zbv", m, v_placement(p), rank)


@register("dualpipev", stages_per_rank=2)
def dualpipev(p: int, m: int, v: int = 2) -> Schedule:
    """DualPipeV (DeepSeek's DualPipe "cut in half", V placement as :func:`zbv`).

    Eight phases per rank: forwards of the first stage, forward pairs, split
    backwards of the second stage each with its W, the main phase pairing a
    backward of one stage with a forward of the other (DualPipe overlaps each
    pair with its communication; written here as B then F, which frees memory
    first, and charged serially by the simulator), then the drain, whose later
    backwards are split and whose owed W passes run oldest first to fill the
    tail. Bubble (p-1)/(6m+p-1) in this serial model (the overlap that makes
    DualPipe worthwhile is not modelled). Peak activations 2p stage-activations
    on rank 0, as :func:`zbv`. Needs m >= 2p.
    """
    _require(m >= 2 * p, "dualpipev", "n_microbatches >= 2 * num_ranks", n_microbatches=m, num_ranks=p)

    pairs: list[tuple[Action, Action]] = []

    def rank(r: int) -> list[Action]:
        lo, hi = r, 2 * p - 1 - r
        rb = RankBuilder(m)
        rb.repeat(2 * (p - r - 1), (lo, F))
        rb.repeat(r + 1, (lo, F), (hi, F))
        for _ in range(p - r - 1):
            rb.backward(hi, split=True)
            rb.pop_w()
            rb.emit((hi, F))
        for _ in range(m - 2 * p + r + 1):
            for b_stage, f_stage in ((hi, lo), (lo, hi)):
                rb.backward(b_stage)
                rb.emit((f_stage, F))
                if rb.actions[-2].kind == B:  # the main phase's overlapped pair (torch's OVERLAP_F_B)
                    pairs.append((rb.actions[-2], rb.actions[-1]))
        for _ in range(p - r - 1):
            rb.backward(hi)
            rb.backward(lo)
            rb.emit((hi, F))
        half = (r + 1) // 2
        for i in range(r + 1):
            rb.backward(hi, split=i > half or (i == half and r % 2 == 1))
            rb.backward(lo, split=i >= half)
        for _ in range(p - r - 1):
            rb.pop_w()
            rb.backward(lo, split=True)
        rb.finish_w()
        return rb.actions

    schedule = _make("dualpipev", m, v_placement(p), rank)
    schedule.overlapped = tuple(pairs)
    return schedule


@register("v_half", stages_per_rank=2)
def v_half(p: int, m: int, v: int = 2) -> Schedule:
    """V-Half (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024): V placement at half 1F1B's memory.

    Placement and split backward as :func:`zbv`; the order comes from list
    scheduling under a limit of 2*ceil(p/2) + 2 stage activations per rank,
    i.e. ceil(p/2) + 1 rank-microbatch units against 1F1B's p (see
    :mod:`.vmem`). Bubble below 1F1B's: 0.143 vs 0.273 at p = 4, m = 8.
    Any p >= 1, m >= 1.
    """
    return v_schedule(p, m, v_half_limit(p), "v_half")


@register("v_min", stages_per_rank=2)
def v_min(p: int, m: int, v: int = 2) -> Schedule:
    """V-Min (Qi et al. 2024): V placement at about a third of 1F1B's memory.

    As :func:`v_half` with a limit of 2*ceil((p-1)/3) + 2 stage activations
    per rank, i.e. ceil((p-1)/3) + 1 rank-microbatch units. Activations live
    about as short as the V allows, so warm-up and drain cost more than
    V-Half's: bubble 0.186 at p = 4, m = 8 (1F1B 0.273, V-Half 0.143).
    Any p >= 1, m >= 1.
    """
    return v_schedule(p, m, v_min_limit(p), "v_min")
