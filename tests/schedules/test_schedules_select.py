"""Choosing a schedule for a memory budget: the fastest simulated schedule whose peak fits every rank."""
from __future__ import annotations

import math

import pytest

from pipeline_ext import schedules as S

PROFILES = [S.Costs(), S.Costs(1.0, 2.0, 1.0, 0.1), S.Costs(1.0, 1.0, 3.0, 0.5)]


@pytest.mark.parametrize("costs", PROFILES, ids=["unit", "b2", "w3"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 12)])
@pytest.mark.parametrize("budget", [None, 1, 2, 3, 4, 6, 16])
def test_the_choice_fits_and_no_faster_candidate_does(p, m, budget, costs):
    sel = S.select(p, m, budget, costs)
    assert sel.chosen.fits and sel.chosen in sel.candidates
    if budget is not None:
        assert sel.chosen.peak_units <= budget
    faster = [c for c in sel.candidates if c.fits and c.makespan < sel.chosen.makespan - 1e-9]
    assert not faster, faster
    # the schedule handed back is the one measured: simulate it again, independently
    v = sel.chosen.stages_per_rank
    again = S.simulate(sel.schedule, costs.per_stage_of(v) if v > 1 else costs)
    assert math.isclose(again.makespan, sel.chosen.makespan)
    assert max(again.peak_activations) / v == sel.chosen.peak_units


def test_memory_is_counted_in_rank_microbatch_units():
    sel = S.select(4, 8)
    by_name = {c.name: c for c in sel.candidates}
    assert by_name["1f1b"].peak_units == 4  # 1F1B's first rank holds p microbatches
    assert by_name["gpipe"].peak_units == 8  # GPipe holds all m
    assert by_name["zbv"].peak_units == 4  # 8 stage-sized activations of 1/2 unit each (V: 2 stages per rank)
    assert all(c.verdict == "fits" for c in sel.candidates if math.isfinite(c.makespan))


def test_a_budget_nothing_fits_names_the_smallest_peak():
    with pytest.raises(S.ScheduleError, match=r"no schedule for 4 ranks and 8 microbatches fits a budget of 0.5 "
                                              r"units; the smallest peak is 2 units"):
        S.select(4, 8, 0.5)  # under one unit even the greedy schedule cannot run; V-Min needs 2
    for bad in (0, -1, math.inf, math.nan):
        with pytest.raises(S.ScheduleError, match="budget must be a positive number"):
            S.select(4, 8, bad)


def test_the_table_lists_every_candidate_and_why_it_was_rejected():
    sel = S.select(4, 8, 3)
    text = sel.table()
    names = set(S.available()) | {"auto"}
    assert {c.name for c in sel.candidates} == names
    for c in sel.candidates:
        assert c.name in text
    assert "over budget: peak 8 > 3 units" in text  # GPipe
    marked = [line for line in text.splitlines() if line.startswith("*")]
    assert len(marked) == 1 and sel.chosen.name in marked[0]
    # a schedule that cannot be built for (p, m) is listed with its constraint, not dropped
    small = S.select(4, 2)
    assert any(c.verdict.startswith("cannot build:") for c in small.candidates)


@pytest.mark.parametrize("costs", PROFILES, ids=["unit", "b2", "w3"])
@pytest.mark.parametrize("p,m", [(4, 8), (4, 12), (6, 12), (8, 16)])
@pytest.mark.parametrize("fraction", [1 / 2, 1 / 3])
@pytest.mark.parametrize("slack", [0, 1])
def test_half_and_third_of_1f1b(p, m, fraction, slack, costs):
    """At about a half or a third of 1F1B's memory (p units) the choice fits and is the fastest that does.

    With one unit of slack the V schedule made for that budget is among those that fit (V-Half holds at most
    ceil(p/2) + 1 units, V-Min ceil((p-1)/3) + 1), so the choice is at least as fast as it.
    """
    budget = math.ceil(p * fraction) + slack
    sel = S.select(p, m, budget, costs)
    assert sel.chosen.fits and sel.chosen.peak_units <= budget
    assert not [c for c in sel.candidates if c.fits and c.makespan < sel.chosen.makespan - 1e-9]
    by_name = {c.name: c for c in sel.candidates}
    assert by_name["1f1b"].peak_units == p and not by_name["1f1b"].fits
    if slack:
        made_for_it = by_name["v_half" if fraction == 1 / 2 else "v_min"]
        assert made_for_it.fits and sel.chosen.makespan <= made_for_it.makespan + 1e-9


