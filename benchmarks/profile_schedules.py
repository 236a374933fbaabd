"""Where a pipeline step goes, per schedule: how far the measured step is from the simulator, and why.

The issue's target is the measured step within 5 % of the simulator at the
measured costs (``TraceReport.simulated``: per-stage median F, B/I, W and the
median message latency) for 1F1B, interleaved 1F1B and ZB-H1 at d = 512 and
1024; for a target missed, this is the profile that says where the time goes.
Two ranks on 127.0.0.1, one thread each, the bench_pipeline MLP (8 x
Linear(d, d)+ReLU, batch 64, 8 microbatches), built as bench_pipeline builds
our side (``CASES``, ``make_step``, ``_ours``: interleaved 1F1B runs 4 stages
on 2 ranks, looped).

Per cell (schedule, d, transport) it prints:
- the measured step (wall, all ranks: first rank in to last rank out), the
  simulator at the measured costs, their ratio, and the gap cut into parts
  that add up (``runtime/trace.replay_gap``, a replay of every traced step
  with its own time for every action): ``compute`` (the step waits on slow
  compute instances, not the medians; in two: ``mean``, the replay with each
  stage's compute at its mean in the step, i.e. the mean above the median, and
  ``spread``, the rest: which instances were slow and where), ``latency`` (each message's own, send
  start to receive end), ``SEND`` and ``RECV`` (the runtime's time in those
  actions when not waiting) and ``between`` (between actions), ``unexpl.``
  (the replay's miss: ~0 when it reproduces the step) and ``outside`` (the
  step's time outside its actions: entry, step agreement, exit). They add up
  to the mean step, which is why they are means over the traced steps;
- per rank: compute per step in the pipeline against the same stages' F and
  B (or I and W) timed *alone* (this rank computes while the other idles, the
  same StageRunner calls the executor makes), and the rank's step split into
  F, B, I, W, RECV, SEND and between actions; ``sim@alone`` is the simulator
  at the alone costs (what the step would be if both cores computing at once
  cost nothing);
- per message: median latency of those the receiver waited for, median SEND,
  median RECV that found its data there, and one copy of the message's bytes;
- one small tensor op (a message's copy, an allocation) timed without the
  pipeline: back to back, after 3 ms of matmul, after 3 ms asleep. On a
  shared VM the first op after other work runs cold (tens of µs): the floor
  under the per-message times.

    PYTHONPATH=. python benchmarks/profile_schedules.py
    PYTHONPATH=. python benchmarks/profile_schedules.py --transports gloo --dims 512
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Optional

import torch

from benchmarks.bench_pipeline import BATCH, CASES, MICROBATCHES, WORLD, _ours, _rank_of, loss_fn, make_step, mlp_stages
from pipeline_ext.comm.launch import spawn

SCHEDULES = ["1f1b", "interleaved_1f1b", "zb_h1"]
ALONE_REPS, WARMUP = 200, 3
PARTS = ("compute", "latency", "send", "recv", "between", "unexplained")


def _alone(module: torch.nn.Module, stage: int, num_stages: int, d: int, split: bool) -> dict[str, float]:
    """Median ms of this stage's F and B (or I and W) on one microbatch, the StageRunner calls the executor makes."""
    from pipeline_ext.runtime.stage import StageRunner

    runner = StageRunner(module, stage, num_stages, loss_fn=loss_fn)
    rows, last = BATCH // MICROBATCHES, stage == num_stages - 1
    x, y, g = torch.randn(rows, d), torch.randn(rows, d), torch.randn(rows, d)
    times: dict[str, list[float]] = {k: [] for k in (("F", "I", "W") if split else ("F", "B"))}
    for i in range(ALONE_REPS + 20):  # the first 20: warm-up
        t0 = time.perf_counter()
        if last:
            runner.forward(0, (x,), target=y, loss_weight=1 / MICROBATCHES, loss_fn=loss_fn)
        else:
            runner.forward(0, (x.detach(),))
        t1 = time.perf_counter()
        grads = None if last else [g]
        if split:
            runner.backward_input(0, grads)
            t2 = time.perf_counter()
            runner.backward_weight(0)
            t3 = time.perf_counter()
            got = {"F": t1 - t0, "I": t2 - t1, "W": t3 - t2}
        else:
            runner.backward(0, grads)
            got = {"F": t1 - t0, "B": time.perf_counter() - t1}
        if i >= 20:
            for k, v in got.items():
                times[k].append(v)
    runner.reset()
    module.zero_grad(set_to_none=True)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def _copy_us(d: int) -> float:
    """Median µs of one copy of a message's bytes (one microbatch's activation, 8 x d float32)."""
    src, dst = torch.randn(BATCH // MICROBATCHES, d), torch.empty(BATCH // MICROBATCHES, d)
    samples = []
    for _ in range(1000):
        t0 = time.perf_counter()
        dst.copy_(src)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def _cold_ops(reps: int = 200) -> dict[str, float]:
    """Median µs of one small tensor op (a copy of one message's bytes at d = 512, and an allocation), no
    pipeline_ext involved: back to back, right after 3 ms of matmul (as a SEND after an F), and after 3 ms
    asleep (as a RECV's unpack after its wait).

    On a shared VM the first ops after a phase of other work run with cold
    caches and TLBs (the host runs other guests on an idle vCPU): what every
    action boundary pays there, whatever the runtime does, and the floor under
    the SEND, RECV and between-action times in the tables above.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    src, dst, a = torch.randn(BATCH // MICROBATCHES, 512), torch.empty(BATCH // MICROBATCHES, 512), torch.randn(256, 256)

    def matmul() -> None:
        end = time.perf_counter() + 3e-3
        while time.perf_counter() < end:
            a @ a

    out = {}
    for gap_name, gap in (("back to back", None), ("after 3 ms of matmul", matmul),
                          ("after 3 ms asleep", lambda: time.sleep(3e-3))):
        for op_name, op in (("copy", lambda: dst.copy_(src)), ("alloc", lambda: torch.empty(4096))):
            samples = []
            for _ in range(reps):
                if gap is not None:
                    gap()
                t0 = time.perf_counter()
                op()
                samples.append(time.perf_counter() - t0)
            out[f"{op_name} {gap_name}"] = statistics.median(samples) * 1e6
    torch.set_num_threads(threads)
    return out


def _split(step: list, rank: int) -> dict[str, float]:
    """Seconds of ``rank``'s part of one traced step: per compute kind, RECV, SEND, between actions, its span."""
    spans = sorted((s for s in step if s.rank == rank), key=lambda s: s.start)
    out = {k: 0.0 for k in ("F", "B", "I", "W", "RECV", "SEND")}
    for s in spans:
        kind = s.action.kind.value
        out[kind[:4] if kind[:4] in ("RECV", "SEND") else kind] += s.end - s.start
    out["span"] = spans[-1].end - spans[0].start
    out["between"] = out["span"] - sum(out[k] for k in ("F", "B", "I", "W", "RECV", "SEND"))
    return out


def _messages(schedule, steps: list) -> dict[str, float]:
    """Medians over every message of the traced steps (µs) and counts per step.

    SEND is split by whether its receiver was already waiting in its RECV when
    the SEND started (asleep on the doorbell after a short spin, so the send
    has to wake it) or not.
    """
    from pipeline_ext.runtime.trace import transfer_samples
    from pipeline_ext.schedules.lowering import counterpart

    waited = [c for step in steps for c in transfer_samples(schedule, step)]
    to_sleeper, to_busy, found, count = [], [], [], 0
    for step in steps:
        by_action = {s.action: s for s in step}
        for s in step:
            kind = s.action.kind.value
            peer = by_action.get(counterpart(s.action, schedule.stage_to_rank)[1]) if s.action.is_comm else None
            if kind.startswith("SEND"):
                count += 1
                (to_sleeper if peer is not None and peer.start <= s.start else to_busy).append(s.end - s.start)
            elif kind.startswith("RECV") and peer is not None and s.start > peer.start:
                found.append(s.end - s.start)
    med = lambda v: statistics.median(v) * 1e6 if v else float("nan")  # noqa: E731
    n = len(steps)
    return {"per_step": count / n, "waited": med(waited), "n_waited": len(waited) / n,
            "send_sleeper": med(to_sleeper), "send_busy": med(to_busy), "found": med(found), "n_found": len(found) / n}


def _at_means(schedule, step: list) -> float:
    """The replay of ``step`` with every compute action at its (stage, kind)'s mean in the step, messages free."""
    from pipeline_ext.runtime.trace import replay

    groups: dict[tuple, list[float]] = {}
    for s in step:
        if s.action.is_compute:
            groups.setdefault((s.action.stage, s.action.kind), []).append(s.end - s.start)
    durations = {s.action: statistics.fmean(groups[(s.action.stage, s.action.kind)]) for s in step
                 if s.action.is_compute}
    timeline = replay(schedule, durations)
    return max(s.end for s in timeline) - min(s.start for s in timeline)


def _cell(rank: int, world: int, name: str, d: int, transport: str, steps: int) -> Optional[dict]:
    import torch.distributed as dist

    import pipeline_ext as pe
    from pipeline_ext import schedules as S
    from pipeline_ext.runtime.trace import replay_gap

    case = CASES[name]
    v, split = case.v_ours, name == "zb_h1"
    num_stages = WORLD * v
    modules = mlp_stages(d, num_stages)
    mine = [s for s in range(num_stages) if _rank_of(s, v) == rank]
    alone: dict[int, dict[str, float]] = {}
    copy_us = 0.0
    for who in range(world):  # one rank at a time, the other idle
        dist.barrier()
        if who == rank:
            alone = {s: _alone(modules[s], s, num_stages, d, split) for s in mine}
            copy_us = _copy_us(d)
        dist.barrier()
    torch.manual_seed(0)
    x, y = torch.randn(BATCH, d), torch.randn(BATCH, d)
    made: list = []

    def build(stages, m, loss_fn):  # make_step's schedule class: ours, kept to trace it
        made.append(_ours(name, transport, stages, m, loss_fn))
        return made[-1]

    step = make_step(build, pe.PipelineStage, modules, v, rank, MICROBATCHES, x, y)
    sched = made[0]
    for _ in range(WARMUP):
        step()
    sched.enable_tracing(True)
    walls = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        walls.append((t0, time.perf_counter()))
    report = sched.trace_report()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (alone, walls, copy_us))
    if report is None:
        return None
    schedule, costs = report.schedule, report.costs
    stage_alone = {s: t for a, _, _ in everyone for s, t in a.items()}
    alone_costs = S.Costs(f=[stage_alone[s]["F"] / 1e3 for s in range(num_stages)],
                          b=[stage_alone[s]["I" if split else "B"] / 1e3 for s in range(num_stages)],
                          w=[stage_alone[s]["W"] / 1e3 if split else 0.0 for s in range(num_stages)],
                          comm=costs.comm)
    wall = [max(everyone[r][1][i][1] for r in range(world)) - min(everyone[r][1][i][0] for r in range(world))
            for i in range(steps)]
    gaps = [replay_gap(schedule, st, costs) for st in report.steps]
    mean = lambda vals: sum(vals) / len(vals) * 1e3  # noqa: E731 - seconds to ms
    parts = {k: mean([g[k] for g in gaps]) for k in ("simulated", "traced", *PARTS)}
    # the compute part in two: each stage's compute at its mean in the step (the mean above the median),
    # and the rest (which instances were slow, and where)
    parts["compute_mean"] = mean([_at_means(schedule, st) for st in report.steps]) - parts["simulated"]
    parts["outside"] = mean(wall) - parts["traced"]
    ranks = {}
    for r in range(world):
        split_r = [_split(st, r) for st in report.steps]
        per = {k: mean([s[k] for s in split_r]) for k in split_r[0]}
        per["compute"] = sum(per[k] for k in ("F", "B", "I", "W"))
        per["alone"] = MICROBATCHES * sum(sum(stage_alone[s].values()) for s in range(num_stages)
                                          if _rank_of(s, v) == r)
        ranks[r] = per
    return {"schedule": name, "d": d, "transport": transport, "steps": steps,
            "wall": statistics.median(wall) * 1e3, "wall_mean": mean(wall),
            "wall_rank0": statistics.median(t1 - t0 for t0, t1 in everyone[0][1]) * 1e3,
            "sim": report.simulated.makespan * 1e3, "sim_alone": S.simulate(schedule, alone_costs).makespan * 1e3,
            "parts": parts, "ranks": ranks, "messages": _messages(schedule, report.steps),
            "copy_us": everyone[0][2], "comm_us": costs.comm * 1e6, "alone": stage_alone}


