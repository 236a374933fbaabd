"""What the step agreement costs: one exchange of step records vs Gloo's own message latency.

Every ``step()``/``eval()`` exchanges a 36-word record with every other rank
(comm/agreement.py). This times, on 2 Gloo ranks in the same
processes and interleaved repeats: the exchange (post + wait, as the executor
does it when nothing overlaps it), a plain ``dist.send``/``dist.recv``
ping-pong of the same 288 bytes (the floor: one round trip), and the record's
encode + decode alone. The exchange sends both ways at once, so about half a
round trip is the floor for it; with real compute the executor waits for it
only before the step's first message, so rank 0's first forward hides it.

    PYTHONPATH=. python benchmarks/bench_agreement.py [--n 300] [--repeats 5]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch


def worker(rank: int, world: int, n: int, repeats: int) -> dict[str, float]:
    import torch.distributed as dist

    from pipeline_ext.comm.agreement import StepAgreement, StepRecord

    agreement = StepAgreement(None, rank, world, torch.device("cpu"), 30.0)
    step = [0]

    def record() -> StepRecord:
        step[0] += 1
        return StepRecord(rank=rank, step=step[0], schedule="1f1b", schedule_key=5, n_microbatches=32,
                          num_stages=world, has_loss=True, microbatches=tuple(range(32)))

    buf = torch.zeros(len(record().encode()), dtype=torch.int64)  # a record's size: the ping-pong baseline

    def exchange() -> None:
        agreement.post(record()).records()

    def ping_pong() -> None:
        if rank == 0:
            dist.send(buf, 1, tag=3)
            dist.recv(buf, 1, tag=4)
        else:
            dist.recv(buf, 0, tag=3)
            dist.send(buf, 0, tag=4)

    def encode_decode() -> None:
        StepRecord.decode(torch.tensor(record().encode(), dtype=torch.int64).tolist(), rank)

    fns = {"exchange": exchange, "ping_pong": ping_pong, "encode_decode": encode_decode}
    return {k: t * 1e3 for k, t in interleaved_medians(fns, n, repeats).items()}


def interleaved_medians(fns: dict[str, Callable[[], None]], n: int, repeats: int, warmup: int = 20) -> dict[str, float]:
    """Median seconds per call of each ``fn``: ``repeats`` rounds of ``n`` calls each, every rank starting together."""
    import torch.distributed as dist

    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    for _ in range(repeats):
        for k, fn in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times[k].append((time.perf_counter() - t0) / n)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    from pipeline_ext.comm.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=300, help="calls per timed repeat")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    out = spawn(worker, 2, args.n, args.repeats, timeout=600, threads=1)
    row = out[0][1]
    print(f"2 ranks (Gloo), medians of {args.repeats} interleaved repeats x {args.n} calls, torch {torch.__version__}")
    print(f"step-record exchange  {row['exchange']:.3f} ms   ({row['exchange'] / row['ping_pong']:.2f}x one ping-pong)")
    print(f"Gloo ping-pong 288 B  {row['ping_pong']:.3f} ms")
    print(f"encode + decode       {row['encode_decode']:.3f} ms")


if __name__ == "__main__":
    main()
