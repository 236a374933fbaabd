"""Validation and lowering: hand-written mistakes are caught and named; lowering is sound."""
from __future__ import annotations

import pytest

from pipeline_ext.schedules import Schedule, ScheduleError, build, lower, validate
from pipeline_ext.schedules.lowering import check_deadlock, check_fifo, receives_for, sends_for

GOOD_1F1B = "0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1\n"


def sched(text: str) -> Schedule:
    return Schedule.from_text(text)


def test_hand_written_schedule_is_valid_and_lowers():
    s = sched(GOOD_1F1B)
    validate(s)
    low = lower(s)
    assert low.to_text().splitlines()[1:] == [
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
    ]
    validate(low)


@pytest.mark.parametrize("text,match", [
    # missing actions name the rank and the action
    ("0F0 0F1 0B0\n1F0 1B0 1F1 1B1", r"rank 0: missing action 0B1"),
    ("0F0 0F1 0B0 0B1\n1F0 1B0 1B1", r"rank 1: missing action 1F1"),
    ("# schedule n_microbatches=2\n0F0 0F1 0I0 0W0 0I1\n1F0 1B0 1F1 1B1", r"rank 0: missing action 0W1"),
    # misordered on a stage
    ("0F0 0F1 0B0 0B1\n1B0 1F0 1F1 1B1", r"rank 1, position 0: action 1B0 comes before 1F0"),
    ("0F0 0F1 0W0 0I0 0I1 0W1\n1F0 1B0 1F1 1B1", r"rank 0, position 2: action 0W0 comes before 0I0"),
    # misordered across stages: rank 0 waits for a backward rank 1 only runs after a forward rank 0 never sent
    ("0F0 0B0 0F1 0B1\n1F1 1B1 1F0 1B0",
     r"cannot be satisfied: rank 0 stuck at position 1 on 0B0 waiting for 1B0; rank 1 stuck at position 0 on 1F1"),
    # duplicates, B mixed with I/W, bad placement and ranges
    ("0F0 0F1 0B0 0B1 0F1\n1F0 1B0 1F1 1B1", r"rank 0, position 4: duplicate action 0F1 \(already at position 1\)"),
    ("# schedule n_microbatches=2\n0F0 0F1 0B0 0I0 0W0 0B1\n1F0 1B0 1F1 1B1", r"rank 0, position 2: action 0B0"),
    ("# schedule stage_to_rank=0,1\n0F0 0F1 0B0 0B1 1F0\n1B0 1F1 1B1", r"rank 0, position 4: action 1F0 belongs on rank 1"),
    ("# schedule n_microbatches=1\n0F0 0F1 0B0\n1F0 1B0", r"rank 0, position 1: action 0F1 names microbatch 1"),
    ("# schedule stage_to_rank=0,2\n0F0 1F0 1B0 0B0\n\n", r"stage 1 is placed on rank 2, but there are ranks 0..0"),
    ("# schedule stage_to_rank=0,2\n0F0 0B0\n\n1F0 1B0\n", r"rank 1 holds no stage"),
])
def test_mistakes_are_rejected_naming_rank_and_action(text, match):
    with pytest.raises(ScheduleError, match=match):
        validate(sched(text))


def test_lowered_missing_recv_and_extra_send():
    low = lower(sched(GOOD_1F1B)).to_text().replace(" 1RECV_F1", "")
    with pytest.raises(ScheduleError, match=r"rank 1, position \d+: action 1F1 needs 1RECV_F1, which is missing"):
        validate(sched(low))
    extra = lower(sched(GOOD_1F1B)).to_text().replace("0B1\n", "0B1 0SEND_B1\n")
    with pytest.raises(ScheduleError, match=r"rank 0, position 8: action 0SEND_B1 (is not needed|has no matching)"):
        validate(sched(extra))


def test_recv_after_its_consumer_is_rejected():
    text = lower(sched(GOOD_1F1B)).to_text().replace("1RECV_F0 1F0", "1F0 1RECV_F0")
    with pytest.raises(ScheduleError, match=r"rank 1, position 0: action 1F0 needs 1RECV_F0 before it"):
        validate(sched(text))


def test_deadlock_is_reported_per_rank():
    # Both ranks receive before they send: each waits forever for the other.
    text = ("# schedule name=stuck n_microbatches=2 stage_to_rank=0,1\n"
            "0F0 0SEND_F0 0RECV_B0 0F1 0SEND_F1 0B0 0RECV_B1 0B1\n"
            "1RECV_F1 1RECV_F0 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1\n")
    with pytest.raises(ScheduleError) as err:
        check_deadlock(sched(text))
    msg = str(err.value)
    assert "lowered schedule 'stuck' deadlocks" in msg
    assert "rank 0 stuck at position 2 on 0RECV_B0 waiting for 1SEND_B0 on rank 1" in msg
    assert "rank 1 stuck at position 0 on 1RECV_F1 waiting for 0SEND_F1 on rank 0" in msg


