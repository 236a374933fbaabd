"""Message latency of the transports: a ping-pong between 2 ranks, side by side.

Three ways to move one message of N bytes from rank 0 to rank 1 and back, in
the same processes and interleaved repeats (the machine is shared and noisy;
only numbers taken side by side mean anything):

- ``torch gloo``: ``dist.send`` / ``dist.recv`` on the Gloo group (what
  torch.distributed.pipelining does per message);
- ``ours gloo``: pipeline_ext's ``DistChannel`` over the same group (C++
  ProcessGroupChannel: the executor's path with ``transport="process_group"``);
- ``ours shm``: the same channel interface over same-host shared memory
  (``transport="shm"``, csrc/runtime/shm_channel.cpp).

``--device cuda``: the tensors live on cuda:0, shared by both ranks (two
processes on one GPU), and the three ways are ``torch nccl`` (``dist.send`` /
``dist.recv`` on an NCCL group; each rank sets its own ``NCCL_HOSTID`` so that
NCCL accepts two ranks on one device), ``ours nccl`` (``DistChannel`` on that
group) and ``ours ipc`` (``transport="ipc"``, csrc/runtime/ipc_channel_cuda.cpp).
Rank 0 synchronises with the device at the end of each round trip, so the data
has landed. Default sizes then: 4 B, 64 KB, 4 MB and 64 MB.

Each side posts its receive before the peer sends (as the executor does), the
receiver waits, then answers. Printed: the median round trip in microseconds
and its ratio to torch's (> 1: faster than torch).

``--idle-ms X``: rank 1 waits X ms before it answers, as a pipeline stage
computes before it sends, so rank 0 has gone to sleep when the answer comes;
the printed round trip is then minus those X ms: what waking a sleeping
receiver costs on top of the message (on a VM an idle vCPU halts, and waking
it takes far longer than the spinning case).

    PYTHONPATH=. python benchmarks/bench_transport.py [--device cpu|cuda] [--sizes 4 65536 4194304] [--n 200]
        [--repeats 7] [--idle-ms 2]
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch


#: the three columns per device: torch's own, ours over the process group, ours over the same-host transport
COLUMNS = {"cpu": ("torch gloo", "ours gloo", "ours shm"), "cuda": ("torch nccl", "ours nccl", "ours ipc")}
DEFAULT_SIZES = {"cpu": [4, 64 << 10, 4 << 20], "cuda": [4, 64 << 10, 4 << 20, 64 << 20]}


def worker(rank: int, world: int, sizes: list[int], n: int, repeats: int, idle_s: float = 0.0,
           device: str = "cpu") -> list[dict]:
    import os
    import time

    import torch.distributed as dist
    from bench_agreement import interleaved_medians  # benchmarks/ is on sys.path when run as a script

    from pipeline_ext.runtime._ext import _C
    from pipeline_ext.comm.transport import make_channel

    peer = 1 - rank
    torch_name, pg_name, same_host_name = COLUMNS[device]
    if device == "cuda":
        os.environ["NCCL_HOSTID"] = f"pipeline_ext_bench_rank{rank}"  # two ranks on one GPU: NCCL sees two hosts
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")  # ... joined by its socket transport on the loopback
        torch.cuda.set_device(0)
        group = dist.new_group([0, 1], backend="nccl")
        pg = make_channel(group, "cuda:0", 2, "process_group")
        same_host = make_channel(None, "cuda:0", 2, "ipc")
        dev = torch.device("cuda", 0)
    else:
        group = None
        pg = make_channel(None, "cpu", 2, "process_group")
        same_host = make_channel(None, "cpu", 2, "shm")
        dev = torch.device("cpu")
    same_host.connect()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for size in sizes:
        buf = torch.ones(size, dtype=torch.uint8, device=dev)
        layout = _C.layout_of([buf])

        def torch_pp() -> None:
            if rank == 0:
                dist.send(buf, peer, group=group, tag=1)
                dist.recv(buf, peer, group=group, tag=2)
                sync()
            else:
                dist.recv(buf, peer, group=group, tag=1)
                time.sleep(idle_s)
                dist.send(buf, peer, group=group, tag=2)

        def ours(channel) -> Callable[[], None]:
            def pp() -> None:
                back = channel.recv(layout, peer, 2 - rank)  # posted ahead, as the executor does
                if rank == 0:
                    channel.send([buf], peer, 1)[0].wait(30.0, "ping")
                    back.wait(30.0, "pong")
                    sync()
                else:
                    back.wait(30.0, "ping")
                    time.sleep(idle_s)
                    channel.send([buf], peer, 2)[0].wait(30.0, "pong")
            return pp

        fns = {torch_name: torch_pp, pg_name: ours(pg), same_host_name: ours(same_host)}
        rows.append({"bytes": size, **interleaved_medians(fns, n, repeats, warmup=10)})
    return rows


def _size(n: int) -> str:
    for unit, scale in (("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=sorted(COLUMNS), default="cpu",
                    help="where the messages live: cpu (Gloo vs shared memory) or cuda (NCCL vs CUDA IPC, on cuda:0)")
    ap.add_argument("--sizes", type=int, nargs="+", default=None,
                    help="message bytes (default: 4 B, 64 KB, 4 MB; on cuda 64 MB too)")
    ap.add_argument("--n", type=int, default=200, help="round trips per timed repeat")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved repeats; medians are reported")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--idle-ms", type=float, default=0.0, help="rank 1 waits this long before answering")
    args = ap.parse_args()

    from pipeline_ext.comm.launch import spawn

    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch.cuda.is_available() is False")
    sizes = args.sizes or DEFAULT_SIZES[args.device]
    cols = COLUMNS[args.device]
    idle = args.idle_ms / 1e3
    print(f"ping-pong, 2 ranks, 1 thread/rank, {args.device}, torch {torch.__version__}; median round trip of "
          f"{args.repeats} interleaved repeats x {args.n}" + (f", minus rank 1's {args.idle_ms} ms idle" if idle else ""))
    out = spawn(worker, 2, sizes, args.n, args.repeats, idle, args.device, timeout=args.timeout, threads=1)
    print(f"{'message':>8} " + " ".join(f"{c + ' us':>14}" for c in cols) +
          f" {'torch/' + cols[1]:>16} {'torch/' + cols[2]:>16}")
    for r in out[0][1]:
        t, g, s = (r[k] - idle for k in cols)
        print(f"{_size(r['bytes']):>8} {t * 1e6:>14.1f} {g * 1e6:>14.1f} {s * 1e6:>14.1f} {t / g:>15.2f}x {t / s:>15.2f}x")


if __name__ == "__main__":
    main()
