"""A 2 x 2 job (two hosts, two ranks each): every edge over the process group vs the transport chosen per edge.

Four ranks on this machine; ranks 2 and 3 act as a second host
(``$PIPELINE_EXT_TEST_HOST``, comm/transport/setup.py: it only splits a host's
identity, for tests and benchmarks), so with ``transport="auto"`` the edges
0<->1 and 2<->3 go over shared memory and 1<->2 over Gloo, while
``transport="process_group"`` sends every edge over Gloo, as ``"auto"`` did
before it chose per edge. Both schedules (1F1B, 4 stages of
Linear + GELU) are built in the same processes and timed in interleaved
repeats (the machine is shared and noisy: only numbers taken side by side
mean anything). Printed: each edge's transport, the median step time of each,
and the ratio (> 1: per edge is faster). The "between hosts" edge here is
loopback Gloo, so this measures what the same-host edges gain, not a network.

    PYTHONPATH=. python benchmarks/bench_edge_transport.py [--width 1024] [--batch 64] [--microbatches 8]
        [--n 10] [--repeats 7]
"""
from __future__ import annotations

import argparse

import torch


def worker(rank: int, world: int, width: int, batch: int, m: int, n: int, repeats: int) -> dict:
    import os

    from torch import nn

    import pipeline_ext as pe
    from bench_agreement import interleaved_medians  # benchmarks/ is on sys.path when run as a script
    from pipeline_ext.comm.transport import HOST_ENV

    os.environ[HOST_ENV] = "hostB" if rank >= 2 else "hostA"  # before any channel: ranks 2, 3 on "another host"

    def schedule(transport: str):
        torch.manual_seed(rank)
        stage = pe.PipelineStage(nn.Sequential(nn.Linear(width, width), nn.GELU()), rank, world, "cpu")
        return pe.Schedule1F1B(stage, m, loss_fn=lambda out, y: ((out - y) ** 2).mean(), transport=transport,
                               timeout=120.0)

    torch.manual_seed(0)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    scheds = {"process_group": schedule("process_group"), "per edge": schedule("auto")}

    def step(sched):
        def run() -> None:
            sched.step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None)
        return run

    times = interleaved_medians({k: step(s) for k, s in scheds.items()}, n, repeats, warmup=3)
    return {"times": times, "edges": {k: s.transport_per_edge for k, s in scheds.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=1024, help="features per row (messages: rows x width x 4 bytes)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--n", type=int, default=10, help="steps per timed repeat")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved repeats; medians are reported")
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args()

    from pipeline_ext.comm.launch import spawn

    out = spawn(worker, 4, args.width, args.batch, args.microbatches, args.n, args.repeats,
                timeout=args.timeout, threads=1)
    row = out[0][1]
    message = args.batch // args.microbatches * args.width * 4
    print(f"2 x 2 job (ranks 2, 3 on a simulated second host), 1F1B, 4 stages Linear({args.width}) + GELU, "
          f"batch {args.batch}, {args.microbatches} microbatches ({message // 1024} KB per message), 1 thread/rank, "
          f"torch {torch.__version__}; median step of {args.repeats} interleaved repeats x {args.n}")
    for kind, edges in row["edges"].items():
        print(f"  {kind:>13}: " + ", ".join(f"{e} {k}" for e, k in edges.items()))
    pg, per_edge = row["times"]["process_group"], row["times"]["per edge"]
    print(f"  all process group {pg * 1e3:8.2f} ms/step")
    print(f"  per edge          {per_edge * 1e3:8.2f} ms/step")
    print(f"  ratio (process group / per edge): {pg / per_edge:.2f}x")


if __name__ == "__main__":
    main()
