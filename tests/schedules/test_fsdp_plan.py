"""FSDP parameter placement: UNSHARD / RESHARD / REDUCE_GRAD in the IR, the Belady planner, its checks and costs.

What the planner promises is checked here by walks of the test's own, not by
the validator: the budget holds at every point of every rank's list, every
compute action finds its stage unsharded, each stage's gradients are
reduce-scattered once after its last B or W, and the number of all-gathers
is the fewest any placement reaches (brute force on small cases).
"""
from __future__ import annotations

import functools
import math

import pytest

from pipeline_ext import schedules as S
from pipeline_ext.schedules import Action, ActionKind, Costs, Schedule, ScheduleError
from pipeline_ext.schedules.builtin import _REGISTRY
from pipeline_ext.schedules.fsdp import Budget, all_gathers_per_rank, plan_fsdp, strip_fsdp, unshard_counts
from pipeline_ext.schedules.ir import FSDP_KINDS, NO_MICROBATCH
from pipeline_ext.schedules.validate import check_fsdp

UNSHARD, RESHARD, REDUCE_GRAD = ActionKind.UNSHARD, ActionKind.RESHARD, ActionKind.REDUCE_GRAD
GRAD_WRITES = (ActionKind.B, ActionKind.W)


def _cases():
    """(name, p, m, v): every built-in at stages per rank 2 and 4 where it takes them, else its own v."""
    for name in S.available():
        _, default_v, multi = _REGISTRY[name]
        for v in ((2, 4) if multi else (default_v,)):
            yield name, 2, 8, v


CASES = list(_cases())


def _units(schedule: Schedule, acts: list[Action]) -> list[tuple[int, ...]]:
    """The stages each compute unit needs at once (an overlapped pair: both of its stages)."""
    second_of = dict(schedule.overlapped)
    units, prev = [], None
    for a in acts:
        if not a.is_compute:
            continue
        if prev is not None and second_of.get(prev) == a:
            units[-1] = tuple(sorted({*units[-1], a.stage}))
        else:
            units.append((a.stage,))
        prev = a
    return units


def _walk(schedule: Schedule, budget):
    """The test's own reading of a planned schedule: raise AssertionError on any broken promise.

    Returns the all-gathers per rank and the most stages active at once per rank.
    """
    gathers, most = [], []
    for rank, acts in enumerate(schedule.actions):
        active: set[int] = set()
        peak = 0
        reduced: dict[int, int] = {}
        last_write = {a.stage: i for i, a in enumerate(acts) if a.kind in GRAD_WRITES}
        for i, a in enumerate(acts):
            if a.kind is UNSHARD:
                assert a.stage not in active, f"rank {rank} pos {i}: {a} of an active stage"
                active.add(a.stage)
                peak = max(peak, len(active))
                assert budget is None or len(active) <= budget, f"rank {rank} pos {i}: {sorted(active)} > {budget}"
            elif a.kind is RESHARD:
                active.remove(a.stage)
            elif a.kind is REDUCE_GRAD:
                assert a.stage not in reduced, f"rank {rank}: two REDUCE_GRADs of stage {a.stage}"
                assert last_write[a.stage] < i, f"rank {rank}: {a} at {i} before the last B/W at {last_write[a.stage]}"
                reduced[a.stage] = i
            elif a.is_compute:
                assert a.stage in active, f"rank {rank} pos {i}: {a} on a sharded stage"
        assert set(reduced) == set(last_write), f"rank {rank}: REDUCE_GRAD of {sorted(reduced)}, B/W of " \
                                                f"{sorted(last_write)}"
        assert not active, f"rank {rank} ends with {sorted(active)} unsharded"
        gathers.append(sum(a.kind is UNSHARD for a in acts))
        most.append(peak)
    return gathers, most


def _fewest_gathers(units: list[tuple[int, ...]], budget: int) -> int:
    """The fewest all-gathers any placement needs for ``units`` under ``budget`` active stages (brute force).

    Every choice of which active stage to free at every miss is tried (memoised on the position and the active
    set); gathering only on a miss loses nothing, since a gather ahead of need can be moved to the need.
    """
    flat = [(k, s) for k, u in enumerate(units) for s in u]

    @functools.lru_cache(maxsize=None)
    def best(i: int, active: frozenset) -> int:
        if i == len(flat):
            return 0
        k, s = flat[i]
        if s in active:
            return best(i + 1, active)
        if len(active) < budget:
            return 1 + best(i + 1, active | {s})
        return 1 + min(best(i + 1, (active - {x}) | {s}) for x in active if x not in units[k])

    return best(0, frozenset())


