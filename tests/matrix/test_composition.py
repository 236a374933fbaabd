"""The composition matrix (``composition.py``): every pair of features meets every schedule family, exact.

The design is checked without running anything (coverage, constraints,
determinism). A quick slice runs in the default tier; the whole matrix runs
under the ``matrix`` marker (``python -m pytest -m matrix``, which CI runs).
"""
from __future__ import annotations

import pytest

import composition as C
from mp_pool import shutdown_pools
from mp_utils import run_ranks


def _run(cases: list[dict], timeout: float) -> list[str]:
    """Every case, grouped by world size; the complaints of every rank, each prefixed with its case."""
    from composition_case import run_group, run_pipe_case

    bad: list[str] = []
    for world, group in C.iter_groups(cases):
        if world == 1:
            for case in group:
                bad += [f"{C.case_id(case)}: {b}" for b in run_pipe_case(case)]
            continue
        results = run_ranks(run_group, world, group, timeout=timeout)
        for _, (_, per_case) in sorted(results.items()):
            bad += [f"{cid}: {b}" for cid, complaints in per_case for b in complaints]
    return bad


def _summary(bad: list[str]) -> str:
    """The failing cases first (one line each, with their count of complaints), then the first complaints."""
    failing: dict[str, int] = {}
    for b in bad:
        cid = b.split(": ", 1)[0]
        failing[cid] = failing.get(cid, 0) + 1
    head = [f"{len(failing)} case(s) failed:"] + [f"  {cid} ({n} complaints)" for cid, n in failing.items()]
    return "\n".join(head + ["first complaints:"] + bad[:30])


def test_every_pair_of_features_meets_every_family_and_constraints_hold():
    for family in C.FAMILIES:
        cases = C.generate(family)
        covered = set().union(*(C.pairs_of(c) for c in cases))
        missing = C.required_pairs(family) - covered
        assert not missing, f"{family}: pairs never met: {sorted(missing, key=repr)[:5]}"
        assert all(C.allowed(family, c) for c in cases)
        assert C.generate(family) == cases  # deterministic: the same cases in every run


@pytest.mark.parametrize("design", list(C.DESIGNS))
def test_every_pair_of_features_meets_each_design_in_every_family_that_runs_it(design):
    d = C.DESIGNS[design]
    for family in C.FAMILIES:
        cases = C.generate(family, design)
        if family not in d.families:  # refused by name (tests/seqchunks, tests/parallel)
            assert cases == []
            continue
        assert cases and all(c[f] == level for c in cases for f, level in d.fixed.items())
        covered = set().union(*(C.pairs_of(c) for c in cases))
        missing = C.required_pairs(family, design) - covered
        assert not missing, f"{family} in {design}: pairs never met: {sorted(missing, key=repr)[:5]}"
        assert all(C.allowed(family, c, design) and c["front"] == "stage" for c in cases)
        assert C.generate(family, design) == cases


@pytest.mark.timeout(300)
def test_quick_slice_of_the_matrix_is_exact():
    bad = _run(C.quick_cases(), timeout=280)
    assert not bad, _summary(bad)


@pytest.mark.parametrize("family", list(C.FAMILIES))
@pytest.mark.matrix
@pytest.mark.timeout(1200)
def test_composition_matrix(family):
    bad = _run(C.generate(family), timeout=1100)
    assert not bad, _summary(bad)


@pytest.mark.parametrize("design,family", [(d, f) for d in C.DESIGNS for f in C.DESIGNS[d].families])
@pytest.mark.matrix
@pytest.mark.timeout(1200)
def test_composition_matrix_designs(design, family):
    # on fresh rank processes: in one run of the whole tier, the last design (pieces under the budget) ran past
    # its 1200 s on the processes that had run the base design and the other designs first, while it takes
    # about 3 minutes on fresh ones, alone or after the other designs (the cause is not known yet)
    shutdown_pools()
    bad = _run(C.generate(family, design), timeout=1100)
    assert not bad, _summary(bad)
