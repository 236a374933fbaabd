"""How much copy time the copy streams hide behind compute (needs a CUDA GPU).

Why: the point of the LocalHub copy streams is that a stage's activations go
to the next device (and gradients come back) while the GPU keeps computing.
With one GPU, a stage on ``cuda:0`` next to a stage on the CPU exercises both
directions over PCIe:

- ``d2h``: a GPU rank computes microbatch i+1 while microbatch i is copied to
  a CPU rank (which waits in its own thread, as a Pipe worker does);
- ``h2d``: a CPU rank sends microbatch i+1 while the GPU rank computes on i
  (from pinned memory, as a ``DataLoader(pin_memory=True)`` gives it, and
  from pageable memory, which the channel stages through pinned memory);
- ``pipe``: a whole ``Pipe.step`` on ``["cuda:0", "cpu"]`` (heavy GPU stage,
  light CPU stage), both directions at once.

Each case runs twice side by side: ours (copies on the copy streams) and the
baseline, ``LocalHub(copy_streams=False)``, which queues the same copies on
the compute stream. Two measures of the copy time hidden behind compute:

- ``hidden (trace)``: from the CUDA profiler's GPU timeline, the fraction of
  memcpy time that runs while a compute kernel runs;
- ``hidden (time)``: ``(C + X - T) / X`` from CUDA-event timings of compute
  alone (C), copies alone (X) and both together (T).

    python benchmarks/bench_overlap.py [--quick] [--markdown PATH]
"""
from __future__ import annotations

import argparse
import functools
import math
import statistics
import threading
from typing import Callable, Optional

import torch
from torch import nn

import pipeline_ext as pe
from pipeline_ext import pipe as pipe_module
from pipeline_ext.runtime.local import LocalHub
from pipeline_ext.runtime.trace import profiler_events

GPU = torch.device("cuda:0")


class Timer:
    """Elapsed GPU time between two CUDA events bracketing host-synchronised work."""

    def __enter__(self) -> "Timer":
        torch.cuda.synchronize()
        self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.start.record()
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize()  # every stream, copy streams included, is done
        self.end.record()
        self.end.synchronize()
        self.ms = self.start.elapsed_time(self.end)


def compute(x: torch.Tensor, w: torch.Tensor, iters: int) -> torch.Tensor:
    for _ in range(iters):
        x = torch.tanh(x @ w)
    return x


def d2h(hub: LocalHub, xs: list[torch.Tensor], w: torch.Tensor, iters: int) -> None:
    """GPU rank computes and sends every microbatch; a CPU rank receives them in its own thread."""
    sink = threading.Thread(target=lambda: [hub.channel(1).recv(0, i).wait(60.0, "d2h") for i in range(len(xs))])
    sink.start()
    for i, x in enumerate(xs):
        hub.channel(0).send([compute(x, w, iters) if iters else x], 1, i)
    sink.join()


def h2d(hub: LocalHub, xs: list[torch.Tensor], w: torch.Tensor, iters: int) -> None:
    """A CPU rank sends every microbatch; the GPU rank computes on each as it arrives."""
    source = threading.Thread(target=lambda: [hub.channel(0).send([x], 1, i) for i, x in enumerate(xs)])
    source.start()
    for i in range(len(xs)):
        (x,) = hub.channel(1).recv(0, i).wait(60.0, "h2d")
        if iters:
            compute(x, w, iters)
    source.join()


def hidden_from_trace(run: Callable[[], None]) -> float:
    """Fraction of GPU memcpy time that overlaps a running compute kernel, from the profiler."""
    events = profiler_events(lambda: (run(), torch.cuda.synchronize()))
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel")
    copies = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "gpu_memcpy"]
    merged: list[list[float]] = []
    for a, b in kernels:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    total = sum(b - a for a, b in copies)
    if total <= 0:
        return float("nan")
    covered = sum(max(0.0, min(b, kb) - max(a, ka)) for a, b in copies for ka, kb in merged)
    return covered / total


