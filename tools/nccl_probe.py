"""Where two ranks sharing one GPU over NCCL stop, if they stop: one line per rank and stage, NCCL's own log beside.

The multi-process GPU tests run every rank on cuda:0, each an NCCL host of its
own (``NCCL_HOSTID``, sockets on ``lo``: ``comm.launch.spawn(own_nccl_host=True)``).
When they hang, this says at which call, under which NCCL settings: each
variant starts two plain rank processes (no pool, no fork server), each rank
does init, all_reduce, send/recv, barrier and destroy on cuda:0 and prints a
line after each; a rank still running after ``--timeout`` seconds dumps its
Python stack (faulthandler) and is killed. NCCL's log (``NCCL_DEBUG=INFO``)
of each rank goes to ``DIR/VARIANT-rankN.log``. Variants run in order until one gets
through; the last line names it, as ``shell exports`` (a caller may adopt it).

    python tools/nccl_probe.py [--timeout 25] [--variants ours nocumem ...] DIR
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

#: the settings each variant adds to the rank's environment (NCCL_HOSTID per rank unless "same_host")
VARIANTS = {
    "ours": {},
    "nocumem": {"NCCL_CUMEM_ENABLE": "0"},
    "socket_only": {"NCCL_CUMEM_ENABLE": "0", "NCCL_SHM_DISABLE": "1", "NCCL_P2P_DISABLE": "1",
                    "NCCL_NVLS_ENABLE": "0", "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket"},
    "same_host": {},  # no NCCL_HOSTID: NCCL's duplicate-GPU check is expected to refuse
}


def rank_main(rank: int, world: int, port: int, timeout: float) -> None:
    import datetime
    import faulthandler

    faulthandler.dump_traceback_later(timeout - 3, exit=False)
    t0 = time.monotonic()

    def say(what: str) -> None:
        print(f"rank {rank} {time.monotonic() - t0:6.1f}s {what}", flush=True)

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    say("cuda ready")
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout))
    say("init_process_group")
    x = torch.full((1024,), float(rank + 1), device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    say(f"all_reduce {x[0].item()} (want 3.0)")
    y = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    if rank == 0:
        dist.send(y, 1)
    else:
        z = torch.empty_like(y)
        dist.recv(z, 0)
        torch.cuda.synchronize()
        say(f"recv exact: {bool(torch.equal(z, y))}")
    torch.cuda.synchronize()
    say("send/recv")
    dist.barrier()
    say("barrier")
    dist.destroy_process_group()
    say("destroy_process_group")


def run_variant(name: str, out_dir: str, timeout: float) -> bool:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, NCCL_DEBUG="INFO", NCCL_SOCKET_IFNAME="lo", GLOO_SOCKET_IFNAME="lo",
                   PYTHONUNBUFFERED="1", **VARIANTS[name])
        if name != "same_host":
            env["NCCL_HOSTID"] = f"nccl-probe-{os.getpid()}-{name}-rank-{rank}"
        log = open(os.path.join(out_dir, f"{name}-rank{rank}.log"), "w")
        procs.append((subprocess.Popen([sys.executable, __file__, "--rank", str(rank), "--port", str(port),
                                        "--timeout", str(timeout)], env=env, stdout=log, stderr=subprocess.STDOUT),
                      log))
    deadline = time.monotonic() + timeout + 5
    for p, _ in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    ok = True
    for rank, (p, log) in enumerate(procs):
        log.close()
        lines = open(log.name).read().splitlines()
        ours = [line for line in lines if line.startswith(f"rank {rank} ")]
        ok = ok and p.returncode == 0 and any("destroy_process_group" in line for line in ours)
        print(f"  {name} rank {rank}: exit {p.returncode}; {ours[-1] if ours else 'no progress line'}")
        for line in [line for line in lines if "WARN" in line or "Error" in line or "error" in line][-4:]:
            print(f"    | {line[:200]}")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", nargs="?")
    ap.add_argument("--timeout", type=float, default=25.0)
    ap.add_argument("--variants", nargs="+", default=["ours", "nocumem", "socket_only"], choices=list(VARIANTS),
                    help="tried in order until one gets through (same_host: always run)")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        rank_main(args.rank, 2, args.port, args.timeout)
        return
    os.makedirs(args.dir, exist_ok=True)
    first = None
    for name in args.variants:
        ok = run_variant(name, args.dir, args.timeout)
        print(f"{name}: {'through' if ok else 'STOPPED'}", flush=True)
        if ok and first is None and name != "same_host":
            first = name
        if first is not None and name != "same_host" and "same_host" not in args.variants:
            break
    exports = " ".join(f"{k}={v}" for k, v in VARIANTS[first].items()) if first else ""
    print(f"first variant through: {first or 'none'}" + (f"; exports: {exports}" if exports else ""))
    sys.exit(0 if first else 1)


if __name__ == "__main__":
    main()
