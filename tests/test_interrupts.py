"""Ctrl-C reaches a rank that waits for a peer, on every transport and in every wait.

A rank blocked in C++ (a shared-memory futex, a Gloo receive, the step record)
used to sit out its whole ``timeout`` before Python saw the KeyboardInterrupt.
Each rank here sets up its own SIGINT handler (a test never relies on how it
was started: a background job of a script inherits SIGINT ignored), and
interrupts itself from a timer thread while it waits with a 60 s timeout; the
test's own bound (30 s) fails it if the wait sits the timeout out. The peer
then fails within its own (short) timeout, naming the interrupted rank.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from torch import nn

from models import build, loss_fn, make_batch
from mp_utils import rank_values


class _Slow(nn.Module):
    """Sleeps before its first forward: its peer waits for the activation meanwhile."""

    def __init__(self, inner: nn.Module, seconds: float) -> None:
        super().__init__()
        self.inner, self.seconds = inner, seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return self.inner(x)


def _interrupted_wait(rank: int, world: int, where: str) -> str:
    import pipeline_ext as pe

    signal.signal(signal.SIGINT, signal.default_int_handler)
    modules = build("mlp", world)
    module = _Slow(modules[0], 3.0) if (rank == 0 and where == "data") else modules[rank]
    # rank 1 would wait 60 s; rank 0 gives up on rank 1 after 8 s
    stage = pe.PipelineStage(module, rank, world, "cpu")
    sched = pe.ScheduleGPipe(stage, 2, loss_fn=loss_fn, timeout=60.0 if rank == 1 else 8.0)
    x, y = make_batch("mlp", 4)
    if rank == 0 and where == "record":
        time.sleep(3.0)  # rank 1 waits for this rank's step record meanwhile
    if rank == 1:
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    try:
        sched.step(x) if rank == 0 else sched.step(target=y)
    except KeyboardInterrupt:
        return f"KeyboardInterrupt after {time.monotonic() - start:.2f} s"
    except Exception as exc:  # noqa: BLE001 - the peer's error is what the test reads
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.slow
@pytest.mark.timeout(30)
@pytest.mark.parametrize("where", ["data", "record"])
def test_ctrl_c_ends_a_wait_for_a_peer_and_the_peer_names_the_rank(transport, where):
    said = rank_values(_interrupted_wait, 2, where, timeout=25)
    assert said[1].startswith("KeyboardInterrupt"), said
    # the peer fails (timed out, or saw rank 1 exit or close its connection), naming rank 1
    assert said[0] != "no error" and "rank 1" in said[0], said