@pytest.mark.parametrize("name,p,m,v", CASES, ids=[f"{c[0]}-v{c[3]}" for c in CASES])
def test_every_builtin_plans_within_every_budget(name, p, m, v):
    plain = S.build(name, p, m, v)
    lowered = S.lower(plain)
    counts = {}
    for budget in [*range(1, v + 1), None]:
        if budget == 1 and plain.overlapped:
            with pytest.raises(ScheduleError, match=rf"schedule '{name}', rank \d: max_active_stages=1 is too "
                                                    r"small for the overlapped pair \(\d+B\d+;\d+F\d+\)"):
                plan_fsdp(plain, budget)
            continue
        planned = plan_fsdp(plain, budget)
        S.validate(planned, max_active_stages=budget)
        S.validate(S.lower(planned), max_active_stages=budget)
        assert plan_fsdp(lowered, budget) == S.lower(planned), "planning before or after lowering differs"
        assert strip_fsdp(planned) == plain, "the compute order changed"
        gathers, most = _walk(planned, budget)
        counts[budget] = gathers
        assert gathers == all_gathers_per_rank(planned) == S.simulate(planned).all_gathers
        if budget is None or budget >= v:  # room for every stage: one all-gather per stage per step
            assert unshard_counts(planned) == {s: 1 for s in range(plain.num_stages)}
            assert most == [v] * p
    budgets = sorted(b for b in counts if b is not None)
    for lo, hi in zip(budgets, budgets[1:]):
        assert all(x >= y for x, y in zip(counts[lo], counts[hi])), f"{name}: more all-gathers with more budget " \
                                                                    f"({counts})"


@pytest.mark.parametrize("name,v", [("interleaved_1f1b", 3), ("interleaved_zb", 4), ("looped_bfs", 3),
                                    ("zbv", 2), ("interleaved_1f1b", 4)])
def test_all_gathers_are_the_fewest_any_placement_needs(name, v):
    plain = S.build(name, 2, 4, v)
    for budget in range(1, v + 1):
        planned = plan_fsdp(plain, budget)
        for rank, acts in enumerate(plain.actions):
            fewest = _fewest_gathers(_units(plain, acts), budget)
            assert all_gathers_per_rank(planned)[rank] == fewest, (name, v, budget, rank)


def test_dualpipev_pairs_get_both_stages():
    plain = S.build("dualpipev", 2, 8)
    planned = plan_fsdp(plain, 2)
    _walk(planned, 2)
    for first, second in planned.overlapped:  # nothing between a pair's halves: they run as one unit
        for acts in planned.actions:
            if first in acts:
                assert acts.index(second) == acts.index(first) + 1


def _torch_policy_gathers(acts: list[Action], n: int) -> int:
    """torch 2.13's ``_add_unshard_reshard``, counted: before each compute action its next n distinct stages are
    unsharded, any other resharded (checked against torch's own function when written: same counts on
    interleaved 1F1B, interleaved ZB, looped BFS and ZB-V)."""
    compute = [a for a in acts if a.is_compute]
    active: set[int] = set()
    gathers = 0
    for i in range(len(compute)):
        upcoming: list[int] = []
        for a in compute[i:]:
            if a.stage not in upcoming:
                upcoming.append(a.stage)
                if len(upcoming) == n:
                    break
        active &= set(upcoming)
        gathers += len(set(upcoming) - active)
        active |= set(upcoming)
    return gathers


