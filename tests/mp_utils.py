"""Run a test function on N ranks (processes) over Gloo on 127.0.0.1, with a hard timeout.

A thin test-side face of ``pipeline_ext.dist.launch.spawn`` (which the demo and the
benchmarks use too): multi-process tests must never hang CI, so every rank has
a process-group timeout, the whole run has a wall-clock timeout after which
every rank still alive is killed, and a rank's exception fails the test with
its traceback.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

from pipeline_ext.dist.launch import RankError, free_port, spawn

__all__ = ["free_port", "run_ranks", "rank_values", "no_complaints", "TEST_DEVICE_ENV", "device_under_test"]

#: where the ranks of a test put their stages: set by the ``rank_device`` fixture (conftest.py), read by the
#: ranks (inherited environment) and by ``run_ranks`` (a GPU test's default group is Gloo + NCCL)
TEST_DEVICE_ENV = "PIPELINE_EXT_TEST_DEVICE"


def device_under_test() -> torch.device:
    """The device a multi-process test's stages, batches and reference model are on (CPU unless the fixture says)."""
    return torch.device(os.environ.get(TEST_DEVICE_ENV, "cpu"))


def run_ranks(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0, pg_timeout: float = 60.0, expect_errors: bool = False
) -> dict[int, tuple[str, Any]]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned processes; return ``{rank: (status, value)}``.

    Fails the test (AssertionError) if a rank raised (unless ``expect_errors``:
    then failed ranks come back as ``("error", traceback)`` and ranks that died
    without reporting as ``("died", exitcode)``) or a rank hung past ``timeout``.
    """
    gpu = device_under_test().type == "cuda"  # every rank on cuda:0, each its own NCCL host (see spawn)
    try:
        return spawn(fn, world, *args, timeout=timeout, pg_timeout=pg_timeout, threads=1, raise_errors=not expect_errors,
                     backend="cpu:gloo,cuda:nccl" if gpu else "gloo", own_nccl_host=gpu)
    except RankError as exc:
        raise AssertionError(str(exc)) from exc


def rank_values(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 60.0) -> dict[int, Any]:
    """``{rank: what fn returned there}``; any rank raising fails the test (see ``run_ranks``)."""
    return {r: v for r, (_, v) in run_ranks(fn, world, *args, timeout=timeout).items()}


def no_complaints(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 60.0) -> None:
    """Run ``fn`` (returning a list of complaints) on ``world`` ranks; every list must be empty."""
    said = rank_values(fn, world, *args, timeout=timeout)
    assert not [c for v in said.values() for c in v], said
