"""Run a test function on N ranks (processes) over Gloo on 127.0.0.1, with a hard timeout.

Multi-process tests must never hang CI, so every rank has a process-group
timeout, the whole run has a wall-clock timeout after which every rank still
alive is killed, and a rank's exception fails the test with its traceback.

Where the ranks come from (start-up used to be most of the suite's time):

* by default, the session's pool of ``world`` rank processes (``mp_pool``),
  started once; each test gets a process group of its own there;
* for a test marked ``isolated`` (it kills, stops or exits a rank, or expects
  ranks to fail), or any ``expect_errors`` run, or with
  ``PIPELINE_EXT_TEST_POOL=0`` in the environment: fresh processes from
  ``pipeline_ext.comm.launch.spawn`` (what the demo and the benchmarks use),
  forked from a fork server that has torch and pipeline_ext imported
  already, meeting on a fresh ``file://`` rendezvous (no port to race for).
"""
from __future__ import annotations

import itertools
import multiprocessing
import os
import shutil
import tempfile
from typing import Any, Callable

import torch

from pipeline_ext.comm.launch import RankError, free_port, spawn

__all__ = ["free_port", "run_ranks", "rank_values", "no_complaints", "TEST_DEVICE_ENV", "device_under_test",
           "fresh_context", "POOL_ENV", "forget_dtensor_caches"]

#: ``PIPELINE_EXT_TEST_POOL=0``: every run_ranks on fresh processes (as before the pool; to tell a pool problem apart)
POOL_ENV = "PIPELINE_EXT_TEST_POOL"

#: set by conftest.py per test: the running test is marked ``isolated`` (its ranks must be fresh processes)
isolated = False

#: what the fork server imports once, so that a fresh rank does not: torch (and its distributed package),
#: the library and the test helpers the rank functions use
_PRELOAD = ["torch", "torch.distributed", "pipeline_ext", "pipeline_ext.comm.transport.channels", "pytest", "mp_utils", "models"]

_ctx = None
_rendezvous_dir = None
_runs = itertools.count()

#: where the ranks of a test put their stages: set by the ``rank_device`` fixture (conftest.py), read by the
#: ranks (inherited environment) and by ``run_ranks`` (a GPU test's default group is Gloo + NCCL)
TEST_DEVICE_ENV = "PIPELINE_EXT_TEST_DEVICE"


def forget_dtensor_caches() -> None:
    """Forget what torch's DTensor machinery cached about meshes (a pool worker runs many tests).

    Each test makes its process group and meshes anew, and a new mesh equals an
    old one by value (same ranks, same dim names), so a cache keyed by a mesh
    (sharding propagation in Python and in the C++ fast path, the redistribute planner kept by a weak reference
    whose referent the planner itself keeps alive, transform infos, topology
    infos) hands back the old mesh with its destroyed groups: "Could not
    resolve the process group registered under the name 3" in a later test.
    """
    import sys as _sys

    overlap = _sys.modules.get("pipeline_ext.runtime.overlap")
    if overlap is not None:  # DTensor's C++ cache is per thread: the pooled pair threads go with theirs
        overlap.release_pair_threads()
    tensor_mod = _sys.modules.get("torch.distributed.tensor")
    if tensor_mod is None:  # DTensor never used in this process: nothing cached
        return
    getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", lambda: None)()  # the C++ fast path's own cache
    prop = tensor_mod.DTensor._op_dispatcher.sharding_propagator
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        getattr(getattr(prop, name, None), "cache_clear", lambda: None)()
    redistribute = _sys.modules.get("torch.distributed.tensor._redistribute")
    if redistribute is not None:
        getattr(redistribute, "clear_redistribute_planner_cache", lambda: None)()
        getattr(getattr(redistribute, "_gen_transform_infos", None), "cache_clear", lambda: None)()
    collective = _sys.modules.get("torch.distributed.tensor._collective_utils")
    topo = getattr(collective, "MeshTopoInfo", None)
    getattr(getattr(topo, "build_from_mesh", None), "cache_clear", lambda: None)()


def device_under_test() -> torch.device:
    """The device a multi-process test's stages, batches and reference model are on (CPU unless the fixture says)."""
    return torch.device(os.environ.get(TEST_DEVICE_ENV, "cpu"))


def fresh_context() -> multiprocessing.context.BaseContext:
    """The ``forkserver`` context every test rank process comes from, torch and pipeline_ext preloaded.

    Forking the server costs milliseconds where a spawned child re-imports torch
    (seconds). The server is a process of its own started from the pytest
    process's modules list (no CUDA initialised there: it only imports), so
    a child is never a fork of a process with CUDA or threads running. A
    child has the server's environment: ``spawn`` and the pool send the
    caller's along.
    """
    global _ctx
    if _ctx is None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _ctx = ctx
    return _ctx


def _fresh_rendezvous() -> str:
    """A ``file://`` rendezvous nobody else uses (a new path per run, in a directory removed at exit)."""
    global _rendezvous_dir
    if _rendezvous_dir is None:
        import atexit

        _rendezvous_dir = tempfile.mkdtemp(prefix="pipeline_ext-rendezvous-")
        atexit.register(shutil.rmtree, _rendezvous_dir, True)
    return f"file://{_rendezvous_dir}/run-{os.getpid()}-{next(_runs)}"


def _on_pool(expect_errors: bool) -> bool:
    return not (isolated or expect_errors or os.environ.get(POOL_ENV, "1") == "0")


def run_ranks(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0, pg_timeout: float = 60.0, expect_errors: bool = False
) -> dict[int, tuple[str, Any]]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned processes; return ``{rank: (status, value)}``.

    Fails the test (AssertionError) if a rank raised (unless ``expect_errors``:
    then failed ranks come back as ``("error", traceback)`` and ranks that died
    without reporting as ``("died", exitcode)``) or a rank hung past ``timeout``.
    The ranks are the session pool's unless the test needs fresh ones (see the module's docstring).
    """
    from mp_pool import PoolError, run_on_pool

    gpu = device_under_test().type == "cuda"  # every rank on cuda:0, each its own NCCL host (see spawn)
    backend = "cpu:gloo,cuda:nccl" if gpu else "gloo"
    try:
        if _on_pool(expect_errors):
            return run_on_pool(fn, world, *args, timeout=timeout, pg_timeout=pg_timeout, threads=1, backend=backend,
                               own_nccl_host=gpu)
        return spawn(fn, world, *args, timeout=timeout, pg_timeout=pg_timeout, threads=1, raise_errors=not expect_errors,
                     backend=backend, own_nccl_host=gpu, context=fresh_context(), init_method=_fresh_rendezvous())
    except (RankError, PoolError) as exc:
        raise AssertionError(str(exc)) from exc


def rank_values(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 60.0) -> dict[int, Any]:
    """``{rank: what fn returned there}``; any rank raising fails the test (see ``run_ranks``)."""
    return {r: v for r, (_, v) in run_ranks(fn, world, *args, timeout=timeout).items()}


def no_complaints(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 60.0) -> None:
    """Run ``fn`` (returning a list of complaints) on ``world`` ranks; every list must be empty."""
    said = rank_values(fn, world, *args, timeout=timeout)
    assert not [c for v in said.values() for c in v], said