def test_fewer_all_gathers_than_torchs_lookahead_policy():
    plain = S.build("interleaved_1f1b", 2, 8, 4)
    ours = all_gathers_per_rank(plan_fsdp(plain, 3))
    torch_way = [_torch_policy_gathers(acts, 3) for acts in plain.actions]
    message = (f"interleaved 1F1B, 2 ranks x 4 stages, 8 microbatches, budget 3: all-gathers per rank ours {ours}, "
               f"torch 2.13's next-3-stages policy {torch_way}")
    assert all(o < t for o, t in zip(ours, torch_way)), message
    assert ours == [11, 11] and torch_way == [15, 13], message
    by_budget = {n: all_gathers_per_rank(plan_fsdp(plain, n)) for n in (1, 2, 3, 4)}
    assert by_budget == {1: [51, 37], 2: [18, 18], 3: [11, 11], 4: [4, 4]}, by_budget


def test_prefetch_moves_the_gather_one_compute_action_early_without_changing_the_count():
    plain = S.build("interleaved_1f1b", 2, 8, 4)
    for budget in (2, 3, None):
        early, late = plan_fsdp(plain, budget), plan_fsdp(plain, budget, prefetch=False)
        assert all_gathers_per_rank(early) == all_gathers_per_rank(late)
        S.validate(late, max_active_stages=budget)
        for acts in late.actions:  # without prefetch each UNSHARD is right before its stage's compute action
            for i, a in enumerate(acts):
                if a.kind is UNSHARD:
                    nxt = next(b for b in acts[i + 1:] if b.is_compute)
                    assert nxt.stage == a.stage or acts[i + 1].kind is UNSHARD, (i, a, nxt)
    row = plan_fsdp(plain).actions[0]  # no budget: stage 2's gather goes before 0F1, the action before 2F0
    assert [str(a) for a in row[:5]] == ["0UNSHARD", "0F0", "2UNSHARD", "0F1", "2F0"]
    planned = plan_fsdp(plain)  # ... and each stage is freed right after its REDUCE_GRAD
    for acts in planned.actions:
        for i, a in enumerate(acts):
            if a.kind is REDUCE_GRAD:
                assert acts[i + 1] == Action.fsdp(a.stage, RESHARD)


def test_byte_budget():
    plain = S.build("interleaved_1f1b", 2, 8, 4)
    sizes = [4.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 1.0]  # stage 0 (an embedding) and stage 6 are larger
    planned = plan_fsdp(plain, max_unsharded_bytes=6.0, stage_bytes=sizes)
    S.validate(planned, max_unsharded_bytes=6.0, stage_bytes=sizes)
    for acts in planned.actions:
        held = 0.0
        for a in acts:
            held += {UNSHARD: sizes[a.stage], RESHARD: -sizes[a.stage]}.get(a.kind, 0.0)
            assert held <= 6.0
    with pytest.raises(ScheduleError, match=r"rank 0: max_unsharded_bytes=3 is too small for stage 0: it needs 4 "):
        plan_fsdp(plain, max_unsharded_bytes=3.0, stage_bytes=sizes)
    with pytest.raises(ScheduleError, match=r"over the budget \(max_unsharded_bytes=5\)"):
        S.validate(planned, max_unsharded_bytes=5.0, stage_bytes=sizes)
    pairs = S.build("dualpipev", 2, 8)
    with pytest.raises(ScheduleError, match=r"too small for the overlapped pair .* \(3 bytes\)"):
        plan_fsdp(pairs, max_unsharded_bytes=2.0, stage_bytes=[1.0, 1.0, 2.0, 2.0])


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_active_stages=0), r"schedule 'interleaved_1f1b': max_active_stages=0 is below 1"),
    (dict(max_active_stages=2, max_unsharded_bytes=10.0, stage_bytes=1.0), "not both"),
    (dict(max_unsharded_bytes=10.0), "max_unsharded_bytes needs stage_bytes"),
    (dict(max_unsharded_bytes=10.0, stage_bytes=[1.0, 2.0]), "stage_bytes has 2 entries but the schedule has 4"),
    (dict(max_active_stages=1.5), "must be an integer"),
])
def test_bad_budgets_are_refused_by_name(kwargs, match):
    with pytest.raises(ScheduleError, match=match):
        plan_fsdp(S.build("interleaved_1f1b", 2, 4), **kwargs)


def test_a_planned_schedule_is_not_planned_twice():
    planned = plan_fsdp(S.build("zbv", 2, 4))
    with pytest.raises(ScheduleError, match="already has UNSHARD/RESHARD/REDUCE_GRAD actions; plan strip_fsdp"):
        plan_fsdp(planned, 1)
    assert plan_fsdp(strip_fsdp(planned), 1) == plan_fsdp(S.build("zbv", 2, 4), 1)


