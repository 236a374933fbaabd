"""The section-4 timing model: the Zero Bubble paper's numbers, costs per stage, memory."""
from __future__ import annotations

import pytest

from pipeline_ext.schedules import ActionKind, Costs, Schedule, ScheduleError, build, lower, simulate

PAPER = {  # Qi et al., ICLR 2024, bubble-rate table
    (8, 24, Costs(18.522, 18.086, 9.337, 0.601)): {"1f1b": 0.2431, "zb_h1": 0.1585, "zb_h2": 0.1083},
    (16, 64, Costs(11.307, 11.254, 8.101, 0.379)): {"1f1b": 0.2082, "zb_h1": 0.1088, "zb_h2": 0.0516},
}


@pytest.mark.parametrize("p,m,costs", list(PAPER))
def test_zero_bubble_paper_numbers(p, m, costs):
    for name, expected in PAPER[(p, m, costs)].items():
        assert round(simulate(build(name, p, m), costs).bubble_rate, 4) == expected, name


def test_lowered_and_unlowered_simulate_identically():
    costs = Costs(18.522, 18.086, 9.337, 0.601)
    for name in ("zb_h1", "zbv", "interleaved_1f1b"):
        s = build(name, 4, 8)
        a, b = simulate(s, costs), simulate(lower(s), costs)
        assert a.timeline == b.timeline and a.bubble_rate == b.bubble_rate


def test_timeline_respects_the_model():
    """Every start is max(rank free, producer end + c across ranks); the result is tight."""
    costs = Costs(f=2.0, b=3.0, w=1.0, comm=0.5)
    res = simulate(build("zbv", 3, 6), costs)
    placement = res.schedule.stage_to_rank
    end = {(s.action.stage, "B" if s.action.kind in (ActionKind.B, ActionKind.I) else s.action.kind.value,
            s.action.microbatch): s for s in res.timeline}
    last_stage = res.schedule.num_stages - 1
    for rank in range(3):
        spans = res.spans_of(rank)
        for prev, cur in zip([None] + spans, spans):
            st, kind, j = cur.action
            ready = 0.0
            if kind is ActionKind.F and st > 0:
                dep = end[(st - 1, "F", j)]
            elif kind in (ActionKind.B, ActionKind.I):
                dep = end[(st, "F", j)] if st == last_stage else end[(st + 1, "B", j)]
            else:
                dep = None
            if dep is not None:
                ready = dep.end + (0.5 if placement[dep.action.stage] != rank else 0.0)
            assert cur.start == pytest.approx(max(prev.end if prev else 0.0, ready))
            assert cur.end - cur.start == {"F": 2.0, "I": 3.0, "W": 1.0, "B": 4.0}[kind.value]


def test_per_stage_costs_and_non_uniform_bubble():
    s = build("1f1b", 2, 4)
    res = simulate(s, Costs(f=[1.0, 3.0], b=[1.0, 3.0], w=0.0, comm=[0.0, 0.0]))
    # Rank 1 (busy 24) never idles once started at t=1; rank 0 (busy 8) spans T = 1 + 24 + 1 = 26.
    spans = res.spans_of(1)
    assert spans[-1].end - spans[0].start == pytest.approx(24.0)
    assert res.bubble_rate_per_rank == pytest.approx([18 / 26, 2 / 26])
    assert res.bubble_rate == pytest.approx(sum(res.bubble_rate_per_rank) / 2)
    with pytest.raises(ScheduleError, match="costs.f has 1 entries but the schedule has stage 1"):
        simulate(s, Costs(f=[1.0]))
    with pytest.raises(ScheduleError, match="must be >= 0"):
        simulate(s, Costs(w=-1.0))


def test_costs_parse_and_split():
    assert Costs.parse("1,2,0.5,0.1") == Costs(1.0, 2.0, 0.5, 0.1)
    with pytest.raises(ScheduleError, match="four numbers"):
        Costs.parse("1,2")
    assert Costs(2.0, [4.0, 6.0], 1.0, 0.3).per_stage_of(2) == Costs(1.0, [2.0, 3.0], 0.5, 0.3)


def test_peak_activations_follow_f_and_b_or_w():
    s = Schedule.from_text("0F0 0F1 0I0 0F2 0W0 0I1 0W1 0I2 0W2\n")
    assert simulate(s).peak_activations == [3]  # W frees, I does not
    s = Schedule.from_text("0F0 0B0 0F1 0F2 0B1 0B2\n")
    assert simulate(s).peak_activations == [2]


def test_unrunnable_schedule_raises():
    s = Schedule.from_text("0F0 0B0\n1B0 1F0\n")  # I before F on stage 1 -> rank 0 waits forever
    with pytest.raises(ScheduleError, match="cannot run: rank 0 stuck at position 1 on 0B0 waiting for 1B0"):
        simulate(s)


def test_makespan_and_unit_closed_form_example():
    res = simulate(build("1f1b", 4, 8))
    assert res.makespan == 33.0 and res.bubble_rate == pytest.approx(9 / 33)
    assert res.timeline[0].rank == 0 and res.timeline[0].start == 0.0
