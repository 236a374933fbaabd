"""Tracing: measured costs and bubble agree with the simulator on its own timeline, and a
traced multi-process run records every action of every rank (comm included)."""
from __future__ import annotations

import json

import pytest
import torch

from mp_utils import run_ranks
from models import build, loss_fn, make_batch
from pipeline_ext import schedules as S
from pipeline_ext.runtime.trace import (TraceReport, measure_costs, measured_bubble, replay, replay_gap,
                                       transfer_samples)
from pipeline_ext.schedules.simulate import Span


@pytest.mark.parametrize("name", ["1f1b", "zb_h1", "interleaved_1f1b"])
def test_simulated_timeline_read_as_a_trace_gives_back_costs_and_bubble(name):
    sch = S.build(name, 2, 4)
    ns = sch.num_stages
    costs = S.Costs(f=[1.0 + s for s in range(ns)], b=[2.0 + s for s in range(ns)],
                    w=[0.5 * (name == "zb_h1")] * ns, comm=0.0)
    sim = S.simulate(sch, costs)
    assert measured_bubble(sim.timeline, 2) == pytest.approx(sim.bubble_rate)
    got = measure_costs(sch, [sim.timeline])
    if name != "zb_h1":  # a full B is measured as b (+ w = 0), the simulator charged b + w
        assert got.f == pytest.approx(costs.f) and got.b == pytest.approx(costs.b)
    else:
        assert (got.f, got.b, got.w) == (pytest.approx(costs.f), pytest.approx(costs.b), pytest.approx(costs.w))
    assert got.comm == 0.0  # no SEND/RECV spans, no transfer samples
    report = TraceReport(sch, [sim.timeline])
    assert report.simulated_bubble == pytest.approx(sim.bubble_rate)


def test_a_schedule_running_whole_and_split_backwards_is_charged_each_as_measured():
    """DualPipeV runs B in its overlapped middle and I, W at its ends: a median over B and I together would
    charge neither; B is measured into ``whole``, I into b, W into w, and the simulator gives the step back."""
    sch = S.build("dualpipev", 2, 8, stages_per_rank=2)
    costs = S.Costs(f=1.0, b=0.5, w=1.0, whole=1.2)  # I + W (1.5) costs more than the whole backward (1.2)
    sim = S.simulate(sch, costs)
    got = measure_costs(sch, [sim.timeline])
    assert got.whole == pytest.approx([1.2] * 4) and got.b == pytest.approx([0.5] * 4)
    assert got.w == pytest.approx([1.0] * 4)
    assert S.simulate(sch, got).makespan == pytest.approx(sim.makespan)
    assert measure_costs(S.build("zb_h1", 2, 4), [S.simulate(S.build("zb_h1", 2, 4)).timeline]).whole is None


def test_transfer_time_is_read_only_from_receivers_that_waited():
    sch = S.lower(S.build("1f1b", 2, 2))
    a = S.Action
    spans = [
        Span(0, a(0, S.ActionKind.SEND_F, 0), 1.0, 1.1), Span(1, a(1, S.ActionKind.RECV_F, 0), 0.5, 1.6),  # waited
        Span(1, a(1, S.ActionKind.SEND_B, 0), 3.0, 3.1), Span(0, a(0, S.ActionKind.RECV_B, 0), 4.0, 4.01),  # found data
    ]
    assert transfer_samples(sch, spans) == [pytest.approx(0.6)]


def _hand_trace(late: float = 0.0) -> list[Span]:
    """1F1B, 2 ranks, 2 microbatches as the simulator runs it at F = 1, B = 2, transfer 0.5, written out by hand
    with every SEND/RECV; ``late`` delays rank 0's last B (and what follows) by that much of runtime time."""
    a, K = S.Action, S.ActionKind
    return [
        Span(0, a(0, K.F, 0), 0.0, 1.0), Span(0, a(0, K.SEND_F, 0), 1.0, 1.0), Span(0, a(0, K.F, 1), 1.0, 2.0),
        Span(0, a(0, K.SEND_F, 1), 2.0, 2.0), Span(0, a(0, K.RECV_B, 0), 2.0, 5.0),  # waits for 1SEND_B0 at 4.5
        Span(0, a(0, K.B, 0), 5.0, 7.0), Span(0, a(0, K.RECV_B, 1), 7.0, 8.0),
        Span(0, a(0, K.B, 1), 8.0 + late, 10.0 + late),
        Span(1, a(1, K.RECV_F, 0), 0.0, 1.5), Span(1, a(1, K.F, 0), 1.5, 2.5), Span(1, a(1, K.B, 0), 2.5, 4.5),
        Span(1, a(1, K.SEND_B, 0), 4.5, 4.5), Span(1, a(1, K.RECV_F, 1), 4.5, 4.5),  # its data came at 2.5
        Span(1, a(1, K.F, 1), 4.5, 5.5), Span(1, a(1, K.B, 1), 5.5, 7.5), Span(1, a(1, K.SEND_B, 1), 7.5, 7.5),
    ]


