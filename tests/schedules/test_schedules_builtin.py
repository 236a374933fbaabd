"""Every built-in: constraints, validity, deadlock freedom, closed-form bubbles and memory."""
from __future__ import annotations

import pytest

from pipeline_ext.schedules import Costs, ScheduleError, available, build, lower, simulate, validate
from pipeline_ext.schedules.lowering import loop_placement, v_placement

MULTI_STAGE = {"interleaved_1f1b", "interleaved_zb", "looped_bfs", "zbv", "dualpipev", "v_half", "v_min"}
SPLIT = {"zb_h1", "zb_h2", "interleaved_zb", "zbv", "dualpipev", "v_half", "v_min"}


def test_registry():
    assert available() == ["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "looped_bfs", "zb_h1", "zb_h2", "zbv",
                           "dualpipev", "v_half", "v_min"]
    with pytest.raises(ScheduleError, match="unknown schedule 'nope'; available: gpipe"):
        build("nope", 2, 2)


#: V-Half and V-Min are built by list scheduling under a memory limit (seconds per rank count): their larger rank
#: counts run with the slow tests, so the quick selection still checks every schedule on 1..5 ranks
_LIST_SCHEDULED = {"v_half", "v_min"}
_GRID = [pytest.param(name, range(1, 9), id=name) for name in available() if name not in _LIST_SCHEDULED] + [
    param for name in sorted(_LIST_SCHEDULED) for param in (
        pytest.param(name, range(1, 6), id=f"{name}-p1..5"),
        pytest.param(name, range(6, 9), id=f"{name}-p6..8", marks=pytest.mark.slow))]


@pytest.mark.parametrize("name,ranks", _GRID)
def test_every_builtin_valid_and_deadlock_free(name, ranks):
    """p in 1..8, m from p to 4p wherever the schedule's constraints allow."""
    checked = 0
    for p in ranks:
        for m in range(p, 4 * p + 1):
            try:
                sched = build(name, p, m)
            except ScheduleError:
                continue
            validate(sched)
            low = lower(sched)
            validate(low)  # includes FIFO order and check_deadlock (blocking receives)
            assert not sched.lowered and (low.lowered or p == 1)
            assert lower(low) == low
            kinds = {a.kind.value for acts in sched.actions for a in acts}
            assert kinds == ({"F", "I", "W"} if name in SPLIT and name != "dualpipev" else
                             {"F", "B", "I", "W"} if name == "dualpipev" else {"F", "B"})
            assert len(sched.stages_of(0)) == (2 if name in MULTI_STAGE else 1)
            checked += 1
    assert checked >= (30 if len(ranks) == 8 else 9)


def test_placements():
    assert loop_placement(3, 2) == [0, 1, 2, 0, 1, 2]
    assert v_placement(3) == [0, 1, 2, 2, 1, 0]
    assert build("interleaved_1f1b", 3, 6).stage_to_rank == loop_placement(3, 2)
    assert build("looped_bfs", 2, 2, stages_per_rank=3).stage_to_rank == loop_placement(2, 3)
    assert build("zbv", 3, 6).stage_to_rank == build("dualpipev", 3, 6).stage_to_rank == v_placement(3)
    assert build("v_half", 3, 6).stage_to_rank == build("v_min", 3, 6).stage_to_rank == v_placement(3)


@pytest.mark.parametrize("name,p,m,v,message", [
    ("1f1b", 4, 2, None, r"1f1b needs n_microbatches >= num_ranks \(got n_microbatches=2, num_ranks=4\)"),
    ("zb_h1", 4, 3, None, r"zb_h1 needs n_microbatches >= num_ranks \(got n_microbatches=3, num_ranks=4\)"),
    # torch's rule: max(1, m // p) rounds must divide m (6 on 4 ranks is one round of 6; 7 on 3 is not 2 rounds)
    ("interleaved_1f1b", 3, 7, None, r"multiple of its rounds.*\(got n_microbatches=7, num_ranks=3\)"),
    ("interleaved_1f1b", 4, 8, 0, r"stages_per_rank >= 1 \(got stages_per_rank=0\)"),
    ("gpipe", 4, 8, 2, r"gpipe needs stages_per_rank == 1 \(got stages_per_rank=2\)"),
    ("zbv", 4, 8, 3, r"zbv needs stages_per_rank == 2 \(got stages_per_rank=3\)"),
    ("dualpipev", 4, 7, None, r"n_microbatches >= 2 \* num_ranks \(got n_microbatches=7, num_ranks=4\)"),
    ("v_half", 4, 8, 1, r"v_half needs stages_per_rank == 2 \(got stages_per_rank=1\)"),
    ("v_min", 4, 0, None, r"v_min needs n_microbatches >= 1 \(got n_microbatches=0\)"),
    ("gpipe", 0, 8, None, r"num_ranks >= 1 \(got num_ranks=0\)"),
    ("gpipe", 2, 0, None, r"n_microbatches >= 1 \(got n_microbatches=0\)"),
])
def test_constraint_errors_name_constraint_and_values(name, p, m, v, message):
    with pytest.raises(ScheduleError, match=message):
        build(name, p, m, stages_per_rank=v)


GRID = [(p, m) for p in (1, 2, 3, 4, 6, 8) for m in (p, 2 * p, 3 * p + 1, 4 * p)]


