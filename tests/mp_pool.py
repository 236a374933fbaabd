"""Rank processes started once per test session, reused by every multi-process test (torch's ``MultiProcContinuousTest``).

Most of a multi-process test's wall time used to be start-up: every test
spawned fresh ranks (each re-importing torch and pipeline_ext, then
rendezvousing over TCP). Here a pool of ``world`` worker processes per world
size is started once (forkserver with torch and pipeline_ext preloaded, see
``mp_utils.fresh_context``) and runs every test's rank function in turn.

A test still gets what a fresh launch gave it:

* its own default process group: per task every worker calls
  ``init_process_group`` on a fresh ``file://`` rendezvous (no port to pick)
  and ``destroy_process_group`` after, so step numbers, transports and shared
  memory setups (kept per group object in the library) cannot leak between
  tests, and library code that uses WORLD sees a new group every test;
* the pytest process's environment as it is when the test runs (the fixtures
  set ``$PIPELINE_EXT_TRANSPORT`` etc. with monkeypatch after the pool
  started): it travels with the task, and the worker puts its own back after;
* process-wide state as a fresh process has it: intra-op threads, grad mode,
  default dtype, torch's RNG state, signal handlers, interval timers and the wakeup fd, the
  working directory, anomaly mode, deterministic algorithms, dynamo's caches,
  and the attributes of pipeline_ext's modules (and the test helpers'), which
  a rank function may patch (``transport._host_id`` to play another host).

Anything a test does that a worker cannot undo (kill, stop or exit a rank,
leave a rank in a collective) needs fresh processes: such tests are marked
``isolated`` (conftest.py) and ``run_ranks`` launches fresh ranks for them.
Should a pool task still go wrong, the pool is not trusted again: a worker
that dies fails the test with its rank and exit code named, a task past its
timeout fails the test naming the ranks that did not report, and a rank
that raised may have left its peers anywhere; in each case every worker of
that pool is killed and the next test gets a new pool.
"""
from __future__ import annotations

import faulthandler
import gc
import itertools
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable, Optional

__all__ = ["run_on_pool", "shutdown_pools"]

#: signals a test may install a handler for (SIGKILL and SIGSTOP cannot have one)
_SIGNALS = [s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)]


#: the packages whose module attributes a worker puts back after each task
_OURS = {"pipeline_ext", "models", "mp_utils"}
#: seconds after which a pool rank still in its task prints every thread's stack to stderr (unset: never)
STACKS_ENV = "PIPELINE_EXT_TEST_STACKS_AFTER"
_MISSING = object()


class _Fresh:
    """What a freshly started rank process looks like, taken before its first task and put back after each."""

    def __init__(self) -> None:
        import torch

        self.env = dict(os.environ)
        self.cwd = os.getcwd()
        self.handlers = {}
        for s in _SIGNALS:
            try:
                self.handlers[s] = signal.getsignal(s)
            except (OSError, ValueError):
                pass
        self.rng = torch.random.get_rng_state()
        self.dtype = torch.get_default_dtype()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.globals: dict[str, dict[str, Any]] = {}
        self._note_modules()

    def _note_modules(self) -> None:
        """The library's module attributes as imported (a rank function may patch one, e.g. ``transport._host_id``)."""
        for name, module in list(sys.modules.items()):
            if name.split(".")[0] in _OURS and name not in self.globals and module is not None:
                self.globals[name] = dict(vars(module))

    def restore(self) -> None:
        import torch

        os.environ.clear()
        os.environ.update(self.env)
        try:
            os.chdir(self.cwd)
        except OSError:
            pass
        signal.set_wakeup_fd(-1)
        for timer in (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF):  # before the handlers go back
            signal.setitimer(timer, 0, 0)
        for s, handler in self.handlers.items():
            if handler is not None and signal.getsignal(s) is not handler:
                try:
                    signal.signal(s, handler)
                except (OSError, ValueError):
                    pass
        torch.set_grad_enabled(True)
        torch.set_default_dtype(self.dtype)
        torch.use_deterministic_algorithms(self.deterministic)
        torch.autograd.set_detect_anomaly(False)
        torch.random.set_rng_state(self.rng)
        for name, saved in self.globals.items():
            module = sys.modules.get(name)
            if module is None:
                continue
            now = vars(module)
            for key, value in saved.items():
                if now.get(key, _MISSING) is not value:
                    setattr(module, key, value)
        self._note_modules()  # imported by this task: as they are now (a patch made in this very task stays)
        if "torch._dynamo" in sys.modules:  # compiled stages: recompilation limits and guards are per process
            torch._dynamo.reset()


