"""The session's pool of rank processes (``mp_pool``) gives every test what fresh ranks gave it.

Each run must see the pytest process's environment as it is now, a process
group of its own, and process-wide state as a fresh process has it; a rank
that raises, dies or hangs fails the test naming it, and the next run gets
a working pool. These run on the pool on purpose (not ``isolated``).
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from mp_utils import rank_values, run_ranks


def _disturb(rank: int, world: int, marker: str) -> dict:
    """Reports what it found, then changes everything a worker must put back."""
    import torch.distributed as dist

    import pipeline_ext.comm.transport.setup as transport

    found = {
        "pid": os.getpid(),
        "marker": os.environ.get("POOL_TEST_MARKER"),
        "left_over": os.environ.get("POOL_TEST_LEFT_OVER"),
        "group": id(dist.group.WORLD),
        "world": dist.get_world_size(),
        "grad": torch.is_grad_enabled(),
        "dtype": str(torch.get_default_dtype()),
        "threads": torch.get_num_threads(),
        "sigusr1": signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL,
        "timer": signal.getitimer(signal.ITIMER_REAL)[0],
        "host_id": transport._host_id.__name__,
        "rng": torch.rand(1).item(),
    }
    os.environ["POOL_TEST_LEFT_OVER"] = marker
    torch.set_grad_enabled(False)
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(2)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    signal.setitimer(signal.ITIMER_REAL, 1000.0, 0)  # a test that forgot its timer
    transport._host_id = lambda: "elsewhere|boot|dev|ns"
    return found


@pytest.mark.timeout(120)
def test_each_run_sees_the_callers_environment_and_fresh_process_state(monkeypatch):
    monkeypatch.setenv("POOL_TEST_MARKER", "first")
    first = rank_values(_disturb, 2, "first", timeout=60)
    monkeypatch.setenv("POOL_TEST_MARKER", "second")
    second = rank_values(_disturb, 2, "second", timeout=60)
    for rank in (0, 1):
        a, b = first[rank], second[rank]
        assert (a["marker"], b["marker"]) == ("first", "second")
        assert b["left_over"] is None, b  # the worker put its own environment back
        assert b["grad"] and b["dtype"] == "torch.float32" and b["threads"] == 1 and b["sigusr1"], b
        assert b["timer"] == 0.0, b
        assert b["host_id"] == "_host_id", b  # a patched library function is the library's again
        assert a["rng"] == b["rng"]  # torch's RNG state as the process started, each run
        assert b["world"] == 2
    assert {v["pid"] for v in first.values()} == {v["pid"] for v in second.values()}  # the same processes


def _raise_on_one(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 says no")
    return rank


def _exit_on_one(rank: int, world: int) -> int:
    if rank == 1:
        os._exit(7)
    return rank


def _hang_on_one(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(600)
    return rank


def _pids(rank: int, world: int) -> int:
    return os.getpid()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fn, said", [
    (_raise_on_one, "rank 1 says no"),
    (_exit_on_one, "pool worker rank(s) [1] died (exit code(s) [7])"),
    (_hang_on_one, "ranks [1] did not report within 3 s"),
], ids=["raise", "exit", "hang"])
def test_a_rank_that_fails_is_named_and_the_next_run_gets_a_new_pool(fn, said):
    before = set(rank_values(_pids, 2, timeout=60).values())
    with pytest.raises(AssertionError) as info:
        run_ranks(fn, 2, timeout=60 if fn is not _hang_on_one else 3)
    assert said in str(info.value), str(info.value)
    after = set(rank_values(_pids, 2, timeout=60).values())
    assert not before & after  # none of the old workers is trusted again
    assert not [p for p in before if _alive(p)], before  # and none is left running


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (killed, not yet reaped by its parent) is gone too
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


class _Cycle:
    """A reference cycle whose end is recorded in a file (only the cyclic collector can free it)."""

    def __init__(self, path: str) -> None:
        self.me, self.path = self, path

    def __del__(self) -> None:
        with open(self.path, "w") as f:
            f.write("collected")


def _leave_a_cycle(rank: int, world: int, path: str) -> bool:
    _Cycle(f"{path}.{rank}")
    return True


def _was_collected(rank: int, world: int, path: str) -> bool:
    return os.path.exists(f"{path}.{rank}")


def test_a_tasks_cycles_are_collected_before_the_next_task(tmp_path):
    # what a task leaves in cycles (channels, shared memory) is freed when it ends, though a worker's collections
    # skip what existed before the task (gc.freeze, see mp_pool)
    path = str(tmp_path / "cycle")
    assert rank_values(_leave_a_cycle, 2, path) == {0: True, 1: True}
    assert rank_values(_was_collected, 2, path) == {0: True, 1: True}