def median_ms(run: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        with Timer() as t:
            run()
        times.append(t.ms)
    return statistics.median(times)


def calibrate(mb_bytes: int, dim: int) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    """Microbatch-sized inputs and the matmul count that makes compute about 1.5x the copy."""
    rows = mb_bytes // (dim * 4)
    w = torch.randn(dim, dim, device=GPU) / math.sqrt(dim)
    x = torch.randn(rows, dim, device=GPU)
    hub = LocalHub([GPU, "cpu"])
    one = lambda: d2h(hub, [x], w, 0)  # noqa: E731
    one()
    copy_ms = median_ms(one, 5)
    mm_ms = median_ms(lambda: compute(x, w, 4), 5) / 4
    return [x], w, max(1, math.ceil(1.5 * copy_ms / mm_ms))


def case(direction: str, n_mb: int, mb_bytes: int, dim: int, repeats: int, pinned: bool = True) -> dict:
    (x,), w, iters = calibrate(mb_bytes, dim)
    xs_gpu = [x.clone() for _ in range(n_mb)]
    xs_cpu = [x.cpu().pin_memory() if pinned else x.cpu() for _ in range(n_mb)]
    fn, xs = (d2h, xs_gpu) if direction == "d2h" else (h2d, xs_cpu)
    label = direction if direction == "d2h" else f"h2d ({'pinned' if pinned else 'pageable'} source)"
    row = {"case": label, "microbatches": n_mb, "MB per copy": mb_bytes / 2**20, "matmuls per mb": iters}
    copy_alone = median_ms(lambda: fn(LocalHub([GPU, "cpu"] if direction == "d2h" else ["cpu", GPU]), xs, w, 0),
                           repeats)
    compute_alone = median_ms(lambda: [compute(t, w, iters) for t in xs_gpu], repeats)
    row["compute ms"], row["copy ms"] = compute_alone, copy_alone
    for label, streams in (("ours", True), ("compute stream", False)):
        make = lambda: LocalHub([GPU, "cpu"] if direction == "d2h" else ["cpu", GPU], copy_streams=streams)  # noqa: E731
        run = lambda: fn(make(), xs, w, iters)  # noqa: E731
        run()  # warm-up: pinned host blocks, cuBLAS
        total = median_ms(run, repeats)
        row[f"{label} ms"] = total
        row[f"{label} hidden (time)"] = max(0.0, min(1.0, (compute_alone + copy_alone - total) / copy_alone))
        row[f"{label} hidden (trace)"] = hidden_from_trace(run)
    return row


def pipe_case(n_mb: int, dim: int, layers: int, repeats: int) -> dict:
    """Pipe.step on [cuda:0, cpu]: a heavy GPU stage, then a light CPU head."""
    torch.manual_seed(0)
    gpu_stage = nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(layers)])
    model = nn.Sequential(gpu_stage, nn.Linear(dim, 8))
    x, y = torch.randn(n_mb * 512, dim), torch.randn(n_mb * 512, 8)
    row = {"case": "pipe [cuda:0, cpu]", "microbatches": n_mb, "MB per copy": 512 * dim * 4 / 2**20,
           "matmuls per mb": layers}
    original = pipe_module.LocalHub
    try:
        for label, streams in (("ours", True), ("compute stream", False)):
            pipe_module.LocalHub = functools.partial(LocalHub, copy_streams=streams)
            pipe = pe.Pipe(model, balance=[1, 1], devices=["cuda:0", "cpu"], chunks=n_mb, schedule="1f1b",
                           checkpoint="never")
            run = lambda: pipe.step(x, target=y, loss_fn=nn.functional.mse_loss)  # noqa: E731
            run()
            row[f"{label} ms"] = median_ms(run, repeats)
            row[f"{label} hidden (trace)"] = hidden_from_trace(run)
            row[f"{label} hidden (time)"] = float("nan")
            model.zero_grad(set_to_none=True)
    finally:
        pipe_module.LocalHub = original
    return row


COLUMNS = ["case", "microbatches", "MB per copy", "matmuls per mb", "compute ms", "copy ms", "ours ms",
           "compute stream ms", "ours hidden (trace)", "compute stream hidden (trace)", "ours hidden (time)",
           "compute stream hidden (time)"]


def fmt(v: object) -> str:
    if isinstance(v, float):
        return "n/a" if math.isnan(v) else f"{v:.3f}" if v < 10 else f"{v:.1f}"
    return str(v)


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(fmt(r.get(c, float("nan"))) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller copies, fewer repeats")
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_overlap: no GPU (torch.cuda.is_available() is False); nothing to measure")
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    mb_bytes, repeats = (4 << 20, 3) if args.quick else (16 << 20, 7)
    # The last copy of a run has no compute after it to hide behind, so at most
    # (n-1)/n of the copy time can be hidden: 32 microbatches allow 97 %.
    # Host->device from a pinned source is what a DataLoader(pin_memory=True)
    # hands over; from pageable memory the sender first stages the bytes into
    # pinned memory on the host (LocalChannel does), which bounds the rate.
    rows = [case("d2h", 32, mb_bytes, 2048, repeats), case("h2d", 32, mb_bytes, 2048, repeats),
            case("h2d", 32, mb_bytes, 2048, repeats, pinned=False), pipe_case(8, 2048, 8, repeats)]
    text = (f"GPU: {torch.cuda.get_device_name(GPU)}, torch {torch.__version__}. Times are medians of {repeats} "
            "runs (CUDA events). 'ours' copies on the copy streams; 'compute stream' queues the same copies on "
            "the compute stream.\n\n" + table(rows) + "\n")
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
