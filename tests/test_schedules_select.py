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
                                              r"units; the smallest peak is 4 units"):
        S.select(4, 8, 0.5)  # under one unit even the greedy schedule cannot run; the built-ins need 4
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
