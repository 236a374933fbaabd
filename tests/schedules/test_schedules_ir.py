"""The IR and its text format: spelling, round trips, and malformed input."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from pipeline_ext.schedules import Action, ActionKind, Schedule, ScheduleError, available, build, lower, validate

BUILTIN_CASES = [(name, 4, 8) for name in available()] + [("interleaved_1f1b", 2, 4), ("zbv", 1, 3)]


@pytest.mark.parametrize("text,expected", [
    ("2F0", Action(2, ActionKind.F, 0)),
    ("1I3", Action(1, ActionKind.I, 3)),
    ("0SEND_F5", Action(0, ActionKind.SEND_F, 5)),
    ("12RECV_B10", Action(12, ActionKind.RECV_B, 10)),
    ("3W7", Action(3, ActionKind.W, 7)),
])
def test_action_spelling_matches_torch(text, expected):
    assert Action.parse(text) == expected
    assert str(expected) == text


def test_action_helpers_and_hashing():
    f, send = Action.parse("0F1"), Action.parse("0SEND_F1")
    assert f.is_compute and not f.is_comm
    assert send.is_comm and not send.is_compute
    assert {f: 1}[Action(0, ActionKind.F, 1)] == 1
    assert ActionKind("RECV_B") is ActionKind.RECV_B and ActionKind.B.value == "B"


@pytest.mark.parametrize("bad", ["", "F0", "0F", "0X1", "0SEND1", "-1F0", "0F-1", "0 F 1", "0f0", "٣F0"])
def test_action_parse_rejects(bad):
    with pytest.raises(ScheduleError, match="cannot parse action"):
        Action.parse(bad)


@pytest.mark.parametrize("name,p,m", BUILTIN_CASES)
def test_text_round_trip_exact(name, p, m):
    for sched in (build(name, p, m), lower(build(name, p, m))):
        text = sched.to_text()
        back = Schedule.from_text(text)
        assert back == sched
        assert back.to_text() == text
        assert back.lowered == sched.lowered


def test_to_text_needs_a_one_word_name():
    with pytest.raises(ScheduleError, match="must be one word"):
        Schedule([[]], [0], 1, "two words").to_text()


def test_from_text_without_header_infers_metadata():
    text = "0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1\n"
    sched = Schedule.from_text(text)
    assert sched.stage_to_rank == [0, 1]
    assert sched.n_microbatches == 2
    assert sched.name == "custom"
    assert (sched.num_ranks, sched.num_stages, sched.stages_of(1), sched.lowered) == (2, 2, [1], False)
    validate(sched)


def test_from_text_infers_v_placement_and_ignores_comments():
    sched = build("zbv", 2, 4)
    body = "\n".join(" ".join(map(str, acts)) for acts in sched.actions)
    back = Schedule.from_text("# a hand-written V schedule\n\n" + body + "\n\n")
    assert back.stage_to_rank == [0, 1, 1, 0] == sched.stage_to_rank
    assert back.actions == sched.actions


@pytest.mark.parametrize("text,match", [
    ("", "no rank lines"),
    ("0F0 1F0\n1B0", "stage 1 on rank 0.*already appears on rank 1|already appears"),
    ("0F0 0B0\n2F0 2B0", r"stages \[1\] appear on no rank"),
    ("# schedule n_microbatches=x\n0F0", "not a comma-separated list"),
    ("# schedule colour=red\n0F0", "bad header item"),
    ("0F0 0B0\n1F0 1Q0", "rank 1, position 1"),
])
def test_from_text_errors(text, match):
    with pytest.raises(ScheduleError, match=match):
        Schedule.from_text(text)


TOKENS = st.sampled_from(["0F0", "1F0", "0B0", "1B0", "0I0", "0W0", "1I1", "0SEND_F0", "1RECV_F0", "1SEND_B0",
                          "0RECV_B0", "2F1", "x", "F", "#", "\n", " ", "9W9", "0F1", "1F1", "0B1", "1B1",
                          "# schedule n_microbatches=2 stage_to_rank=0,1", "# schedule stage_to_rank=0,7",
                          "# schedule name=a n_microbatches=-3", "# schedule stage_to_rank="])


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=60), st.lists(TOKENS, max_size=30).map(" ".join),
                 st.lists(TOKENS, max_size=30).map("\n".join)))
def test_fuzz_text_only_raises_schedule_error(text):
    try:
        sched = Schedule.from_text(text)
    except ScheduleError:
        return
    for fn in (validate, lambda s: validate(lower(s))):
        try:
            fn(sched)
        except ScheduleError:
            pass


ACTIONS = st.builds(Action, st.integers(-1, 4), st.sampled_from(list(ActionKind)), st.integers(-1, 3))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(ACTIONS, max_size=12), min_size=0, max_size=4), st.lists(st.integers(-1, 4), max_size=5),
       st.integers(-1, 4))
def test_fuzz_validate_only_raises_schedule_error(actions, placement, n_mb):
    sched = Schedule(actions, placement, n_mb, "fuzz")
    try:
        validate(sched)
    except ScheduleError:
        pass
    try:
        validate(lower(sched))
    except ScheduleError:
        pass
