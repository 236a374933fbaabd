"""Compiled stages under ZB-H1: the real I/W split (``split_backend``) vs the fallback (inductor).

With torch's inductor backend a compiled stage is one opaque autograd node, so
the zero-bubble schedules fall back to a whole backward at I (W does nothing):
exact, but the stage's I costs a full backward and there is no W left to fill
bubbles. ``pipeline_ext.split_backend`` cuts the compiled backward into an
input-grad graph (I) and a weight-grad graph (W).

Two measurements, each side by side in interleaved repeats (shared, noisy
machines: only ratios taken in the same run mean anything):

1. one process, one compiled stage: median time of I, and of I + W, relative
   to a whole backward B of the same stage compiled by inductor (the fallback's I);
2. two Gloo ranks, ZB-H1, every stage compiled: median step time with
   ``split_backend`` over the fallback's (below 1: the split pays).

    PYTHONPATH=. python benchmarks/bench_compiled_split.py [--d 256] [--layers 4] [--rows 64] [--microbatches 8] [--repeats 7]
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Any, Callable

import torch
from torch import nn


def stage_module(d: int, layers: int, seed: int) -> nn.Module:
    """``layers`` residual MLP blocks (LayerNorm, Linear, GELU, Linear): the weight-heavy part of a transformer."""
    torch.manual_seed(seed)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(nn.functional.gelu(self.up(self.norm(x))))

    return nn.Sequential(*[Block() for _ in range(layers)])


def _median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def single_stage(args: argparse.Namespace) -> None:
    """I and I + W of a split_backend stage against B of an inductor stage (the fallback's I)."""
    import pipeline_ext as pe
    from bench_split_backward import time_split, time_whole  # benchmarks/ is on sys.path when run as a script

    torch.set_num_threads(args.threads)
    rows = args.rows // args.microbatches
    fallback = torch.compile(stage_module(args.d, args.layers, 0), backend="inductor")
    split = torch.compile(stage_module(args.d, args.layers, 0), backend=pe.split_backend)
    x = torch.randn(rows, args.d)

    for _ in range(3):  # compile, warm up
        time_whole(fallback, x), time_split(split, x)
    b, i, iw = [], [], []
    for _ in range(args.repeats * 5):
        b.append(time_whole(fallback, x))
        tiw, ti = time_split(split, x)
        i.append(ti)
        iw.append(tiw)
    print(f"one stage ({args.layers} blocks, d={args.d}, {rows} rows), medians of {len(b)}:")
    print(f"  fallback I (= whole B, inductor)   {_median_ms(b):8.3f} ms")
    print(f"  split I (split_backend)            {_median_ms(i):8.3f} ms   I/B = {statistics.median(i) / statistics.median(b):.2f}")
    print(f"  split I + W                        {_median_ms(iw):8.3f} ms   (I+W)/B = {statistics.median(iw) / statistics.median(b):.2f}")


def _zb_h1_rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """Step times of ZB-H1 with the fallback and with split_backend, alternating."""
    import pipeline_ext as pe

    warnings.simplefilter("ignore", pe.UnsplitBackwardWarning)  # the fallback is what is measured here
    torch._dynamo.config.cache_size_limit = 64
    x = torch.randn(args.rows, args.d)
    y = torch.randn(args.rows, args.d)
    runs: dict[str, Callable[[], None]] = {}
    for label, backend in (("eager", None), ("fallback", "inductor"), ("split", pe.split_backend)):
        module = stage_module(args.d, args.layers, rank)
        module = torch.compile(module, backend=backend) if backend is not None else module
        stage = pe.PipelineStage(module, rank, world, "cpu")
        sched = pe.ScheduleZBH1(stage, args.microbatches, loss_fn=nn.functional.mse_loss)

        def step(sched: Any = sched) -> None:
            sched.step(x if rank == 0 else None, target=y if rank == world - 1 else None)

        runs[label] = step
    times: dict[str, list[float]] = {label: [] for label in runs}
    for r in range(args.repeats + 2):
        for label, step in runs.items():
            torch.distributed.barrier()
            t0 = time.perf_counter()
            step()
            if r >= 2:  # the first two compile and warm up
                times[label].append(time.perf_counter() - t0)
    return times


def zb_h1(args: argparse.Namespace) -> None:
    from pipeline_ext.comm.launch import spawn

    out = spawn(_zb_h1_rank, 2, args, timeout=1200, threads=args.threads)
    # a step ends when its slowest rank does: take the max over ranks per repeat
    per = {label: [max(v[label][k] for _, v in out.values()) for k in range(args.repeats)]
           for label in ("eager", "fallback", "split")}
    fb, sp = statistics.median(per["fallback"]), statistics.median(per["split"])
    print(f"ZB-H1, 2 Gloo ranks, {args.layers} blocks per stage, d={args.d}, {args.rows} rows, "
          f"{args.microbatches} microbatches, median of {args.repeats} steps:")
    print(f"  eager stages          {1e3 * statistics.median(per['eager']):8.1f} ms   (for reference)")
    print(f"  fallback (inductor)   {1e3 * fb:8.1f} ms")
    print(f"  split (split_backend) {1e3 * sp:8.1f} ms   split / fallback = {sp / fb:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", choices=["single", "zb_h1"], default=None)
    args = ap.parse_args()
    if args.only != "zb_h1":
        single_stage(args)
    if args.only != "single":
        zb_h1(args)


if __name__ == "__main__":
    main()
