"""Cost of splitting a backward into I (input grads) + W (weight grads) vs one full B.

Zero-bubble schedules only pay off if I + W costs about what B costs. This runs
a stack of transformer blocks and times, side by side and interleaved (so both
see the same machine noise), a full ``backward`` and ``backward_input`` followed
by ``backward_weight``. It prints the medians and the ratio (I+W)/B, plus I/B:
I alone should be well under B, since it skips the weight-grad matmuls.

    python benchmarks/bench_split_backward.py [--layers 4] [--d 512] [--batch 4] [--seq 128] [--repeats 15]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from pipeline_ext.runtime.split import backward_input, backward_weight


def time_whole(model: nn.Module, x: torch.Tensor) -> float:
    """Seconds of one full backward B of ``model(x)`` (the forward is not timed)."""
    inp = x.clone().requires_grad_(True)
    out = model(inp)
    g = torch.ones_like(out)
    t0 = time.perf_counter()
    out.backward(g)
    return time.perf_counter() - t0


def time_split(model: nn.Module, x: torch.Tensor) -> tuple[float, float]:
    """Seconds of I + W and of I alone for ``model(x)`` (the forward is not timed)."""
    inp = x.clone().requires_grad_(True)
    out = model(inp)
    g = torch.ones_like(out)
    t0 = time.perf_counter()
    _, deferred = backward_input([out], [g], [inp])
    t1 = time.perf_counter()
    backward_weight(deferred)
    return time.perf_counter() - t0, t1 - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    stack = nn.Sequential(
        *[nn.TransformerEncoderLayer(args.d, 4, 4 * args.d, dropout=0.0, batch_first=True) for _ in range(args.layers)]
    )
    x = torch.randn(args.batch, args.seq, args.d)

    for _ in range(3):
        time_whole(stack, x), time_split(stack, x)
    b, iw, i = [], [], []
    for _ in range(args.repeats):
        stack.zero_grad(set_to_none=True)
        b.append(time_whole(stack, x))
        stack.zero_grad(set_to_none=True)
        total, first = time_split(stack, x)
        iw.append(total)
        i.append(first)
    mb, miw, mi = statistics.median(b), statistics.median(iw), statistics.median(i)
    print(f"transformer stack: {args.layers} layers, d={args.d}, batch {args.batch}x{args.seq}, {args.threads} thread(s)")
    print(f"  full backward B      {mb * 1e3:8.2f} ms")
    print(f"  I + W                {miw * 1e3:8.2f} ms   (I+W)/B = {miw / mb:.3f}")
    print(f"  I alone              {mi * 1e3:8.2f} ms   I/B     = {mi / mb:.3f}")


if __name__ == "__main__":
    main()
