"""Microbenchmark of pipeline_ext.runtime.ops against the torch way of doing the same.

Why: the kernels exist to make microbatch split/merge and multi-tensor messages
cheaper than ``torch.tensor_split(...)+.contiguous()``, ``torch.cat`` and
"one message per tensor". These machines are noisy, so every row measures ours
and the baseline side by side in this process, interleaved call by call, and
reports medians. ratio = baseline_time / ours_time (> 1 means ours is faster).
A second baseline is the plain copy of the same number of bytes
(``torch.empty_like(x).copy_(x)``): ``% of copy`` says how close a kernel gets
to the memory bandwidth a copy reaches (100 % = as fast as a copy).

    python benchmarks/bench_kernels.py [--quick] [--device cpu|cuda|all] [--threads N] [--markdown PATH]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, List, Sequence, Tuple

import torch

from pipeline_ext import ops

KB, MB = 1 << 10, 1 << 20
SIZES = [1 * KB, 16 * KB, 256 * KB, 1 * MB, 4 * MB, 16 * MB, 64 * MB, 256 * MB]
QUICK_SIZES = [1 * KB, 64 * KB, 1 * MB, 16 * MB]
PIECES = 4  # microbatches / tensors per call


def human(nbytes: int) -> str:
    return f"{nbytes // MB} MB" if nbytes >= MB else f"{nbytes // KB} KB"


def timed(fn: Callable[[], object], device: torch.device, inner: int = 1) -> float:
    """Seconds per call of ``fn``. On CUDA: GPU time between two events around
    ``inner`` back-to-back calls (host-synchronising each call would measure
    the launch and the synchronisation, about 20 us, instead of the copy)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(inner):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / inner


def compare(ours: Callable[[], object], base: Callable[[], object], device: torch.device,
            nbytes: int, budget_s: float) -> Tuple[float, float]:
    """Median seconds per call of (ours, base), interleaved so drift hits both equally."""
    ours(), base()  # warm-up: allocator caches, thread pool, lazy init
    first = timed(ours, device) + timed(base, device)
    # On CUDA a sample is a batch of calls lasting about 1 ms.
    inner = max(1, min(1000, int(1e-3 / max(first / 2, 1e-7)))) if device.type == "cuda" else 1
    reps = max(3, min(300, int(budget_s / max(first * inner, 1e-7))))
    t_ours: List[float] = []
    t_base: List[float] = []
    for _ in range(reps):
        t_ours.append(timed(ours, device, inner))
        t_base.append(timed(base, device, inner))
    return statistics.median(t_ours), statistics.median(t_base)