def test_budget_in_bytes():
    """A bytes budget is units times the bytes of one unit: same choice, bytes in the table and the errors."""
    unit = 3 * 2**20
    by_units = S.select(4, 8, 3)
    by_bytes = S.select(4, 8, budget_bytes=3 * unit, activation_bytes=unit)
    assert by_bytes.chosen.name == by_units.chosen.name
    for c in by_bytes.candidates:
        if math.isfinite(c.peak_units):
            assert c.peak_bytes == pytest.approx(c.peak_units * unit)
    text = by_bytes.table()
    assert "peak bytes" in text and "9 MiB" in text and "over budget: peak 12 MiB > 9 MiB" in text  # 1F1B: 4 units
    assert "peak bytes" not in by_units.table()
    with pytest.raises(S.ScheduleError, match=r"fits a budget of 1 MiB; the smallest peak is 6 MiB \(2 units of 3 MiB\)"):
        S.select(4, 8, budget_bytes=2**20, activation_bytes=unit)
    with pytest.raises(S.ScheduleError, match="budget_bytes needs activation_bytes"):
        S.select(4, 8, budget_bytes=2**20)
    with pytest.raises(S.ScheduleError, match="not both"):
        S.select(4, 8, 3, budget_bytes=2**20, activation_bytes=unit)
    with pytest.raises(S.ScheduleError, match="activation_bytes must be a positive number"):
        S.select(4, 8, budget_bytes=2**20, activation_bytes=0)


def test_peak_bytes_per_stage():
    """Per-stage activation sizes weight each live activation by its stage; one number scales the counts."""
    res = S.simulate(S.build("1f1b", 2, 4))
    assert res.peak_bytes(10) == [20, 10]
    # 1F1B on 2 ranks: rank 0 holds 2 of stage 0 at its peak, rank 1 one of stage 1
    assert res.peak_bytes([100, 7]) == [200, 7]
    v = S.simulate(S.build("zbv", 2, 4))  # rank 0 holds stages 0 and 3: the peak mixes them
    # rank 0 runs 0F0 0F1 0F2 3F0 3I0 3W0 ...: three stage-0 activations and one stage-3 one at its peak of 4
    assert v.peak_activations[0] == 4
    assert v.peak_bytes([1, 1, 1, 8])[0] == 3 * 1 + 8  # not 4 * 8: the four live at once are not all stage 3
    with pytest.raises(S.ScheduleError, match="activation_bytes has 3 entries but the schedule has 4 stages"):
        v.peak_bytes([1, 2, 3])


@pytest.mark.parametrize("budget", [None, 4])
def test_a_split_costing_more_than_the_bubble_it_removes_picks_a_schedule_without_it(budget):
    """I + W = 2 against a measured whole backward B = 1.2: the split's extra 0.8 per microbatch outweighs
    the bubble ZB removes (about (p - 1)(F + B) per step against m x 0.8), so a schedule that runs B wins,
    and the reason says why with the numbers."""
    costs = S.Costs(1.0, 1.0, 1.0, 0.05, whole=1.2)
    sel = S.select(4, 8, budget, costs)
    assert not sel.chosen.splits and sel.chosen.fits
    if budget is not None:  # at 1F1B's memory: 1F1B, or DualPipeV (whole backwards but at its two ends)
        assert sel.chosen.name in ("1f1b", "interleaved_1f1b", "dualpipev")
    assert "costs more than the bubble it removes" in sel.reason
    assert "I + W = 2 against a whole backward B = 1.2 per rank share (+67%)" in sel.reason
    best_split = min((c for c in sel.candidates if c.fits and c.splits), key=lambda c: c.makespan)
    assert best_split.makespan > sel.chosen.makespan and best_split.name in sel.reason
    assert "chosen: " + sel.reason in sel.table()
    # the candidates were timed with B at its measured cost: simulate 1F1B at B = 1.2 independently
    one = next(c for c in sel.candidates if c.name == "1f1b")
    assert one.makespan == pytest.approx(S.simulate(S.build("1f1b", 4, 8), S.Costs(1.0, 1.2, 0.0, 0.05)).makespan)


