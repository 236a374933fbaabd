"""Sequence pieces in the schedule layer (``schedules/pieces.py``): the orders, their check, the cut, the costs.

No processes: the generators' orders validated with their piece constraints
(and a broken order refused by name), the built-ins unchanged at one piece,
the cut's lengths and the cost model behind them, and the simulator charging
each piece its own cost and holding each piece's own activations, against
hand-built replays and brute force.
"""
from __future__ import annotations

import itertools

import pytest

from pipeline_ext import schedules as S
from pipeline_ext.runtime.trace import TraceReport, measure_costs, replay
from pipeline_ext.schedules.ir import Action, ActionKind, Schedule, ScheduleError
from pipeline_ext.schedules.validate import validate
from pipeline_ext.schedules.pieces import (PIECE_SCHEDULES, attention_share, build_pieces,
                                           piece_costs, piece_lengths, piece_sizes)

F, B = ActionKind.F, ActionKind.B


def _cases():
    for name in PIECE_SCHEDULES:
        for p, k in itertools.product((2, 3, 4), (1, 2, 3, 4)):
            for m in (p, 2 * p):
                yield name, p, m, k


@pytest.mark.parametrize("name,p,m,k", list(_cases()))
def test_every_order_over_pieces_is_valid_with_its_piece_constraints(name, p, m, k):
    sched = build_pieces(name, p, m, k)
    assert sched.n_microbatches == m * k
    S.validate(sched, pieces=k)
    S.validate(S.lower(sched), pieces=k)  # what the runtime executes: deadlock- and FIFO-checked too


@pytest.mark.parametrize("name", sorted(PIECE_SCHEDULES))
def test_one_piece_is_the_builtin_itself(name):
    assert build_pieces(name, 4, 8, 1).actions == S.build(name, 4, 8).actions


@pytest.mark.parametrize("name", sorted(PIECE_SCHEDULES))
def test_a_schedule_over_pieces_says_so_through_every_transformation(name):
    """Consumers ask the schedule whether it runs pieces (the Pipe refuses it, the multi-process schedules cut
    that many, validate checks their order): ``pieces`` must survive lowering, forward_only, the FSDP plan and
    its removal, the compute order and the executor's units, and neither a built-in nor one piece may say it."""
    from pipeline_ext.schedules.fsdp import plan_fsdp, strip_fsdp
    from pipeline_ext.schedules.lowering import as_units

    sched = build_pieces(name, 2, 4, 3)
    lowered = S.lower(sched)
    planned = plan_fsdp(lowered, max_active_stages=1)
    kept = [sched, lowered, S.forward_only(lowered), planned, strip_fsdp(planned), lowered.compute_only(),
            as_units(lowered)]
    assert [s.pieces for s in kept] == [3] * len(kept)
    assert build_pieces(name, 2, 4, 1).pieces == 1 and S.build(name, 2, 4).pieces == 1
    assert sched != Schedule(sched.actions, sched.stage_to_rank, sched.n_microbatches, sched.name)
    # validate reads it: the same order with two of a sequence's forwards swapped is refused without being told
    rows = [list(r) for r in sched.actions]
    i, j = rows[0].index(Action(0, F, 0)), rows[0].index(Action(0, F, 1))
    rows[0][i], rows[0][j] = rows[0][j], rows[0][i]
    with pytest.raises(ScheduleError, match="must run in piece order"):
        validate(sched.with_actions(rows))
    with pytest.raises(ScheduleError, match="over seq_chunks=3 pieces, not 2"):
        validate(sched, pieces=2)


def _swap(sched: Schedule, rank: int, a: Action, b: Action) -> Schedule:
    rows = [list(r) for r in sched.actions]
    i, j = rows[rank].index(a), rows[rank].index(b)
    rows[rank][i], rows[rank][j] = rows[rank][j], rows[rank][i]
    return Schedule(rows, list(sched.stage_to_rank), sched.n_microbatches, sched.name)


