"""The greedy auto-scheduler against ZB-H1 on the Zero Bubble paper's cost profiles."""
from __future__ import annotations

import pytest

from pipeline_ext.schedules import Costs, ScheduleError, auto, build, lower, simulate, validate

PROFILES = [(8, 24, Costs(18.522, 18.086, 9.337, 0.601)), (16, 64, Costs(11.307, 11.254, 8.101, 0.379))]


@pytest.mark.parametrize("p,m,costs", PROFILES)
def test_auto_vs_zb_h1(p, m, costs):
    h1 = simulate(build("zb_h1", p, m), costs).bubble_rate
    loose = auto(p, m, costs, 2 * p)
    tight = auto(p, m, costs, p)
    for s, limit in ((loose, 2 * p), (tight, p)):
        validate(s)
        validate(lower(s))
        assert max(simulate(s, costs).peak_activations) <= limit
    assert simulate(loose, costs).bubble_rate < h1 - 0.01
    assert simulate(tight, costs).bubble_rate <= h1 + 1e-9


def test_auto_small_cases_and_errors():
    for p, m, limit in [(1, 3, 1), (3, 2, 1), (4, 8, 4), (4, 8, 8), (2, 5, 3)]:
        s = auto(p, m, Costs(), limit)
        validate(lower(s))
        assert s.name == "auto" and max(simulate(s).peak_activations) <= limit
    assert simulate(auto(4, 8, Costs(), 8)).bubble_rate == pytest.approx(0.0)
    with pytest.raises(ScheduleError, match="max_activations >= 1"):
        auto(2, 2, Costs(), 0)
