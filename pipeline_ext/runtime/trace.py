"""Execution traces: what each rank actually did, when, and how far that is from the model.

A schedule's promise is a timeline (see ``schedules.simulate``); whether a run
keeps it is only visible by recording the run. With tracing on, the executor's
``on_action`` hook hands every executed action (F/B/I/W and SEND/RECV) with
its start and end to a :class:`Tracer`; with tracing off the hook is ``None``
and the executor pays one attribute test per action.

From the recorded spans a :class:`TraceReport` measures the per-stage F, B (or
I), W costs and the transfer cost, the bubble rate, and asks the simulator what
bubble the schedule *should* have at exactly those costs, so "the pipeline is
slow" can be told apart into "the schedule has a bubble" and "the runtime adds
waits the model does not have". It writes a Chrome trace (one track per rank,
open in Perfetto or chrome://tracing) and a timeline PNG.

Clock: ``time.perf_counter``, CLOCK_MONOTONIC on Linux, which every process on
one host shares, so spans gathered from several processes line up. Across
hosts the clocks are unrelated: per-rank durations (hence costs and per-rank
busy time) stay right, but cross-rank alignment in the trace and the transfer
cost estimate do not. On CUDA, spans are host-side (launch) times unless the
caller synchronises.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

from pipeline_ext.runtime.tags import message_tag
from pipeline_ext.schedules import Action, ActionKind, Costs, Schedule, SimResult, simulate
from pipeline_ext.schedules.inorder import run_in_order
from pipeline_ext.schedules.lowering import counterpart
from pipeline_ext.schedules.simulate import Span

__all__ = ["ActionSample", "Tracer", "TraceReport", "measure_costs", "measured_bubble", "replay", "replay_gap"]

_COMPUTE = (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W)
_SENDS = (ActionKind.SEND_F, ActionKind.SEND_B)
_RECVS = (ActionKind.RECV_F, ActionKind.RECV_B)


@dataclass(frozen=True)
class ActionSample:
    """One executed action, as an action hook sees it (``PipelineSchedule.register_action_hook``).

    [Note: one sample per action, after it]
    A hook is called once per action, after it ran, with the action's own
    ``start`` and ``end`` (``time.perf_counter``; an overlapped pair's halves
    each with their own span). No second call before an action: on one rank
    nothing runs between two actions, so the state before an action is the
    state after the one before it (the step's first action: the state the
    step began in). The two recorders the library has need no more: the
    ``Tracer`` keeps the span, the ``ActivationMeter`` samples live bytes.
    ``action`` carries the stage, kind and microbatch (SEND/RECV included);
    the fields below repeat them so a hook needs no schedule import.
    """

    rank: int
    action: Action
    start: float
    end: float

    @property
    def stage(self) -> int:
        return self.action.stage

    @property
    def kind(self) -> ActionKind:
        return self.action.kind

    @property
    def microbatch(self) -> int:
        return self.action.microbatch


class Tracer:
    """Collects one rank's spans, step by step. ``record`` is the executor's ``on_action``.

    ``split``: per local stage whose I ran, None where the I/W split held, else
    why it fell back to a whole backward (``split/obstacles.py``' reason); the
    front end fills it after each traced step (``note_split``).
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.steps: list[list[Span]] = []
        self.split: dict[int, Optional[str]] = {}

    def begin_step(self) -> None:
        """Spans recorded from now on belong to a new step."""
        self.steps.append([])

    def record(self, action: Action, start: float, end: float) -> None:
        self.steps[-1].append(Span(self.rank, action, start, end))

    def note_split(self, report: Mapping[int, Optional[str]]) -> None:
        """What the stages' I/W split did (``runtime.stage.split_report``); a fallback, once seen, stays."""
        for stage, why in report.items():
            if self.split.get(stage) is None:
                self.split[stage] = why

    def clear(self) -> None:
        self.steps.clear()
        self.split.clear()


def _median_by(spans: Sequence[Span], kinds: Sequence[ActionKind], stage: int) -> float:
    values = [s.end - s.start for s in spans if s.action.kind in kinds and s.action.stage == stage]
    return statistics.median(values) if values else 0.0


def transfer_samples(schedule: Schedule, spans: Sequence[Span]) -> list[float]:
    """Message latencies seen by receivers that were already waiting when the send started.

    For such a message, receive end - send start is the transfer time; a
    receive that found its data already there shows none of it, so it is left
    out. Needs one clock across ranks (one host).
    """
    sends = {message_tag(s.action, schedule.num_stages): s for s in spans if s.action.kind in _SENDS}
    out = []
    for r in spans:
        if r.action.kind in _RECVS:
            s = sends.get(message_tag(r.action, schedule.num_stages))
            if s is not None and r.start <= s.start:
                out.append(r.end - s.start)
    return out


def measure_costs(schedule: Schedule, steps: Sequence[Sequence[Span]], pieces: Optional[int] = None) -> Costs:
    """Per-stage median F, B (or I), W and the median transfer time, as simulator ``Costs``.

    A stage that runs full backwards gets b = its B time and w = 0 (the
    simulator charges b + w for a B); a split one gets b = I and w = W. A
    schedule whose stages run both (DualPipeV: whole backwards in its
    overlapped middle, I and W at the ends) gets ``whole`` = the B time too,
    so each kind is charged what it measured (a median over B and I together
    would charge neither).

    ``pieces`` (default: the schedule's own, ``Schedule.pieces``): the schedule
    runs K sequence pieces per microbatch (unit u is piece u % K,
    ``schedules/pieces.py``), whose costs differ (later pieces
    attend to more keys): each stage's cost of a kind is then the mean over
    the pieces of the piece's median, and ``Costs.pieces[k]`` is piece k's
    compute (every stage and kind, medians) over the mean piece's.
    """
    pieces = schedule.pieces if pieces is None else pieces
    spans = [s for step in steps for s in step]
    stages = range(schedule.num_stages)
    kinds = [{s.action.kind for s in spans if s.action.stage == st} for st in stages]
    parts = [spans] if pieces <= 1 else [[s for s in spans if s.action.microbatch % pieces == k]
                                         for k in range(pieces)]

    def cost(which: ActionKind, stage: int) -> list[float]:  # per piece (one part without pieces): its median
        return [_median_by(part, (which,), stage) for part in parts]

    f = [cost(ActionKind.F, s) for s in stages]
    whole = [cost(ActionKind.B, s) for s in stages]
    b = [cost(ActionKind.I, s) if ActionKind.I in kinds[s] else whole[s] for s in stages]
    w = [cost(ActionKind.W, s) for s in stages]
    weights = None
    if pieces > 1:
        compute = [sum(x[s][k] for x in (f, b, w) for s in stages) for k in range(pieces)]
        mean = statistics.fmean(compute)
        weights = [c / mean for c in compute] if mean > 0 else None
    f, b, w, whole = ([statistics.fmean(per_piece) for per_piece in x] for x in (f, b, w, whole))
    mixed = any(ActionKind.B in k and ActionKind.I in k for k in kinds)
    samples = [c for step in steps for c in transfer_samples(schedule, step)]
    return Costs(f=f, b=b, w=w, comm=statistics.median(samples) if samples else 0.0,
                 whole=[whole[s] if ActionKind.B in kinds[s] else b[s] + w[s] for s in stages] if mixed else None,
                 pieces=weights)


def measured_bubble(spans: Sequence[Span], num_ranks: int) -> float:
    """The simulator's bubble rate, on measured spans: mean over ranks of (T - busy_r) / T.

    T is the longest first-compute-start to last-compute-end of any rank and
    busy_r the rank's compute time; SEND/RECV time counts as idle, as the
    simulator's model charges comm only on dependencies. Busy time is the
    union of a rank's compute spans: an overlapped pair's F and B
    (``runtime/overlap.py``) overlap, and counting both in full would make a
    rank busier than the wall clock.
    """
    compute = [[s for s in spans if s.rank == r and s.action.kind in _COMPUTE] for r in range(num_ranks)]
    lengths = [max(s.end for s in c) - min(s.start for s in c) for c in compute if c]
    longest = max(lengths, default=0.0)
    if longest <= 0:
        return 0.0
    return sum((longest - _busy(c)) / longest for c in compute) / num_ranks


def _busy(spans: Sequence[Span]) -> float:
    """The length of the union of the spans' [start, end] intervals."""
    total, reach = 0.0, float("-inf")
    for s in sorted(spans, key=lambda s: s.start):
        if s.end > reach:
            total += s.end - max(s.start, reach)
            reach = s.end
    return total


def replay(schedule: Schedule, durations: Mapping[Action, float], latencies: Optional[Mapping[Action, float]] = None,
           gaps: Optional[Mapping[Action, float]] = None) -> list[Span]:
    """Rerun a lowered schedule with a time of its own for every action; the spans it gives, by (rank, start).

    The simulator charges one cost per stage and kind; a traced step has its
    own time for every action, and saying where that step's time went needs
    the step as exactly those times make it, with some of them set to zero
    (``replay_gap``). The rules are the simulator's, on the actions the
    executor runs: each rank runs its list in order, an action starts
    ``gaps[a]`` after the previous one of its rank ends (the first one ``gaps[a]``
    after 0) and lasts ``durations[a]``; a RECV ends at max(its start +
    ``durations[a]``, the matching SEND's start + ``latencies[a]``). In a lowered
    schedule every cross-rank dependency goes through a RECV and the others
    are kept by each rank's order, so with compute at its cost, every latency
    at the transfer cost and the rest 0 this is ``simulate`` (with the lowering's
    receive order, which can only block earlier). Missing keys count 0.
    """
    if schedule.overlapped:
        raise ValueError("replay runs each rank's actions one after the other; overlapped pairs are not modelled")
    placement = schedule.stage_to_rank
    latencies, gaps = latencies or {}, gaps or {}
    free = [0.0] * schedule.num_ranks
    sent: dict[Action, float] = {}  # SEND -> its start
    out: list[Span] = []

    def blocked_on(rank: int, action: Action):
        if action.kind not in _RECVS:
            return None
        send = counterpart(action, placement)[1]
        return None if send in sent else send

    def run(rank: int, action: Action) -> None:
        start = free[rank] + gaps.get(action, 0.0)
        end = start + durations.get(action, 0.0)
        if action.kind in _RECVS:
            end = max(end, sent[counterpart(action, placement)[1]] + latencies.get(action, 0.0))
        elif action.kind in _SENDS:
            sent[action] = start
        free[rank] = end
        out.append(Span(rank, action, start, end))

    run_in_order(schedule.actions, blocked_on, run, f"replay of {schedule.name!r}")
    return sorted(out, key=lambda s: (s.rank, s.start))


def _makespan(spans: Sequence[Span]) -> float:
    return max(s.end for s in spans) - min(s.start for s in spans) if spans else 0.0


def replay_gap(schedule: Schedule, step: Sequence[Span], costs: Costs) -> dict[str, float]:
    """The gap between a traced step and the simulator at ``costs``, cut into parts that add up (seconds).

    A step is longer than the simulator says for reasons that call for
    different fixes: compute that varies (a step waits on the slowest
    instance, not the median), message latency, the runtime's own time in
    SEND, in RECV and between actions. Each part is what replaying the step
    (``replay``) gains when that part of the measured times is put in, in
    this order, on top of the ones before:

    - ``simulated``: the replay at ``costs`` (compute at its cost, every
      message at the transfer cost, the rest 0), which is ``simulate`` unless
      the lowering's receive order blocks earlier;
    - ``compute``: every compute action at its own measured time, messages free;
    - ``latency``: every message its own latency, send start to receive end,
      when the receiver was waiting before the send started (as
      ``transfer_samples``); a receiver that came later shows no latency of its
      own and gets the transfer cost, capped at what it saw;
    - ``send``: each SEND's time; ``recv``: the time of each RECV that did not
      wait (its data was there: taking it, posting the next receives);
    - ``between``: the time between actions, and each rank's start after the first.

    ``unexplained`` = the measured step - all of them is 0 up to rounding
    when the replay reproduces the step; ``traced`` is the measured step.
    """
    placement = schedule.stage_to_rank
    spans = {s.action: s for s in step}
    sends = {a: s for a, s in spans.items() if a.kind in _SENDS}
    compute = {a: s.end - s.start for a, s in spans.items() if a.kind in _COMPUTE}
    send_time = {a: s.end - s.start for a, s in sends.items()}
    latency: dict[Action, float] = {}
    recv_time: dict[Action, float] = {}
    for a, r in spans.items():
        if a.kind not in _RECVS:
            continue
        s = sends.get(counterpart(a, placement)[1])
        if s is None:
            recv_time[a] = r.end - r.start
        elif r.start <= s.start:  # waiting before the send: all of it is the message's latency
            latency[a] = r.end - s.start
        else:
            latency[a] = min(r.end - s.start, costs.transfer(s.action.stage))
            recv_time[a] = r.end - r.start
    gaps: dict[Action, float] = {}
    origin = min(s.start for s in step)
    for rank in range(schedule.num_ranks):
        before = origin
        for a in schedule.actions[rank]:
            gaps[a] = spans[a].start - before
            before = spans[a].end
    nominal = {a: costs.duration(a) for acts in schedule.actions for a in acts}
    transfer = {a: costs.transfer(counterpart(a, placement)[1].stage) for acts in schedule.actions for a in acts
                if a.kind in _RECVS}
    ladder = [
        ("simulated", replay(schedule, nominal, transfer)),
        ("compute", replay(schedule, compute)),
        ("latency", replay(schedule, compute, latency)),
        ("send", replay(schedule, {**compute, **send_time}, latency)),
        ("recv", replay(schedule, {**compute, **send_time, **recv_time}, latency)),
        ("between", replay(schedule, {**compute, **send_time, **recv_time}, latency, gaps)),
    ]
    out, before = {}, 0.0
    for name, timeline in ladder:
        out[name] = _makespan(timeline) - before
        before = _makespan(timeline)
    out["traced"] = _makespan(step)
    out["unexplained"] = out["traced"] - before
    return out


@dataclass
class TraceReport:
    """Measured vs. simulated, over the traced steps (merged from every rank)."""

    schedule: Schedule
    steps: list[list[Span]]
    #: per stage whose I ran: None where the I/W split held, else why it fell back (``Tracer.split``, merged)
    split: dict[int, Optional[str]] = field(default_factory=dict)
    #: the transport of each pipeline edge, ``{"0<->1": "shm", ...}`` (``PipelineSchedule.transport_per_edge``)
    transport: dict[str, str] = field(default_factory=dict)
    costs: Costs = field(init=False)
    simulated: SimResult = field(init=False)
    bubble_per_step: list[float] = field(init=False)
    step_times: list[float] = field(init=False)

    def __post_init__(self) -> None:
        if not self.steps:
            raise ValueError("no traced steps: enable tracing and run at least one step first")
        self.costs = measure_costs(self.schedule, self.steps)  # per piece over pieces (Schedule.pieces)
        self.simulated = simulate(self.schedule, self.costs)
        self.bubble_per_step = [measured_bubble(s, self.schedule.num_ranks) for s in self.steps]
        self.step_times = [max(s.end for s in st) - min(s.start for s in st) for st in self.steps]

    @property
    def measured_bubble(self) -> float:
        """Median over the traced steps of the measured bubble rate."""
        return statistics.median(self.bubble_per_step)

    @property
    def simulated_bubble(self) -> float:
        return self.simulated.bubble_rate

    def summary(self) -> str:
        """A few lines for a terminal: costs, step time, measured vs simulated bubble."""
        ms = lambda v: "/".join(f"{x * 1e3:.2f}" for x in (v if isinstance(v, list) else [v]))  # noqa: E731
        c = self.costs
        text = (
            f"trace of {len(self.steps)} step(s) of {self.schedule.name} on {self.schedule.num_ranks} ranks: "
            f"step {statistics.median(self.step_times) * 1e3:.1f} ms (actions, median)\n"
            f"  measured costs per stage (ms): F {ms(c.f)}  B/I {ms(c.b)}  W {ms(c.w)}  comm {ms(c.comm)}\n"
            f"  bubble: measured {self.measured_bubble:.3f}, simulated at these costs {self.simulated_bubble:.3f}"
        )
        if self.transport:
            text += "\n  transport per edge: " + ", ".join(f"{e} {kind}" for e, kind in self.transport.items())
        return text + "".join(f"\n  {line}" for line in self.split_lines())

    def split_lines(self) -> list[str]:
        """The I/W split per stage, in words: one line for the stages where it held, one per stage that fell back."""
        if not self.split:
            return []
        held = [s for s, why in sorted(self.split.items()) if why is None]
        lines = [f"I/W split held on stages {held}"] if held else []
        lines += [f"I/W split fell back to a whole backward at I on stage {s}: {why}"
                  for s, why in sorted(self.split.items()) if why is not None]
        return lines

    def chrome_trace(self) -> dict:
        """Chrome trace JSON: one track per rank, every action (comm too), steps as enclosing spans."""
        origin = min(s.start for step in self.steps for s in step)
        us = lambda t: (t - origin) * 1e6  # noqa: E731
        events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
                               "args": {"name": f"{self.schedule.name} (measured)",
                                        **({"split": {str(s): why or "held" for s, why in self.split.items()}}
                                           if self.split else {}),
                                        **({"transport": dict(self.transport)} if self.transport else {})}}]
        for r in range(self.schedule.num_ranks):
            events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": r, "args": {"sort_index": r}})
        for i, step in enumerate(self.steps):
            for r in range(self.schedule.num_ranks):
                mine = [s for s in step if s.rank == r]
                if mine:
                    start, end = min(s.start for s in mine), max(s.end for s in mine)
                    events.append({"name": f"step {i}", "cat": "step", "ph": "X", "pid": 0, "tid": r,
                                   "ts": us(start), "dur": (end - start) * 1e6})
            for s in step:
                a = s.action
                events.append({"name": str(a), "cat": a.kind.value, "ph": "X", "pid": 0, "tid": s.rank,
                               "ts": us(s.start), "dur": (s.end - s.start) * 1e6,
                               "args": {"stage": a.stage, "microbatch": a.microbatch, "step": i}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write_chrome_trace(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.chrome_trace(), fh)

    def write_png(self, path: str, step: int = -1) -> None:
        """The measured timeline of one step (compute actions, ms), drawn like a simulated one."""
        from pipeline_ext.schedules import render_png

        spans = [s for s in self.steps[step] if s.action.kind in _COMPUTE]
        origin = min(s.start for s in spans)
        timeline = [Span(s.rank, s.action, (s.start - origin) * 1e3, (s.end - origin) * 1e3) for s in spans]
        named = dataclasses.replace(self.schedule, name=f"{self.schedule.name} (measured step)")
        measured = SimResult(named, self.costs, timeline, max(s.end for s in timeline),
                             self.bubble_per_step[step], [], [])
        render_png(measured, path, xlabel="time (ms, measured)", width=12.0)


def profiler_events(run: "Callable[[], object]") -> list[dict]:
    """The Chrome-trace events torch's profiler records (CPU and, where present, CUDA) while ``run()`` runs.

    For the GPU tools (tools/gpu_sync_count.py counts blocking CUDA runtime
    calls, benchmarks/bench_overlap.py measures copy/kernel overlap): each reads
    the events' ``cat``, ``name``, ``ts`` and ``dur``.
    """
    import os
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        run()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]
