"""Start N local worker processes over Gloo and collect what each returns.

The demo and the benchmarks start their own ranks instead of asking the user
for ``torchrun``: one command must be enough to see a pipeline train. This is
the small, safe version of that: processes from a fork server
(``torch.multiprocessing``) that has imported the caller's script, torch and
pipeline_ext once for all the ranks (a spawned rank re-imports them, seconds
each on a small machine), Gloo on 127.0.0.1 on a free port, a process-group timeout on every collective,
one wall-clock timeout for the whole run after which every rank still alive is
killed, and a rank's exception comes back to the caller with its traceback.
"""
from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable, Optional

__all__ = ["free_port", "init_group", "spawn", "RankError"]


class RankError(RuntimeError):
    """A worker rank raised, died, or did not finish in time."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(backend: str, init_method: str, rank: int, world: int, pg_timeout: float) -> None:
    """``dist.init_process_group``, returning on no rank before it has returned on every rank.

    Why: Gloo connects a new group's pairs one side at a time, so a rank whose
    init has returned can run a short task and destroy the group while a peer
    is still connecting its side, which then fails with "Connection closed by
    peer". One all-reduce of a CPU tensor (Gloo, also under
    ``"cpu:gloo,cuda:nccl"``) closes that window. A group without Gloo has no
    such window (NCCL connects at its first collective) and gets none.
    """
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=pg_timeout))
    if "gloo" in backend:
        dist.all_reduce(torch.zeros(1))


def _entry(fn: Callable[..., Any], rank: int, world: int, init_method: str, args: tuple, results: Any,
           pg_timeout: float, threads: Optional[int], backend: str = "gloo", own_nccl_host: bool = False,
           env: Optional[dict] = None) -> None:
    import torch
    import torch.distributed as dist

    if env is not None:  # a forkserver child has the fork server's environment, not the caller's
        os.environ.clear()
        os.environ.update(env)
    if threads is not None:
        torch.set_num_threads(threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if own_nccl_host:
        os.environ["NCCL_HOSTID"] = f"pipeline_ext-{init_method.rsplit('/', 1)[-1]}-rank-{rank}"
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    try:
        init_group(backend, init_method, rank, world, pg_timeout)
        results.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


#: what the fork server imports once for every rank it forks: torch, pipeline_ext, then the caller's script (and with
#: it what the script imports, as a spawned rank would import it) and a ``gc.freeze`` (``comm.forkserver_main``)
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "pipeline_ext", "pipeline_ext.comm.forkserver_main"]


def _context(context: Any) -> Any:
    """The multiprocessing context ``context`` names (``"forkserver"``: with ``FORKSERVER_PRELOAD``), or itself."""
    import torch.multiprocessing as mp

    if not isinstance(context, str):
        return context
    if context == "forkserver" and "forkserver" not in mp.get_all_start_methods():  # pragma: no cover - not Linux
        context = "spawn"
    ctx = mp.get_context(context)
    if context == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # no effect once this process's fork server runs
        _start_fork_server()
    return ctx


def _start_fork_server() -> None:
    """Start this process's fork server (if it is not running) with the caller's script path in its environment.

    ``comm.forkserver_main`` runs the script there, so a rank does not run it
    again (multiprocessing's own ``"__main__"`` preload does nothing before
    Python 3.13.8). A script started as a module (``python -m``) is left to
    multiprocessing: each rank imports it by name, as without the server.
    """
    from multiprocessing import forkserver, spawn as mp_spawn

    from .forkserver_main import MAIN_ENV

    path = mp_spawn.get_preparation_data("pipeline_ext").get("init_main_from_path")
    saved = os.environ.get(MAIN_ENV)
    if path:
        os.environ[MAIN_ENV] = path  # the server inherits the environment as it is now; restored just below
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            os.environ.pop(MAIN_ENV, None)
        else:
            os.environ[MAIN_ENV] = saved


def spawn(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300.0, pg_timeout: float = 60.0,
          threads: Optional[int] = 1, raise_errors: bool = True, backend: str = "gloo",
          own_nccl_host: bool = False, context: Any = "forkserver",
          init_method: Optional[str] = None) -> dict[int, tuple[str, Any]]:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return ``{rank: (status, value)}``.

    ``fn`` must be importable (a module-level function). ``threads`` sets each
    rank's intra-op threads (None leaves torch's default). ``backend`` is the
    default group's (``"cpu:gloo,cuda:nccl"`` for GPU stages). ``own_nccl_host``
    gives every rank an ``NCCL_HOSTID`` of its own (and NCCL sockets on the
    loopback interface unless ``NCCL_SOCKET_IFNAME`` says otherwise): NCCL
    refuses two ranks on one GPU because its duplicate check compares host
    hashes, so ranks that share a GPU run as hosts of their own, over NCCL's
    network transport. With ``raise_errors``
    a failed rank raises :class:`RankError` carrying every failed rank's
    traceback, or the exit code of a rank that died without reporting;
    without it, such a rank comes back as ``("died", exitcode)``. A rank still running after ``timeout`` seconds
    always raises (every rank still alive is killed).

    ``context``: a multiprocessing start method's name, or a context. The
    default, a fork server that has imported the caller's script, torch and
    pipeline_ext, starts a rank in milliseconds where ``"spawn"`` re-imports
    all three in every rank (a script started with ``python -m`` is imported
    again in each rank, by name); either way a rank runs in a process that never
    ran the caller's code past its imports (no threads, no CUDA), and gets
    the caller's environment as it is now.
    ``init_method``: the ranks' rendezvous (default: TCP on a free port of
    127.0.0.1; the tests use a fresh ``file://`` path, no port to race for).
    """
    ctx = _context(context)
    results = ctx.Queue()
    if init_method is None:
        init_method = f"tcp://127.0.0.1:{free_port()}"
    env = None if ctx.get_start_method() in ("spawn", "fork") else dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(fn, r, world, init_method, args, results, pg_timeout, threads, backend,
                                              own_nccl_host, env), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break  # a rank died without reporting (killed, segfault)
                continue
            out[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=5)
        killed = {r for r, p in enumerate(procs) if p.is_alive()}
        for r in killed:
            procs[r].kill()
            procs[r].join(timeout=5)
    hung, died = [], {}
    for r in sorted(set(range(world)) - set(out)):
        code = procs[r].exitcode
        if code is not None and r not in killed:  # died on its own (a SIGKILL too), not killed by us
            died[r] = code
        else:
            hung.append(r)
    failed: list[str] = []
    if raise_errors:
        failed = [f"--- rank {r}:\n{tb}" for r, (s, tb) in sorted(out.items()) if s == "error"]
        failed += [f"--- rank {r}: exited with code {code} without reporting (its stderr says why)"
                   for r, code in sorted(died.items())]
    else:
        out.update((r, ("died", code)) for r, code in died.items())
    if hung:
        raise RankError("\n".join([f"ranks {hung} did not report within {timeout:.0f} s (killed)"] + failed))
    if failed:
        raise RankError("\n".join(failed))
    return out