def test_validate_refuses_a_sequence_whose_pieces_run_out_of_order():
    sched = build_pieces("1f1b", 2, 2, 2)
    S.validate(sched, pieces=2)
    forwards = _swap(sched, 0, Action(0, F, 0), Action(0, F, 1))  # piece 1's forward before piece 0's
    S.validate(forwards)  # a valid schedule of independent microbatches ...
    with pytest.raises(ScheduleError, match=r"forwards on stage 0 must run in piece order \(piece 1 after none"):
        S.validate(forwards, pieces=2)  # ... but not of pieces
    backwards = _swap(sched, 1, Action(1, B, 0), Action(1, B, 1))  # piece 0's backward before piece 1's
    with pytest.raises(ScheduleError, match="backwards on stage 1 must run in reverse piece order"):
        S.validate(backwards, pieces=2)
    unsaid = Schedule(sched.actions, sched.stage_to_rank, sched.n_microbatches, sched.name)  # as read from text
    with pytest.raises(ScheduleError, match="not a multiple of seq_chunks=3"):
        S.validate(unsaid, pieces=3)


def test_other_schedules_are_refused_by_name():
    with pytest.raises(ScheduleError, match="'gpipe' does not run sequence pieces.*1f1b, interleaved_1f1b, zb_h1"):
        build_pieces("gpipe", 2, 4, 2)
    with pytest.raises(ScheduleError, match="seq_chunks must be a positive int"):
        build_pieces("1f1b", 2, 4, 0)


# -- the cut and its cost model ---------------------------------------------------------------------------
@pytest.mark.parametrize("split", ["equal", "balanced", 0.0, 0.3, 0.6, 1.0])
@pytest.mark.parametrize("length,k", [(4096, 4), (2048, 3), (12, 2), (7, 7)])
def test_piece_lengths_cover_the_sequence_each_at_least_one_position(split, length, k):
    lengths = piece_lengths(length, k, split)
    assert len(lengths) == k and sum(lengths) == length and min(lengths) >= 1


@pytest.mark.parametrize("a", [0.2, 0.43, 0.6, 1.0])
def test_pieces_cut_at_a_share_cost_the_same_under_it(a):
    lengths = piece_lengths(4096, 4, a)
    costs = piece_costs(lengths, a)
    assert max(costs) / min(costs) < 1.01  # equal but for rounding to whole positions
    assert lengths == sorted(lengths, reverse=True)  # later pieces attend to more keys: shorter
    equal = piece_costs(piece_lengths(4096, 4), a)  # equal lengths: each later piece costs more
    assert equal == sorted(equal) and equal[-1] / equal[0] > 1.2


def test_the_named_splits_are_the_ends_of_the_share():
    assert piece_lengths(4096, 4, "equal") == piece_lengths(4096, 4, 0.0) == [1024] * 4
    assert piece_lengths(4096, 4, "balanced") == piece_lengths(4096, 4, 1.0) == [2048, 848, 651, 549]
    assert piece_costs([1024] * 4, 0.0) == [1.0] * 4
    assert piece_sizes([3, 1]) == [1.5, 0.5]


def test_attention_share_of_a_transformer_and_bad_splits():
    # 4096 positions, attention 256 wide, 688128 weights in matrix products: L w / (L w + P)
    assert attention_share(length=4096, width=256, matmul_params=688128) == pytest.approx(1048576 / 1736704)
    assert attention_share(0.25) == 0.25 and attention_share("balanced") == 1.0
    for bad in ("even", 1.5, -0.1, True, None):
        with pytest.raises(ValueError, match="seq_split must be|attention_share needs"):
            piece_lengths(16, 2, bad)
    with pytest.raises(ValueError, match="cannot be cut into seq_chunks=4"):
        piece_lengths(3, 4)