def test_spelling_and_text_round_trip():
    a = Action.parse("3UNSHARD")
    assert a == Action(3, UNSHARD, NO_MICROBATCH) == Action.fsdp(3, UNSHARD) and str(a) == "3UNSHARD"
    assert a.is_fsdp and not a.is_compute and not a.is_comm and FSDP_KINDS == {UNSHARD, RESHARD, REDUCE_GRAD}
    assert str(Action.parse("12REDUCE_GRAD")) == "12REDUCE_GRAD" and str(Action.parse("0RESHARD")) == "0RESHARD"
    with pytest.raises(ScheduleError, match="cannot parse action '0UNSHARD2': UNSHARD acts on a stage for the whole"):
        Action.parse("0UNSHARD2")
    with pytest.raises(ScheduleError, match="cannot parse action '0F': F needs a microbatch"):
        Action.parse("0F")
    with pytest.raises(ScheduleError, match="names microbatch 1, but UNSHARD acts on the whole step"):
        S.validate(Schedule([[Action(0, UNSHARD, 1), Action(0, ActionKind.F, 0)]], [0], 2))
    for planned in (plan_fsdp(S.build("interleaved_zb", 2, 4), 1), S.lower(plan_fsdp(S.build("dualpipev", 2, 4)))):
        back = Schedule.from_text(planned.to_text())
        assert back == planned and back.to_text() == planned.to_text()


def test_csv_round_trip(tmp_path):
    path = tmp_path / "planned.csv"
    for planned in (S.lower(plan_fsdp(S.build("interleaved_zb", 2, 4, 4), 2)), plan_fsdp(S.build("zbv", 2, 4), 1)):
        S.dump_csv(planned, str(path), format="compute_comms")
        assert "0UNSHARD" in path.read_text() and "1REDUCE_GRAD" in path.read_text()
        assert S.load_csv(str(path), format="compute_comms", name=planned.name) == planned
    planned = S.lower(plan_fsdp(S.build("dualpipev", 2, 4), 2))  # a pair's messages go around it, as torch's
    S.dump_csv(planned, str(path), format="compute_comms")
    back = S.load_csv(str(path), format="compute_comms", name=planned.name)
    assert back == S.lowering.as_units(planned) and back.overlapped == planned.overlapped
    S.validate(back, max_active_stages=2)
    S.dump_csv(planned, str(path))  # compute_only: what torch's loader takes, its FSDP actions its own
    assert "UNSHARD" not in path.read_text()
    rows = [["0UNSHARD", "0F0", "", "0B0", "0REDUCE_GRAD", "0RESHARD"]]  # a torch row, idle slot included
    sched = S.from_cells(rows)
    assert [str(a) for a in sched.actions[0]] == ["0UNSHARD", "0F0", "0B0", "0REDUCE_GRAD", "0RESHARD"]
    S.validate(sched, max_active_stages=1)


@pytest.mark.parametrize("text,match", [
    ("0F0 0B0 0UNSHARD 0RESHARD", r"rank 0, position 0: action 0F0 computes on stage 0, whose parameters are "
                                  r"sharded here \(never unsharded before it\); put 0UNSHARD before it"),
    ("0UNSHARD 0F0 0RESHARD 0B0 0REDUCE_GRAD", r"rank 0, position 3: action 0B0 computes on stage 0, whose "
                                               r"parameters are sharded here \(resharded at position 2\)"),
    ("0UNSHARD 0UNSHARD 0F0 0B0 0REDUCE_GRAD 0RESHARD", r"rank 0, position 1: action 0UNSHARD unshards stage 0, "
                                                        r"which is already unsharded \(since position 0\)"),
    ("0UNSHARD 0F0 0B0 0REDUCE_GRAD 0RESHARD 0RESHARD", r"rank 0, position 5: action 0RESHARD reshards stage 0, "
                                                        "which is not unsharded here"),
    ("0UNSHARD 0F0 0REDUCE_GRAD 0B0 0RESHARD", r"position 2: action 0REDUCE_GRAD comes before the stage's last "
                                               r"gradient write 0B0 at position 3"),
    ("0UNSHARD 0F0 0B0 0REDUCE_GRAD 0REDUCE_GRAD 0RESHARD", r"position 4: action 0REDUCE_GRAD is a second "
                                                            r"REDUCE_GRAD of stage 0 in the step \(the first at "
                                                            r"position 3\)"),
    ("0UNSHARD 0F0 0B0 0RESHARD", r"rank 0: stage 0 writes gradients \(last at position 2, 0B0\) but has no "
                                  "0REDUCE_GRAD after it"),
    ("0UNSHARD 0F0 0B0 0REDUCE_GRAD", r"rank 0: the step ends with stage 0 unsharded \(since its 0UNSHARD at "
                                      r"position 0\)"),
    ("0UNSHARD 0F0 0I0 0REDUCE_GRAD 0W0 0RESHARD", r"position 3: action 0REDUCE_GRAD comes before the stage's "
                                                   r"last gradient write 0W0 at position 4"),  # W writes, I not
])
def test_validator_names_misplaced_fsdp_actions(text, match):
    with pytest.raises(ScheduleError, match=match):
        S.validate(Schedule.from_text(text))