def test_a_split_that_costs_less_than_the_bubble_picks_zero_bubble():
    """The same model with the split free (I + W = B = 2): zero bubble wins, and says so; at a budget only
    split schedules meet, the reason says that nothing without the split fits."""
    sel = S.select(4, 8, 4, S.Costs(1.0, 1.0, 1.0, 0.05, whole=2.0))
    assert sel.chosen.splits and sel.chosen.name == "zbv"
    assert "the I/W split pays for itself" in sel.reason and "(+0%)" in sel.reason
    tight = S.select(4, 8, 3, S.Costs(1.0, 1.0, 1.0, 0.05, whole=1.9))
    assert tight.chosen.splits and "(+5%); no schedule without the I/W split fits" in tight.reason


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 16)])
def test_the_choice_flips_where_the_split_overhead_crosses_the_bubble(p, m):
    """Sweeping the measured B from I + W down: the choice splits while the split's overhead is small, then
    stops splitting once for good, exactly where the best schedule without I/W becomes the faster one."""
    choices = []
    for whole in [2.0 - 0.05 * k for k in range(21)]:  # B from I + W = 2 down to 1
        sel = S.select(p, m, p, S.Costs(1.0, 1.0, 1.0, 0.0, whole=whole))
        best = {splits: min(c.makespan for c in sel.candidates if c.fits and c.splits == splits)
                for splits in (True, False)}
        assert sel.chosen.splits == (best[True] <= best[False])
        choices.append(sel.chosen.splits)
    assert choices[0] and not choices[-1]
    flip = choices.index(False)
    assert not any(choices[flip:])


def test_whole_defaults_to_i_plus_w():
    """Without a measured B, a B costs I + W, as before: the same makespans as whole = b + w given outright."""
    a = S.select(4, 8, None, S.Costs(1.0, 2.0, 1.0, 0.1))
    b = S.select(4, 8, None, S.Costs(1.0, 2.0, 1.0, 0.1, whole=3.0))
    assert [(c.name, c.makespan) for c in a.candidates] == [(c.name, c.makespan) for c in b.candidates]
    assert "split" not in a.reason and a.reason.startswith(a.chosen.name)


def test_measured_costs_per_rank_share_time_v_schedules_too():
    """Costs measured on a one-stage-per-rank run come as one entry per rank share; a schedule with two stages
    per rank gets each share's entry, halved, on both stages in it: the same times as the numbers themselves."""
    listed = S.select(2, 8, None, S.Costs([1.0, 1.0], [1.0, 1.0], [1.0, 1.0], 0.05, whole=[1.2, 1.2]))
    plain = S.select(2, 8, None, S.Costs(1.0, 1.0, 1.0, 0.05, whole=1.2))
    assert [(c.name, c.makespan) for c in listed.candidates] == [(c.name, c.makespan) for c in plain.candidates]


def test_with_fsdp_parameters_the_peak_adds_what_a_budget_lets_a_rank_hold():
    """P = 10 bytes of parameters per rank, FSDP-sharded, one stage gathered at a time: a rank with one stage holds
    2P (its parameters and its unsharded gradients), one with two stages 1.5P; at 18 bytes only the two-stage
    schedules fit, DualPipeV (its pairs need two stages at once) is rejected saying why."""
    sel = S.select(2, 8, budget_bytes=18, activation_bytes=1, param_bytes=10, max_active_stages=1)
    by_name = {c.name: c for c in sel.candidates}
    assert sel.chosen.stages_per_rank == 2 and sel.chosen.fits
    assert by_name["1f1b"].peak_bytes == by_name["1f1b"].peak_units + 20 and not by_name["1f1b"].fits
    assert "parameters and gradients 20 B" in by_name["1f1b"].verdict
    assert by_name["zbv"].peak_bytes == by_name["zbv"].peak_units + 15 and by_name["zbv"].fits
    assert by_name["dualpipev"].verdict.startswith("cannot run under max_active_stages=1")
    with pytest.raises(S.ScheduleError, match="param_bytes"):
        S.select(2, 8, param_bytes=10)