def worker(rank: int, world: int, cells: list[tuple[str, int]], transport: str, steps: int) -> list[dict]:
    rows = []
    for name, d in cells:
        row = _cell(rank, world, name, d, transport, steps)
        if row is not None:
            rows.append(row)
    return rows


def print_tables(rows: list[dict]) -> None:
    print("\nmeasured step vs the simulator at the measured costs; the gap in parts that add up "
          "(ms, means over the traced steps: sim + parts = mean step)")
    print(f"{'schedule':<17} {'d':>5} {'tr':<4} {'meas':>7} {'sim':>7} {'ratio':>6} | {'mean':>7} = {'sim':>6} "
          f"{'+comput':>7} {'(mean':>6} {'spread)':>7} {'+latenc':>7} {'+SEND':>6} {'+RECV':>6} {'+betwn':>6} {'+unexp':>6} {'+outsd':>6}"
          f" | {'sim@alone':>9}")
    for r in rows:
        p = r["parts"]
        print(f"{r['schedule']:<17} {r['d']:>5} {r['transport']:<4} {r['wall']:>7.1f} {r['sim']:>7.1f} "
              f"{r['wall'] / r['sim']:>5.2f}x | {r['wall_mean']:>7.1f} = {p['simulated']:>6.1f} {p['compute']:>+7.2f} "
              f"{p['compute_mean']:>+6.2f} {p['compute'] - p['compute_mean']:>+7.2f} {p['latency']:>+7.2f} {p['send']:>+6.2f} {p['recv']:>+6.2f} {p['between']:>+6.2f} "
              f"{p['unexplained']:>+6.2f} {p['outside']:>+6.2f} | {r['sim_alone']:>9.1f}")
    print("\nper rank, ms per step (means): compute in the pipeline vs the same stages alone, and the rank's step split")
    print(f"{'schedule':<17} {'d':>5} {'tr':<4} {'rank':>4} {'compute':>8} {'alone':>7} {'slow':>6} | {'F':>6} {'B':>6} "
          f"{'I':>6} {'W':>6} {'RECV':>6} {'SEND':>6} {'betwn':>6} = {'span':>6}")
    for r in rows:
        for rank, v in r["ranks"].items():
            print(f"{r['schedule']:<17} {r['d']:>5} {r['transport']:<4} {rank:>4} {v['compute']:>8.2f} {v['alone']:>7.2f} "
                  f"{v['compute'] / v['alone']:>5.2f}x | {v['F']:>6.2f} {v['B']:>6.2f} {v['I']:>6.2f} {v['W']:>6.2f} "
                  f"{v['RECV']:>6.2f} {v['SEND']:>6.2f} {v['between']:>6.2f} = {v['span']:>6.2f}")
    print("\nper message (µs, medians over the traced steps): latency of those whose receiver waited (send start to "
          "receive end; the same messages' SEND: the receiver asleep), SEND to a receiver not yet waiting, RECV that "
          "found its data, one copy of the bytes")
    print(f"{'schedule':<17} {'d':>5} {'tr':<4} {'msgs/step':>9} {'waited/step':>11} {'latency':>8} {'its SEND':>8} "
          f"{'other SEND':>10} {'found/step':>10} {'RECV found':>10} {'copy':>6}")
    for r in rows:
        m = r["messages"]
        print(f"{r['schedule']:<17} {r['d']:>5} {r['transport']:<4} {m['per_step']:>9.0f} {m['n_waited']:>11.1f} "
              f"{m['waited']:>8.0f} {m['send_sleeper']:>8.0f} {m['send_busy']:>10.0f} {m['n_found']:>10.1f} "
              f"{m['found']:>10.0f} {r['copy_us']:>6.1f}")