def make(nbytes: int, cols: int, device: torch.device, dtype=torch.float32) -> torch.Tensor:
    n = max(1, nbytes // torch.tensor([], dtype=dtype).element_size())
    cols = min(cols, n)
    return torch.randn(n // cols, cols, device=device).to(dtype)


def cases(nbytes: int, device: torch.device):
    """(name, payload bytes, ours, baseline) for one total size."""
    # Batch-major activations: split/merge along dim 0 (microbatching) ...
    x = make(nbytes, 256, device)
    sizes0 = ops.even_sizes(x.shape[0], PIECES)
    yield "split dim0 (views)", x, lambda: ops.split(x, sizes0, 0), \
        lambda: [p.contiguous() for p in torch.tensor_split(x, PIECES, 0)]
    # ... and along an inner dim, where the pieces must be copied.
    sizes1 = ops.even_sizes(x.shape[1], PIECES)
    yield "split dim1 (copy)", x, lambda: ops.split(x, sizes1, 1), \
        lambda: [p.contiguous() for p in torch.tensor_split(x, PIECES, 1)]
    parts0 = [p.contiguous() for p in torch.tensor_split(x, PIECES, 0)]
    yield "concat dim0", x, lambda: ops.concat(parts0, 0), lambda: torch.cat(parts0, 0)
    parts1 = [p.contiguous() for p in torch.tensor_split(x, PIECES, 1)]
    yield "concat dim1", x, lambda: ops.concat(parts1, 1), lambda: torch.cat(parts1, 1)
    out = torch.empty_like(x)
    yield "concat dim0 out=", x, lambda: ops.concat(parts0, 0, out=out), lambda: torch.cat(parts0, 0, out=out)
    # Several tensors to one peer: one packed message vs one copy per message.
    msgs = [p.to(dt) for p, dt in zip(parts0, [torch.float32, torch.bfloat16, torch.int64, torch.float16])]
    yield "pack+unpack 4 tensors", msgs, lambda: ops.unpack(*ops.pack(msgs)), one_by_one(msgs)
    # Same with a reused send buffer, as the baseline reuses its buffers.
    send = torch.empty(ops.pack(msgs)[1].nbytes, dtype=torch.uint8, device=device)
    yield "pack(out=)+unpack 4", msgs, lambda: ops.unpack(*ops.pack(msgs, out=send)), one_by_one(msgs)


def one_by_one(tensors: Sequence[torch.Tensor]) -> Callable[[], object]:
    """Baseline: every tensor copied into its own preallocated message buffer."""
    bufs = [torch.empty_like(t) for t in tensors]
    return lambda: [b.copy_(t) for b, t in zip(bufs, tensors)]


def payload(obj) -> int:
    ts = obj if isinstance(obj, (list, tuple)) else [obj]
    return sum(t.numel() * t.element_size() for t in ts)


COLUMNS = ["op", "size", "ours ms", "torch ms", "ours GB/s", "torch GB/s", "ratio", "copy GB/s", "% of copy"]


def copy_seconds(tensors: Sequence[torch.Tensor], device: torch.device, budget_s: float) -> float:
    """Median time of the plain copy of ``tensors``' bytes (one flat buffer): the bandwidth ceiling."""
    flat = torch.empty(sum(t.numel() * t.element_size() for t in tensors), dtype=torch.uint8, device=device)
    fn = lambda: torch.empty_like(flat).copy_(flat)  # noqa: E731
    return compare(fn, fn, device, flat.numel(), budget_s / 2)[0]


def run(device: torch.device, sizes: Sequence[int], budget_s: float) -> List[List[str]]:
    """Prints one table for ``device`` and returns its rows (the COLUMNS)."""
    print(f"\n== device {device} ({torch.get_num_threads()} CPU threads), {PIECES} pieces per call ==")
    header = "".join(f"{c:>11}" if i else f"{c:<24}" for i, c in enumerate(COLUMNS))
    print(header)
    print("-" * len(header))
    rows: List[List[str]] = []

    def row(name: str, nbytes: int, t_ours: float, t_base: float, t_copy: float, views: bool = False) -> None:
        gbs = lambda t: "views" if views else f"{nbytes / t / 1e9:.2f}"  # noqa: E731
        pct = "views" if views else f"{100 * t_copy / t_ours:.0f}"
        cells = [name, human(nbytes), f"{t_ours * 1e3:.4f}", f"{t_base * 1e3:.4f}", gbs(t_ours), gbs(t_base),
                 f"{t_base / t_ours:.2f}", gbs(t_copy), pct]
        rows.append(cells)
        print("".join(f"{c:>11}" if i else f"{c:<24}" for i, c in enumerate(cells)), flush=True)

    for nbytes in sizes:
        scale = budget_s * (2.0 if nbytes >= 64 * MB else 1.0)
        t_copy = None
        for name, src, ours, base in cases(nbytes, device):
            srcs = src if isinstance(src, (list, tuple)) else [src]
            if t_copy is None or len(srcs) > 1:
                t_copy = copy_seconds(srcs, device, scale)
            t_ours, t_base = compare(ours, base, device, nbytes, scale)
            row(name, payload(src), t_ours, t_base, t_copy, views="views" in name)
        print()
    # The common small message: 16 mixed small tensors (activations, masks, scalars).
    g = torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.bool]
    small = [(torch.randn(int(torch.randint(1, 64, (1,), generator=g)), 16, generator=g) > 0).to(dtypes[i % 4])
             .to(device) for i in range(16)]
    t_ours, t_base = compare(lambda: ops.unpack(*ops.pack(small)), one_by_one(small), device, 0, budget_s)
    row("pack+unpack 16 small", payload(small), t_ours, t_base, copy_seconds(small, device, budget_s))
    return rows


def markdown(tables: Sequence[Tuple[torch.device, List[List[str]]]]) -> str:
    out = [f"torch {torch.__version__}; ratio = torch_time / ours_time (> 1: ours faster); % of copy = plain "
           "copy time of the same bytes / ours (100 = copy bandwidth)."]
    for device, rows in tables:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
        out += ["", f"**{device}** ({name})", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (a smoke run)")
    parser.add_argument("--device", default="all", help="cpu, cuda, cuda:N or all (cpu + cuda if present)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the CPU rows")
    parser.add_argument("--markdown", default=None, help="also write the tables as Markdown to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = QUICK_SIZES if args.quick else SIZES
    budget = 0.05 if args.quick else 0.25  # seconds of timing per row and side (CPU; CUDA: a fifth)
    if args.device == "all":
        devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    else:
        devices = [torch.device(args.device)]
    print(f"torch {torch.__version__}; ratio = torch_time / ours_time (> 1: ours faster); "
          "baseline for split: tensor_split+contiguous, concat: torch.cat, pack: per-tensor copy_ "
          "into preallocated buffers")
    # CUDA-event samples are steady: a fifth of the CPU budget gives the same spread.
    tables = [(device, run(device, sizes, budget / 5 if device.type == "cuda" else budget)) for device in devices]
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(tables))


if __name__ == "__main__":
    main()