@pytest.mark.parametrize("p,m", GRID)
def test_closed_form_bubbles_unit_costs(p, m):
    unit = Costs(1.0, 1.0, 1.0, 0.0)
    rate = lambda name, **kw: simulate(build(name, p, m, **kw), unit).bubble_rate  # noqa: E731
    assert rate("gpipe") == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert rate("1f1b") == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert rate("zb_h1") == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
    if m % p == 0:
        for v in (2, 3):
            assert rate("interleaved_1f1b", stages_per_rank=v) == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
            # the W passes fill part of interleaved 1F1B's bubble, never more of it
            assert rate("interleaved_zb", stages_per_rank=v) <= rate("interleaved_1f1b", stages_per_rank=v) + 1e-12
    if m >= 2 * p:
        assert rate("zbv") == pytest.approx(0.0, abs=1e-12)
    if m >= 2 * p - 1:
        assert rate("zb_h2") == pytest.approx(0.0, abs=1e-12)
    for v in (2, 3):
        assert rate("looped_bfs", stages_per_rank=v) == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    if m >= 2 * p:  # F&B pairs run serially here: DualPipe's overlap with communication is not modelled
        assert rate("dualpipev") == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p,m", [(p, m) for p, m in GRID if m >= 2 * p])
def test_peak_activations_on_rank_0(p, m):
    peak = lambda name: simulate(build(name, p, m)).peak_activations  # noqa: E731
    assert peak("gpipe") == [m] * p
    assert peak("1f1b") == [p - r for r in range(p)]
    assert peak("zb_h1") == [p] * p
    assert peak("zb_h2")[0] == 2 * p - 1
    assert peak("zbv")[0] == 2 * p  # stage-activations of half size: 1F1B's bytes
    assert peak("dualpipev")[0] == 2 * p
    if m % p == 0:  # (v-1)p + 2(p-1) warm-up forwards, +1 in the first steady step (v = 2)
        assert peak("interleaved_1f1b")[0] == p + 2 * (p - 1) + 1
    assert peak("looped_bfs")[0] == 2 * m


def test_stages_per_rank_defaults():
    assert build("interleaved_1f1b", 2, 4).num_stages == 4
    assert build("looped_bfs", 2, 4, stages_per_rank=4).num_stages == 8
    assert build("zb_h2", 3, 6).num_stages == 3


V_GRID = [(p, m) for p in range(2, 9) for m in sorted({p, p + 1, 2 * p, 2 * p + 1, 3 * p})]


@pytest.mark.parametrize("p,m", V_GRID)
def test_v_half_and_v_min_memory_bounds_and_bubbles(p, m):
    """The controllable-memory V schedules keep their stated bound on every rank and pay for it in bubble, not more.

    Bounds in stage activations (halve for rank-microbatch units): V-Half 2*ceil(p/2) + 2, V-Min
    2*ceil((p-1)/3) + 2, against ZB-V's 2p (1F1B's bytes). At F = B = W = 1 both beat 1F1B's bubble, and
    V-Min, with the shorter activation lives, never beats V-Half.
    """
    unit = Costs(1.0, 1.0, 1.0, 0.0)
    res = {name: simulate(build(name, p, m), unit) for name in ("v_half", "v_min", "zbv")}
    for name in ("v_half", "v_min"):
        sched = res[name].schedule
        validate(lower(sched))
        assert sched.name == name and sched.stage_to_rank == v_placement(p)
    half_bound, min_bound = 2 * -(-p // 2) + 2, 2 * -(-(p - 1) // 3) + 2
    assert max(res["v_half"].peak_activations) <= half_bound
    assert max(res["v_min"].peak_activations) <= min_bound
    assert max(res["zbv"].peak_activations) == 2 * p
    one_f_one_b = (p - 1) / (m + p - 1)
    assert res["v_half"].bubble_rate < one_f_one_b
    assert res["v_min"].bubble_rate < one_f_one_b
    assert res["v_half"].bubble_rate <= res["v_min"].bubble_rate + 1e-12
    if p >= 4:  # the point of them: below ZB-V's memory (at p = 2, 3 the +2 of a list schedule reaches it)
        assert max(res["v_half"].peak_activations) < 2 * p and max(res["v_min"].peak_activations) < 2 * p


def test_v_schedules_with_costs_and_limits():
    """The generator under other costs and limits: the limit holds, and one no schedule fits is an error."""
    from pipeline_ext.schedules.vmem import v_schedule

    costs = Costs(1.0, 2.0, 1.0, 0.1)
    for limit in (2, 3, 5, 8):
        sched = v_schedule(4, 9, limit, costs=costs)
        validate(lower(sched))
        assert max(simulate(sched, costs).peak_activations) <= limit
    with pytest.raises(ScheduleError, match="limit of at least 2 stage activations"):
        v_schedule(4, 8, 1)


@pytest.mark.parametrize("costs", [Costs(), Costs(1.0, 2.0, 1.0, 0.1), Costs(0.3, 0.7, 0.45, 0.05),
                                   Costs([1.0, 1.5, 0.5, 2.0, 1.0, 1.0, 3.0, 0.5], 1.2, [0.5] * 8, [0.0, 0.2] * 4)],
                         ids=["unit", "b2", "fractions", "per-stage"])
def test_v_list_scheduler_times_are_the_simulated_ones(costs):
    """The list scheduler picks its variant by its own times: they must be the simulator's, variant by variant."""
    from pipeline_ext.schedules.vmem import _list_schedule, _variants, v_half_limit, v_min_limit

    compared = 0
    for p in (1, 2, 3, 4):
        for m in (1, p, 2 * p + 1):
            for limit in {v_half_limit(p), v_min_limit(p), 2}:
                for order, reserve, sequences in _variants(p, m):
                    try:
                        sched, key = _list_schedule(p, m, limit, reserve, order, sequences, costs, "v")
                    except ScheduleError:
                        continue
                    res = simulate(sched, costs)
                    assert key == (round(res.bubble_rate, 12), max(res.peak_activations), res.makespan), (p, m, limit)
                    compared += 1
    assert compared >= 100
