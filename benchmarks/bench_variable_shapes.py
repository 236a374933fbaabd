"""Microbatches of different lengths in one step vs equal ones vs padding, ours and torch's.

A length-bucketed language-model batch has microbatches of (here) 4 sequence
lengths. pipeline_ext runs them as they are (``step_microbatches``); torch's
pipelining sizes its buffers from the first microbatch, so it can only run the
batch padded to the longest length. Rows, per step (4 microbatches of 2
sequences, 1280 real tokens in every row):

- ``equal``: 4 x (2, 160), ours (the baseline of the 2 % target);
- ``bucketed``: lengths 64, 128, 192, 256 in a new order every step (every
  shape seen before: known layouts);
- ``bucketed, new shapes``: 4 lengths summing to 640 that no earlier step had
  (every step learns its layouts: one extra small message per message);
- ``padded, ours`` and ``padded, torch``: the bucketed batch padded to 256
  (2048 tokens, 1280 real; padding masked out of the loss);
- ``unsplit, 1 rank``: the whole model on rank 0 alone over the equal and the
  new-shape microbatches: new tensor sizes cost the allocator and the kernels
  something whatever runs them, so the pipeline's own cost of new shapes is
  its ratio over this one.

The model is a token-wise residual MLP with a causal running mean for mixing
(``TokenMLP``): its cost is linear in the tokens, so every row but the padded
ones computes exactly the same FLOPs and their difference is the runtime's
(attention's quadratic cost would make 4 lengths cost more than 4 equal ones
of the same tokens, whatever the pipeline). Two ranks, 1F1B, Gloo or shared
memory (``--transport``), one intra-op thread per rank, medians of
interleaved repeats (rows timed side by side in the same processes).

    PYTHONPATH=. python benchmarks/bench_variable_shapes.py --repeats 7 --steps 3
"""
from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from typing import Callable

import torch
from torch import nn

WORLD, MICROBATCHES, ROWS, VOCAB = 2, 4, 2, 256
BUCKETS = (64, 128, 192, 256)
EQUAL = sum(BUCKETS) // len(BUCKETS)


class TokenMLP(nn.Module):
    """One stage: embedding on the first, head on the last, ``blocks`` residual MLPs over a causal running mean."""

    def __init__(self, d: int, blocks: int, first: bool, last: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d) if first else None
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                    for _ in range(blocks))
        self.head = nn.Linear(d, VOCAB) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.emb is not None:
            x = self.emb(x)
        pos = torch.arange(1, x.shape[1] + 1, dtype=x.dtype).view(1, -1, 1)
        for block in self.blocks:
            x = x + block(x.cumsum(1) / pos)
        return self.head(x) if self.head is not None else x


