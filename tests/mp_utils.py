"""Run a function on N ranks (processes) over Gloo on 127.0.0.1, with a hard timeout.

Multi-process tests must never hang CI: every rank gets a process-group
timeout, the parent waits at most ``timeout`` seconds, and any rank still alive
afterwards is killed. A rank's exception comes back to the parent with its
traceback and fails the test.
"""
from __future__ import annotations

import datetime
import os
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

__all__ = ["free_port", "run_ranks"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple, results: Any, pg_timeout: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        out = fn(rank, world, *args)
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run_ranks(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0, pg_timeout: float = 60.0, expect_errors: bool = False
) -> dict[int, tuple[str, Any]]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned processes; return ``{rank: (status, value)}``.

    Raises AssertionError if a rank failed (unless ``expect_errors``, where a
    rank that died without reporting comes back as ``("died", exitcode)``) or
    a rank did not finish within ``timeout`` seconds (all are killed first).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, results, pg_timeout), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, tuple[str, Any]] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    # a process killed because it outlived the deadline gets exitcode -9 (SIGKILL) below
    try:
        while len(out) < world:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                break
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except Exception:  # queue.Empty: check for ranks that died without reporting
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            out[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    hung = []
    for r in sorted(set(range(world)) - set(out)):
        code = procs[r].exitcode
        if expect_errors and code is not None and code != -9:  # died on its own (not killed by us)
            out[r] = ("died", code)
        else:
            hung.append(r)
    if hung:
        raise AssertionError(f"ranks {hung} did not report within {timeout} s (killed)")
    if not expect_errors:
        errors = {r: v for r, (s, v) in out.items() if s == "error"}
        if errors:
            raise AssertionError("\n".join(f"--- rank {r}:\n{tb}" for r, tb in sorted(errors.items())))
    return out