def _worker(rank: int, world: int, conn: Any) -> None:
    """A pool rank: run tasks (``fn(rank, world, *args)`` in a process group of its own) until told to stop."""
    import torch
    import torch.distributed as dist

    from pipeline_ext.comm.launch import init_group

    fresh = _Fresh()
    # [Note: a pool worker's collections skip what it had before the task] gc.collect() after each task (below)
    # must free the task's cycles (channels, shared memory) before the task's groups go, but a full collection
    # over everything torch and the preloaded modules allocated takes about 0.3 s per rank, on every task. What
    # exists between tasks is frozen (gc.freeze: never collected, never traversed), so a collection only walks
    # what the task made.
    gc.freeze()
    while True:
        try:
            task = conn.recv()
        except EOFError:  # the pytest process went away
            return
        if task is None:
            return
        fn, args, env, init_method, pg_timeout, threads, backend = task
        os.environ.clear()
        os.environ.update(env)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if threads is not None:
            torch.set_num_threads(threads)
        stacks_after = float(os.environ.get(STACKS_ENV, "0"))
        if stacks_after > 0:  # a hang's whereabouts: every thread's Python stack on stderr once, if still running
            faulthandler.dump_traceback_later(stacks_after)
        try:
            init_group(backend, init_method, rank, world, pg_timeout)  # returns on no rank before every rank's
            reply = ("ok", fn(rank, world, *args))
        except BaseException:  # noqa: BLE001 - everything goes back to the parent
            reply = ("error", traceback.format_exc())
        faulthandler.cancel_dump_traceback_later()
        try:  # before the group goes: its end may wait for a peer that failed (and the pool is replaced then)
            conn.send(reply)
        except Exception:  # noqa: BLE001 - a value that does not pickle
            conn.send(("error", f"rank {rank} returned a value that cannot be sent back:\n{traceback.format_exc()}"))
        reply = None
        gc.collect()  # the task's objects (channels, shared memory, cycles) go before its groups do
        if dist.is_initialized():
            try:
                dist.destroy_process_group()  # every group of the task, WORLD included
            except Exception:  # noqa: BLE001
                pass
        fresh.restore()
        from mp_utils import forget_dtensor_caches

        forget_dtensor_caches()  # the next task's meshes equal this one's by value: see its docstring
        gc.freeze()  # see [Note: a pool worker's collections skip what it had before the task]


class _Pool:
    """``world`` worker processes and the pipes to them."""

    def __init__(self, world: int) -> None:
        from mp_utils import fresh_context

        ctx = fresh_context()
        self.world = world
        self.dir = tempfile.mkdtemp(prefix="pipeline_ext-pool-")
        self.conns, self.procs = [], []
        for r in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, world, child), daemon=True, name=f"pool{world}-rank{r}")
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, kill: bool) -> None:
        if not kill:
            for c in self.conns:
                try:
                    c.send(None)
                except OSError:
                    pass
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for c in self.conns:
            c.close()
        shutil.rmtree(self.dir, ignore_errors=True)


_pools: dict[int, _Pool] = {}
_lock = threading.Lock()
_tasks = itertools.count()


class PoolError(RuntimeError):
    """A pool task failed: a rank raised, died or hung (the message says which and where)."""


def _test_name() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]


