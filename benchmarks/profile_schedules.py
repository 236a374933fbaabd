"""Where a 1F1B step goes: compute, waiting, sends and runtime per rank, from the tracer's spans.

The profile behind docs/performance.md's "Where 1F1B's time goes". 1F1B stays below the
issue's targets (1.3x torch at d = 512, efficiency 0.85 at d = 1024). This
script shows which part of a step is the model, which part is the schedule and
which part is the transport. Two ranks on 127.0.0.1, one thread each, the
bench_pipeline MLP (8 x Linear(d, d)+ReLU, batch 64, 8 microbatches).

For each rank it prints:
- each stage's F and B timed *alone*: this rank computes while the other idles;
- the median traced step (10 steps) split into F, B, waiting in RECV, starting
  SENDs, and the runtime between actions;
- the simulator's step at the costs the tracer measured.

    PYTHONPATH=. python benchmarks/profile_schedules.py --dims 512 1024 --transports shm gloo
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Optional

import torch

from benchmarks.bench_pipeline import loss_fn, mlp_stages
from pipeline_ext.dist.launch import spawn

MICROBATCHES, BATCH, STEPS = 8, 64, 10


def _alone(module: torch.nn.Module, rank: int, d: int) -> tuple[float, float]:
    """Median ms of this stage's F and B on one microbatch (the last stage with its loss)."""
    x = torch.randn(BATCH // MICROBATCHES, d, requires_grad=rank == 1)
    y = torch.randn(BATCH // MICROBATCHES, d)
    fwd, bwd = [], []
    for i in range(220):
        t0 = time.perf_counter()
        out = module(x)
        loss = loss_fn(out, y) if rank == 1 else out
        t1 = time.perf_counter()
        loss.backward() if rank == 1 else out.backward(torch.ones_like(out))
        if i >= 20:  # warm-up
            fwd.append(t1 - t0)
            bwd.append(time.perf_counter() - t1)
    return statistics.median(fwd) * 1e3, statistics.median(bwd) * 1e3


def _spans(report, rank: int) -> dict[str, float]:
    """Median ms per step of each part of ``rank``'s traced steps."""
    parts: dict[str, list[float]] = {k: [] for k in ("span", "F", "B", "RECV", "SEND", "between")}
    for step in report.steps:
        spans = sorted((s for s in step if s.rank == rank), key=lambda s: s.start)
        sums = {"F": 0.0, "B": 0.0, "RECV": 0.0, "SEND": 0.0}
        for s in spans:
            kind = s.action.kind.value
            sums[kind[:4] if kind[:4] in ("RECV", "SEND") else ("F" if kind == "F" else "B")] += s.end - s.start
        span = spans[-1].end - spans[0].start
        for k, v in sums.items():
            parts[k].append(v)
        parts["span"].append(span)
        parts["between"].append(span - sum(sums.values()))
    return {k: statistics.median(v) * 1e3 for k, v in parts.items()}


def worker(rank: int, world: int, d: int, transport: str) -> Optional[dict]:
    import torch.distributed as dist

    import pipeline_ext as pe

    torch.manual_seed(0)
    x, y = torch.randn(BATCH, d), torch.randn(BATCH, d)
    module = mlp_stages(d, 2)[rank]
    alone = (0.0, 0.0)
    for who in range(world):  # one rank at a time, the other idle
        dist.barrier()
        if who == rank:
            alone = _alone(module, rank, d)
        dist.barrier()
    module.zero_grad(set_to_none=True)
    sched = pe.Schedule1F1B(pe.PipelineStage(module, rank, 2, "cpu"), MICROBATCHES, loss_fn=loss_fn,
                            transport=transport)

    def step() -> None:
        sched.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None)

    for _ in range(3):
        step()
    sched.enable_tracing(True)
    walls = []
    for _ in range(STEPS):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        walls.append(time.perf_counter() - t0)
    report = sched.trace_report()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, alone)
    if report is None:
        return None
    return {"wall": statistics.median(walls) * 1e3, "sim": report.simulated.makespan * 1e3,
            "ranks": {r: {**_spans(report, r), "alone": everyone[r]} for r in range(world)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--transports", nargs="+", default=["shm", "gloo"], choices=["shm", "gloo"])
    args = ap.parse_args()
    for d in args.dims:
        for transport in args.transports:
            out = spawn(worker, 2, d, transport, timeout=600, threads=1)[0][1]
            print(f"d={d} {transport}: step {out['wall']:.1f} ms (wall, median of {STEPS}); "
                  f"simulator at the measured costs {out['sim']:.1f} ms")
            for r, v in out["ranks"].items():
                print(f"  rank {r}: F {v['F']:.1f} + B {v['B']:.1f} + waiting in RECV {v['RECV']:.1f} + SEND "
                      f"{v['SEND']:.2f} + between actions {v['between']:.2f} = {v['span']:.1f} ms; per microbatch "
                      f"in the pipeline F {v['F'] / MICROBATCHES:.2f} B {v['B'] / MICROBATCHES:.2f}, alone "
                      f"F {v['alone'][0]:.2f} B {v['alone'][1]:.2f} ms")


if __name__ == "__main__":
    main()