def _cpu_seconds() -> tuple[float, float]:
    """(CPU seconds this host has been busy, CPU seconds of this process and its finished children)."""
    import resource

    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in f.readline().split()[1:9])
    own = sum(getattr(resource.getrusage(who), k) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for k in ("ru_utime", "ru_stime"))
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"), own


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedules", nargs="+", default=SCHEDULES, choices=list(CASES))
    ap.add_argument("--dims", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--transports", nargs="+", default=["shm"], choices=["shm", "gloo"])
    ap.add_argument("--steps", type=int, default=10, help="traced steps per cell (after %d untraced)" % WARMUP)
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args()
    print(f"MLP 8 x Linear(d,d)+ReLU, batch {BATCH}, {MICROBATCHES} microbatches, {WORLD} ranks, 1 thread/rank, "
          f"torch {torch.__version__}; {args.steps} traced steps per cell; step = first rank in to last rank out")
    busy0, own0, t0 = *_cpu_seconds(), time.perf_counter()
    cells = [(name, d) for d in args.dims for name in args.schedules]
    rows = []
    for transport in args.transports:
        out = spawn(worker, WORLD, cells, transport, args.steps, timeout=args.timeout, threads=1)
        rows.extend(out[0][1])
    print_tables(rows)
    cold = _cold_ops()
    print("\none small tensor op on this machine, no pipeline_ext (µs, medians; what an action boundary pays): "
          + ", ".join(f"{k} {v:.1f}" for k, v in cold.items()))
    busy1, own1 = _cpu_seconds()
    print(f"\nCPU used by other processes during the run: {busy1 - busy0 - (own1 - own0):.1f} core-seconds in "
          f"{time.perf_counter() - t0:.0f} s on {os.cpu_count()} cores (anything else running moves these numbers)")


if __name__ == "__main__":
    main()