def run_on_pool(fn: Callable[..., Any], world: int, *args: Any, timeout: float, pg_timeout: float,
                threads: Optional[int] = 1, backend: str = "gloo",
                own_nccl_host: bool = False) -> dict[int, tuple[str, Any]]:
    """Run ``fn(rank, world, *args)`` on the session's ``world``-rank pool; ``{rank: ("ok", value)}``.

    Raises :class:`PoolError` if a rank raised (every failed rank's traceback),
    died (its exit code; the pool is replaced) or did not report within
    ``timeout`` (the pool's workers are killed and replaced).
    """
    with _lock:
        pool = _pools.get(world)
        if pool is None or not pool.alive():
            if pool is not None:
                pool.close(kill=True)
            pool = _pools[world] = _Pool(world)
        trusted = False
        try:
            out, died, hung = _run_task(pool, fn, args, timeout, pg_timeout, threads, backend, own_nccl_host)
            trusted = not (died or hung or any(s == "error" for s, _ in out.values()))
        finally:  # also when interrupted (pytest-timeout, Ctrl-C) with the task in flight
            if not trusted:  # the workers' state is unknown now: the next test gets a new pool
                _pools.pop(world, None)
                pool.close(kill=True)
    if died:
        raise PoolError(f"{_test_name()}: pool worker rank(s) {sorted(died)} died (exit code(s) "
                        f"{[died[r] for r in sorted(died)]}) while running {fn.__qualname__}; the pool is "
                        "replaced (a test that kills or exits a rank must be marked isolated)")
    if hung:
        raise PoolError(f"ranks {hung} did not report within {timeout:.0f} s (killed; the pool is replaced)")
    errors = {r: v for r, (s, v) in out.items() if s == "error"}
    if errors:
        raise PoolError("\n".join(f"--- rank {r}:\n{tb}" for r, tb in sorted(errors.items())))
    return out


def _run_task(pool: _Pool, fn: Callable[..., Any], args: tuple, timeout: float, pg_timeout: float,
              threads: Optional[int], backend: str, own_nccl_host: bool):
    """Send one task to every worker of ``pool``; (results by rank, {rank: exit code} of the dead, ranks hung)."""
    task = next(_tasks)
    init_method = f"file://{pool.dir}/rendezvous-{task}"
    env = dict(os.environ)
    for r, conn in enumerate(pool.conns):
        rank_env = env
        if own_nccl_host:  # every rank its own NCCL host (see comm.launch.spawn), per task
            rank_env = dict(env, NCCL_HOSTID=f"pipeline_ext-pool-{os.getpid()}-{task}-rank-{r}")
            rank_env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        conn.send((fn, args, rank_env, init_method, pg_timeout, threads, backend))
    out: dict[int, tuple[str, Any]] = {}
    died: dict[int, Optional[int]] = {}
    waiting = {conn: r for r, conn in enumerate(pool.conns)}
    sentinels = {p.sentinel: r for r, p in enumerate(pool.procs)}
    deadline = time.monotonic() + timeout
    while waiting and not died and time.monotonic() < deadline:
        for ready in wait(list(waiting) + list(sentinels), timeout=max(0.0, deadline - time.monotonic())):
            if ready in waiting:
                r = waiting.pop(ready)
                try:
                    out[r] = ready.recv()
                except (EOFError, OSError):  # died before reporting
                    pool.procs[r].join(timeout=5)
                    died[r] = pool.procs[r].exitcode
            elif ready in sentinels:
                r = sentinels.pop(ready)
                conn = pool.conns[r]
                if conn in waiting and conn.poll():  # reported, then ended
                    del waiting[conn]
                    out[r] = conn.recv()
                elif r not in out and r not in died:
                    pool.procs[r].join(timeout=1)
                    died[r] = pool.procs[r].exitcode
    try:
        os.unlink(init_method[len("file://"):])
    except OSError:
        pass
    return out, died, sorted(waiting.values()) if not died else []


def shutdown_pools() -> None:
    """Stop every pool's workers (session end): they leave the loop, and with it their process."""
    with _lock:
        for world in list(_pools):
            _pools.pop(world).close(kill=False)