def test_fifo_order_is_checked():
    # Rank 1 posts its receives in the opposite order from rank 0's sends.
    text = ("# schedule n_microbatches=2 stage_to_rank=0,1\n"
            "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1\n"
            "1RECV_F1 1RECV_F0 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1\n")
    with pytest.raises(ScheduleError, match=r"rank 1, position 0: 1RECV_F1 is receive #0 from rank 0, but send #0 "
                                            r"from rank 0 \(position 1\) is for 1RECV_F0"):
        validate(sched(text))


def test_lowering_reorders_receives_for_fifo_in_v_schedules():
    s = build("zbv", 4, 8)
    naive = Schedule([[x for a in acts for x in receives_for(a, s.stage_to_rank) + [a] + sends_for(a, s.stage_to_rank)]
                      for acts in s.actions], s.stage_to_rank, s.n_microbatches, s.name)
    with pytest.raises(ScheduleError, match="FIFO"):
        check_fifo(naive)
    low = lower(s)
    check_fifo(low)
    check_deadlock(low)
    assert low.compute_only() == s  # only comm actions were added


def test_v_shape_neighbours_on_one_rank_exchange_no_messages():
    p = 3
    low = lower(build("zbv", p, 6))
    bottom = low.actions[p - 1]  # holds stages p-1 and p
    assert not [a for a in bottom if a.is_comm and a.stage in (p - 1, p) and
                (a.kind.value, a.stage) in {("SEND_F", p - 1), ("RECV_F", p), ("SEND_B", p), ("RECV_B", p - 1)}]
    assert any(a.kind.value == "RECV_F" and a.stage == 2 * p - 1 for a in low.actions[0])  # last stage on rank 0


def test_comm_semantics_match_torch():
    low = lower(build("1f1b", 2, 2))
    kinds = {str(a) for acts in low.actions for a in acts if a.is_comm}
    # stage 0 sends its output and receives the grad of its output; stage 1 the reverse
    assert kinds == {"0SEND_F0", "0SEND_F1", "0RECV_B0", "0RECV_B1", "1RECV_F0", "1RECV_F1", "1SEND_B0", "1SEND_B1"}


def test_lower_is_idempotent_and_single_rank_needs_no_messages():
    low = lower(build("interleaved_1f1b", 2, 4))
    assert lower(low) == low
    solo = build("zbv", 1, 3)
    assert lower(solo) == solo and not lower(solo).lowered


@pytest.mark.parametrize("text, said", [
    ("1000000000F0", "stage and microbatch indices must be below 65536"),
    ("0F1000000000", "stage and microbatch indices must be below 65536"),
    ("# schedule n_microbatches=1000000000\n0F0", "values and lengths must be at most 65536"),
])
def test_schedule_text_with_huge_numbers_is_a_schedule_error(text, said):
    """Stage index 1e9 made validation run out of memory; now it is named at parsing."""
    with pytest.raises(ScheduleError, match=said):
        Schedule.from_text(text)


V_ONE_MB = "# schedule stage_to_rank=0,1,1,0 n_microbatches=1\n0F0 3F0 3B0 0B0\n1F0 2F0 2B0 1B0"


def _paired(text: str, *pairs: tuple[str, str]) -> Schedule:
    """``text`` with overlapped pairs, each named by its two actions' text (``"3F0"``)."""
    import dataclasses

    s = sched(text)
    by_name = {str(a): a for acts in s.actions for a in acts}
    return dataclasses.replace(s, overlapped=tuple((by_name[x], by_name[y]) for x, y in pairs))


@pytest.mark.parametrize("pair,match", [
    # the second half needs what the first completes on the same rank: the halves run at the same time
    (("3F0", "3B0"), r"overlapped pair \(3F0;3B0\): 3B0 needs what 3F0 completes"),
    (("2F0", "2B0"), r"overlapped pair \(2F0;2B0\): 2B0 needs what 2F0 completes"),
    (("1F0", "2F0"), r"overlapped pair \(1F0;2F0\): 2F0 needs what 1F0 completes"),
    (("2B0", "1B0"), r"overlapped pair \(2B0;1B0\): 1B0 needs what 2B0 completes"),
])
def test_a_pair_whose_second_half_needs_the_first_is_rejected(pair, match):
    with pytest.raises(ScheduleError, match=match):
        validate(_paired(V_ONE_MB, pair))


def test_a_pair_whose_second_half_waits_on_the_first_through_another_rank_deadlocks_and_is_named():
    # 3F0 needs 2F0 on rank 1, which needs 0F0's activation: it leaves rank 0 only after the pair
    s = _paired(V_ONE_MB, ("0F0", "3F0"))
    with pytest.raises(ScheduleError, match=r"rank 0 stuck at position 1 on 3F0 waiting for 2F0; "
                                            r"rank 1 stuck at position 0 on 1F0 waiting for 0F0"):
        validate(s)
    with pytest.raises(ScheduleError, match=r"deadlocks: rank 0 stuck at position 0 on 3RECV_F0"):
        check_deadlock(lower(s))


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
def test_dualpipev_pairs_are_independent_and_lower_without_deadlock(p):
    for m in (2 * p, 2 * p + 1, 3 * p):
        s = build("dualpipev", p, m)
        assert s.overlapped and s.compute_only().overlapped == s.overlapped
        validate(s)
        validate(lower(s))