def test_validator_budget_pairs_and_forward_only():
    two = Schedule.from_text("0UNSHARD 2UNSHARD 0F0 2F0 2B0 2REDUCE_GRAD 2RESHARD 0B0 0REDUCE_GRAD 0RESHARD\n"
                             "1UNSHARD 1F0 1B0 1REDUCE_GRAD 1RESHARD\n"
                             "# schedule stage_to_rank=0,1,0")
    S.validate(two, max_active_stages=2)
    with pytest.raises(ScheduleError, match=r"rank 0, position 1: action 2UNSHARD makes stages \[0, 2\] unsharded "
                                            r"at once, over the budget \(max_active_stages=1\)"):
        S.validate(two, max_active_stages=1)
    with pytest.raises(ScheduleError, match="computes on stage 0, whose parameters are sharded"):
        S.validate(S.build("1f1b", 2, 2), max_active_stages=1)  # a budget needs the placement
    pairs = plan_fsdp(S.build("dualpipev", 2, 4), 2)
    first, second = pairs.overlapped[0]
    rank = pairs.stage_to_rank[first.stage]
    row = pairs.actions[rank]
    i = row.index(first)
    row.insert(i + 1, Action.fsdp(first.stage, RESHARD))
    with pytest.raises(ScheduleError, match=rf"rank {rank}, position {i + 1}: action {first.stage}RESHARD sits "
                                            "between the two halves of an overlapped pair"):
        S.validate(pairs)
    # forward-only (an eval step; validate wants backwards, check_fsdp is the placement's part of it)
    forward = plan_fsdp(S.forward_only(S.build("interleaved_1f1b", 2, 4)), 1)
    assert not any(a.kind is REDUCE_GRAD for acts in forward.actions for a in acts)
    assert _walk(forward, 1)[1] == [1, 1]
    check_fsdp(forward, Budget(max_active_stages=1))
    with pytest.raises(ScheduleError, match="stage 0 has no B or W on rank 0, so no gradients to reduce"):
        check_fsdp(Schedule.from_text("0UNSHARD 0F0 0REDUCE_GRAD 0RESHARD"))


def test_lowering_keeps_fsdp_actions_in_place_and_deadlock_checks_pass_over_them():
    planned = plan_fsdp(S.build("1f1b", 2, 2))
    low = S.lower(planned)
    assert low.to_text().splitlines()[1:] == [
        "0UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0REDUCE_GRAD 0RESHARD",
        "1UNSHARD 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1REDUCE_GRAD 1RESHARD",
    ]
    S.check_deadlock(low)
    S.validate(low)
    report = S.check_fifo_order(plan_fsdp(S.build("interleaved_1f1b", 2, 4), 1),
                                collectives=S.Collectives(dp=2, dp_kind="fsdp"))
    assert report.ok