def test_replay_of_a_trace_at_the_costs_is_the_simulator():
    sch = S.lower(S.build("1f1b", 2, 2))
    costs = S.Costs(f=1.0, b=2.0, w=0.0, comm=0.5)
    trace = _hand_trace()
    durations = {s.action: s.end - s.start for s in trace if s.action.is_compute}
    latencies = {s.action: 0.5 for s in trace if s.action.kind in (S.ActionKind.RECV_F, S.ActionKind.RECV_B)}
    assert sorted(replay(sch, durations, latencies)) == sorted(trace)  # span for span
    parts = replay_gap(sch, trace, costs)
    assert parts["simulated"] == pytest.approx(S.simulate(sch, costs).makespan) == pytest.approx(10.0)
    free = S.simulate(sch, S.Costs(f=1.0, b=2.0, w=0.0, comm=0.0)).makespan  # 9: free messages
    assert parts["compute"] == pytest.approx(free - 10.0) and parts["latency"] == pytest.approx(10.0 - free)
    assert parts["send"] == parts["recv"] == parts["between"] == pytest.approx(0.0)
    assert parts["traced"] == pytest.approx(10.0) and parts["unexplained"] == pytest.approx(0.0)


def test_replay_gap_puts_a_wait_between_actions_where_it_was():
    parts = replay_gap(S.lower(S.build("1f1b", 2, 2)), _hand_trace(late=0.25), S.Costs(f=1.0, b=2.0, w=0.0, comm=0.5))
    assert parts["between"] == pytest.approx(0.25) and parts["traced"] == pytest.approx(10.25)
    assert parts["unexplained"] == pytest.approx(0.0)


@pytest.mark.parametrize("name", ["1f1b", "interleaved_1f1b", "zb_h1"])
def test_replay_gap_adds_up_to_any_step_it_can_reproduce(name):
    """Steps made by ``replay`` from random times of every kind: the parts add up to the step, none unexplained."""
    import random

    rng = random.Random(name)
    sch = S.lower(S.build(name, 2, 6, stages_per_rank=2 if name == "interleaved_1f1b" else 1))
    acts = [a for row in sch.actions for a in row]
    for _ in range(20):
        step = replay(sch, {a: rng.uniform(0.5, 2.0) if a.is_compute else rng.uniform(0.0, 0.1) for a in acts},
                      {a: rng.uniform(0.0, 0.6) for a in acts}, {a: rng.uniform(0.0, 0.05) for a in acts})
        step = [s._replace(start=s.start + 7.0, end=s.end + 7.0) for s in step]  # any clock origin
        costs = measure_costs(sch, [step])
        parts = replay_gap(sch, step, costs)
        assert parts["simulated"] == pytest.approx(S.simulate(sch, costs).makespan)
        assert parts["unexplained"] == pytest.approx(0.0, abs=1e-9)
        assert sum(v for k, v in parts.items() if k not in ("traced", "unexplained")) == pytest.approx(parts["traced"])


def _traced(rank: int, world: int, name: str, path: str) -> dict:
    import pipeline_ext as pe

    v = 2 if name == "interleaved_1f1b" else 1
    placement = S.build(name, world, 4, stages_per_rank=v).stage_to_rank
    modules = build("mlp", world * v)
    mine = [s for s, r in enumerate(placement) if r == rank]
    stages = [pe.PipelineStage(modules[s], s, world * v, "cpu") for s in mine]
    sched = pe.PipelineSchedule(stages, name, 4, loss_fn=loss_fn)
    x, y = make_batch("mlp", 8)
    args, target = ((x,) if 0 in mine else ()), (y if world * v - 1 in mine else None)
    out = {"tracing": sched.tracing}
    sched.step(*args, target=target)  # untraced
    sched.enable_tracing()
    for _ in range(2):
        sched.step(*args, target=target)
    report = sched.write_trace(path)
    out["report"] = None if report is None else {
        "steps": len(report.steps), "actions": [[str(s.action) for s in st] for st in report.steps],
        "ranks": [sorted({s.rank for s in st}) for st in report.steps],
        "f": report.costs.f, "measured": report.measured_bubble, "simulated": report.simulated_bubble,
        "expected": [sorted(str(a) for acts in sched.schedule.actions for a in acts)],
    }
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["1f1b", "interleaved_1f1b"])
def test_traced_run_records_every_action_and_writes_a_chrome_trace(tmp_path, name):
    path = str(tmp_path / "trace.json")
    results = run_ranks(_traced, 2, name, path, timeout=100)
    assert not any(v["tracing"] for _, v in results.values())  # tracing is off by default
    rep = results[0][1]["report"]
    assert results[1][1]["report"] is None  # the report lands on rank 0 only
    assert rep["steps"] == 2  # the untraced first step is not in it
    for actions, ranks in zip(rep["actions"], rep["ranks"]):
        assert sorted(actions) == rep["expected"][0] and ranks == [0, 1]
    assert all(f > 0 for f in rep["f"])
    assert 0.0 <= rep["measured"] < 1.0 and 0.0 <= rep["simulated"] < 1.0
    trace = json.load(open(path))
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"rank 0", "rank 1"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] != "step"]
    assert len(spans) == 2 * len(rep["expected"][0])
    assert {e["cat"] for e in spans} >= {"F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B"}


def test_profiler_events_are_the_chrome_trace_of_the_run():
    """The helper the GPU tools read (tools/gpu_sync_count.py, benchmarks/bench_overlap.py), checked on CPU."""
    from pipeline_ext.runtime.trace import profiler_events

    a = torch.randn(64, 64)
    events = profiler_events(lambda: a @ a)
    assert any(e.get("cat") == "cpu_op" and e.get("name") == "aten::mm" and e.get("dur", -1) >= 0 for e in events)