def stages(d: int, blocks: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [TokenMLP(d, blocks, i == 0, i == WORLD - 1) for i in range(WORLD)]


def microbatches(lengths: list[int], seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randint(0, VOCAB, (ROWS, n), generator=g) for n in lengths]
    return xs, [torch.randint(0, VOCAB, (ROWS, n), generator=g) for n in lengths]


def padded(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The microbatches as one batch padded to the longest length (targets masked with -100 there)."""
    longest = max(x.shape[1] for x in xs)
    x = torch.cat([nn.functional.pad(x, (0, longest - x.shape[1])) for x in xs])
    y = torch.cat([nn.functional.pad(y, (0, longest - y.shape[1]), value=-100) for y in ys])
    return x, y


def ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)


def worker(rank: int, world: int, d: int, blocks: int, repeats: int, steps: int, transport: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.pipelining as tp

    import pipeline_ext as pe

    first, last = rank == 0, rank == world - 1
    ours_mod, torch_mod = stages(d, blocks)[rank], stages(d, blocks)[rank]
    ours = pe.Schedule1F1B(pe.PipelineStage(ours_mod, rank, world, "cpu"), MICROBATCHES, loss_fn=pe.TokenMeanLoss(),
                           transport=transport)
    theirs = tp.Schedule1F1B(tp.PipelineStage(torch_mod, rank, world, torch.device("cpu")), MICROBATCHES, loss_fn=ce)
    rng = random.Random(1)  # the same on both ranks
    fresh = itertools.count(1)

    def new_lengths() -> list[int]:
        """4 lengths summing to 640 that no earlier step had (a new pair of offsets each call)."""
        k = next(fresh)
        a, b = k % 60 + 1, k // 60 + 1
        return [BUCKETS[0] + a, BUCKETS[1] - a, BUCKETS[2] + b, BUCKETS[3] - b]

    def ours_mbs(lengths: Callable[[], list[int]]) -> Callable[[int], None]:
        def step(i: int) -> None:
            xs, ys = microbatches(lengths(), seed=i)
            ours_mod.zero_grad(set_to_none=True)
            ours.step_microbatches(xs if first else None, target_mbs=ys if last else None)
        return step

    def shuffled() -> list[int]:
        order = list(BUCKETS)
        rng.shuffle(order)
        return order

    def ours_padded(i: int) -> None:
        x, y = padded(*microbatches(shuffled(), seed=i))
        ours_mod.zero_grad(set_to_none=True)
        ours.step(x) if first else ours.step(target=y)

    def torch_padded(i: int) -> None:
        x, y = padded(*microbatches(shuffled(), seed=i))
        torch_mod.zero_grad(set_to_none=True)
        theirs.step(x) if first else theirs.step(target=y)

    full = stages(d, blocks)  # the unsplit model, run by rank 0 alone over the same microbatches
    ce_sum = nn.CrossEntropyLoss(ignore_index=-100, reduction="sum")

    def sequential(lengths: Callable[[], list[int]]) -> Callable[[int], None]:
        def step(i: int) -> None:
            shapes = lengths()  # on every rank: the lengths' sequence stays the same on both
            if rank != 0:
                return  # the other rank waits at the barrier
            xs, ys = microbatches(shapes, seed=i)
            for m in full:
                m.zero_grad(set_to_none=True)
            for x, y in zip(xs, ys):
                out = full[1](full[0](x))
                (ce_sum(out.flatten(0, 1), y.flatten()) / real).backward()
        return step

    real = MICROBATCHES * ROWS * EQUAL
    rows: dict[str, Callable[[int], None]] = {
        "equal (unsplit, 1 rank)": sequential(lambda: [EQUAL] * MICROBATCHES),
        "new shapes (unsplit, 1 rank)": sequential(new_lengths),
        "equal (ours)": ours_mbs(lambda: [EQUAL] * MICROBATCHES),
        "bucketed (ours)": ours_mbs(shuffled),
        "bucketed, new shapes (ours)": ours_mbs(new_lengths),
        "padded (ours)": ours_padded,
        "padded (torch)": torch_padded,
    }

    def timed(fn: Callable[[int], None], n: int) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        dist.barrier()
        return (time.perf_counter() - t0) / n

    for fn in rows.values():  # warm-up: allocator, caches, every bucketed shape seen once
        timed(fn, 3)
    times: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(repeats):
        for k, fn in rows.items():
            times[k].append(timed(fn, steps))
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=2, help="residual MLP blocks per stage")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--transport", default="auto", choices=["auto", "gloo", "shm"])
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args()
    from pipeline_ext.comm.launch import spawn

    out = spawn(worker, WORLD, args.d, args.blocks, args.repeats, args.steps, args.transport, timeout=args.timeout,
                threads=1)
    med = out[0][1]
    real = MICROBATCHES * ROWS * EQUAL
    base = med["equal (ours)"]
    print(f"TokenMLP d={args.d}, {args.blocks} blocks/stage, {WORLD} ranks, 1F1B, {MICROBATCHES} microbatches x "
          f"{ROWS} rows, {real} real tokens/step, transport {args.transport}, torch {torch.__version__}; medians of "
          f"{args.repeats} interleaved repeats x {args.steps} steps")
    print(f"  {'row':<30}{'ms/step':>10}{'real tok/s':>12}{'vs equal':>10}")
    for k, t in med.items():
        ref = med["equal (unsplit, 1 rank)"] if "unsplit" in k else base
        print(f"  {k:<30}{t * 1e3:>10.1f}{real / t:>12.0f}{t / ref:>10.3f}")
    pipe = med["bucketed, new shapes (ours)"] / base
    alone = med["new shapes (unsplit, 1 rank)"] / med["equal (unsplit, 1 rank)"]
    print(f"new shapes every step: {pipe:.3f} x equal in the pipeline, {alone:.3f} x in the unsplit model on one "
          f"process (new tensor sizes cost the allocator and kernels there too): the pipeline's own extra cost "
          f"{pipe / alone:.3f}x")


if __name__ == "__main__":
    main()