def test_simulated_memory_matches_the_hand_count():
    """Interleaved 1F1B, 2 ranks x 4 stages of P/4 parameter bytes each, 8 microbatches.

    Each stage writes its gradients from its first B to its REDUCE_GRAD, and on each rank every stage's first B
    comes before the first REDUCE_GRAD (6B0 ... 0B0 early in the steady phase, the REDUCE_GRADs in the drain), so
    P of gradients are held at once. The parameters add the budget's stages: with budget N, N * P/4 (the rank
    is at its budget when its last stage starts writing gradients), P with no budget.
    """
    plain = S.build("interleaved_1f1b", 2, 8, 4)
    P = 4.0
    costs = Costs(param_bytes=P / 4)
    for rank, acts in enumerate(plan_fsdp(plain, 2).actions):  # the fact the hand count rests on
        first_write = max(next(i for i, a in enumerate(acts) if a.kind is ActionKind.B and a.stage == s)
                          for s in plain.stages_of(rank))
        assert first_write < next(i for i, a in enumerate(acts) if a.kind is REDUCE_GRAD)
    for budget, params in ((1, 0.25 * P), (2, 0.5 * P), (3, 0.75 * P), (4, P), (None, P)):
        res = S.simulate(plan_fsdp(plain, budget), costs)
        assert res.peak_unsharded_params == [params, params], budget
        assert res.peak_unsharded_bytes == [params + P, params + P], budget
    unplanned = S.simulate(plain, costs)
    assert unplanned.peak_unsharded_bytes == [0.0, 0.0] and unplanned.all_gathers == [0, 0]


def test_simulated_time_waits_for_all_gathers_and_reduce_scatters():
    one = Schedule.from_text("0UNSHARD 0F0 0B0 0REDUCE_GRAD 0RESHARD")
    res = S.simulate(one, Costs(f=1.0, b=1.0, w=1.0, unshard=2.0, reduce_grad=3.0, param_bytes=10.0))
    assert [(s.action, s.start, s.end) for s in res.timeline] == [(Action(0, ActionKind.F, 0), 2.0, 3.0),
                                                                 (Action(0, ActionKind.B, 0), 3.0, 5.0)]
    assert [(str(s.action), s.start, s.end) for s in res.fsdp_timeline] == [
        ("0UNSHARD", 0.0, 2.0), ("0REDUCE_GRAD", 5.0, 8.0), ("0RESHARD", 5.0, 5.0)]
    assert res.makespan == 8.0 and res.bubble_rate == pytest.approx(5 / 8)
    assert res.peak_unsharded_bytes == [20.0] and res.peak_unsharded_params == [10.0]
    derived = Costs(param_bytes=10.0, fsdp_bandwidth=5.0)  # times from bytes: 10 / 5 = 2 each
    assert derived.all_gather(0) == derived.reduce_scatter(0) == 2.0
    split = Costs(param_bytes=[2.0, 4.0], unshard=[1.0, 2.0], fsdp_bandwidth=3.0).per_stage_of(2)
    assert (split.param_bytes, split.unshard, split.fsdp_bandwidth) == ([1.0, 2.0], [0.5, 1.0], 3.0)
    plain = S.build("interleaved_zb", 2, 8, 4)  # collectives that take no time change nothing
    base, planned = S.simulate(plain), S.simulate(plan_fsdp(plain, 2))
    assert planned.timeline == base.timeline and planned.makespan == base.makespan
    assert planned.bubble_rate == base.bubble_rate
    slow = S.simulate(plan_fsdp(plain, 2), Costs(unshard=0.5))
    assert slow.makespan > base.makespan and not math.isclose(slow.bubble_rate, base.bubble_rate)


def test_render_shows_the_fsdp_stream(tmp_path):
    res = S.simulate(plan_fsdp(S.build("interleaved_1f1b", 2, 4), 1), Costs(unshard=0.5, reduce_grad=0.5))
    text = S.render_ascii(res)
    assert "fsdp 0 |0AG" in text and "1RS" in text
    assert "fsdp" not in S.render_ascii(S.build("interleaved_1f1b", 2, 4))
    trace = S.to_chrome_trace(res, str(tmp_path / "t.json"))
    names = {e["name"]: e for e in trace["traceEvents"] if e.get("cat") in ("UNSHARD", "RESHARD", "REDUCE_GRAD")}
    assert names["0RESHARD"]["ph"] == "i" and names["0UNSHARD"]["dur"] == 500.0
    assert names["0UNSHARD"]["tid"] == 2  # the tracks after the ranks' own