# -- the simulator ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,p,m,k", [("1f1b", 2, 4, 4), ("zb_h1", 3, 3, 2), ("interleaved_1f1b", 2, 4, 3)])
def test_simulate_charges_each_piece_its_weight(name, p, m, k):
    sched = build_pieces(name, p, m, k)
    weights = piece_costs(piece_lengths(64, k), 0.7)
    costs = S.Costs(f=1.0, b=2.0, w=0.5, comm=0.25, pieces=weights)
    # the same schedule replayed with every action's own duration: the simulator's rules, by hand
    lowered = S.lower(sched)
    base = S.Costs(f=1.0, b=2.0, w=0.5, comm=0.25)
    durations = {a: base.duration(a) * weights[a.microbatch % k] for acts in lowered.actions for a in acts}
    latencies = {a: 0.25 for acts in lowered.actions for a in acts if a.kind in (ActionKind.RECV_F, ActionKind.RECV_B)}
    by_hand = replay(lowered, durations, latencies)
    assert S.simulate(sched, costs).makespan == pytest.approx(max(s.end for s in by_hand))
    uniform = S.simulate(sched, S.Costs(f=1.0, b=2.0, w=0.5, comm=0.25, pieces=[1.0] * k)).makespan
    assert uniform == pytest.approx(S.simulate(sched, base).makespan)


def test_1f1b_over_pieces_of_equal_cost_has_the_closed_form_makespan():
    p, m, k = 4, 4, 4  # (m K + p - 1) units of F + B, each piece 1/K of a sequence
    sched = build_pieces("1f1b", p, m, k)
    assert S.simulate(sched, S.Costs(f=1 / k, b=2 / k, w=0.0)).makespan == pytest.approx((m * k + p - 1) * 3 / k)


def test_peak_bytes_holds_each_piece_its_own_size():
    p, m, k = 2, 4, 4
    sched = build_pieces("1f1b", p, m, k)
    res = S.simulate(sched)
    assert res.peak_activations[0] == p + k - 1  # rank 0 holds p + K - 1 pieces
    assert res.peak_bytes(1.0 / k, [1.0] * k)[0] == pytest.approx((p + k - 1) / k)
    sizes = piece_sizes(piece_lengths(4096, k, 0.6))

    def brute(acts):  # live activations, each F adding its piece's size, its B freeing it
        live = peak = 0.0
        for a in acts:
            if a.kind in (F, B):
                live += (1 if a.kind is F else -1) * sizes[a.microbatch % k] / k
                peak = max(peak, live)
        return peak

    assert res.peak_bytes(1.0 / k, sizes) == pytest.approx([brute(acts) for acts in sched.actions])
    with pytest.raises(ScheduleError, match="piece sizes"):
        res.peak_bytes(1.0, [])


def test_measured_costs_recover_each_pieces_weight():
    p, m, k = 2, 4, 4
    sched = S.lower(build_pieces("1f1b", p, m, k))
    weights = piece_costs(piece_lengths(4096, k), 0.6)  # mean 1
    truth = S.Costs(f=[1.0, 1.5], b=[2.0, 3.0], w=0.0, comm=0.0, pieces=weights)
    trace = S.simulate(sched, truth).timeline
    costs = measure_costs(sched, [trace])  # the schedule says it runs k pieces
    assert costs.f == pytest.approx([1.0, 1.5]) and costs.b == pytest.approx([2.0, 3.0])
    assert costs.pieces == pytest.approx(weights)
    report = TraceReport(sched, [trace])
    assert report.simulated.makespan == pytest.approx(S.simulate(sched, truth).makespan)
    # without pieces the medians over every unit: the makespan the per-piece costs would have predicted is lost
    flat = measure_costs(sched, [trace], pieces=1)
    assert flat.pieces is None
    assert S.simulate(sched, flat).makespan != pytest.approx(S.simulate(sched, truth).makespan)
    # weights for another number of pieces would be charged to the wrong units: refused by name
    with pytest.raises(ScheduleError, match=r"seq_chunks=4 pieces, but costs.pieces has 2 weights"):
        S.simulate(sched, S.Costs(f=1.0, b=2.0, pieces=[0.9, 1.1]))
