"""Ctrl-C reaches a rank that waits for a peer, on every transport and in every wait.

A rank blocked in C++ (a shared-memory futex, a Gloo receive, the step record)
used to sit out its whole ``timeout`` before Python saw the KeyboardInterrupt.
Each rank here sets up its own SIGINT handler (a test never relies on how it
was started: a background job of a script inherits SIGINT ignored), and
interrupts itself 0.5 s into a wait whose timeout is 60 s, while its peer
holds back what it would send (or its call of step()) until the interrupted
rank has caught its KeyboardInterrupt, 20 s at most. The wait must end for the
signal, before the peer moved: the peer marks a file when it moves, and the
interrupted rank checks that the file is not there yet (an ordering, not a
clock: a wait that ended only when the peer's message came would see the
mark). The peer then fails within its own (short: 2 s; nothing else waits on
it) timeout, naming the interrupted rank.
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


PEER_HOLD = 20.0  # the most the peer holds back: past the interrupt at 0.5 s on any machine


def _wake(marker: str) -> None:
    """Hold back until the interrupted rank caught its KeyboardInterrupt (or ``PEER_HOLD``), then mark the move."""
    deadline = time.monotonic() + PEER_HOLD
    while not os.path.exists(marker + ".interrupted") and time.monotonic() < deadline:
        time.sleep(0.02)
    with open(marker, "w"):
        pass


class _Slow(nn.Module):
    """Holds back its first forward (``_wake``), then marks that it moves: its peer waits for the activation meanwhile."""

    def __init__(self, inner: nn.Module, marker: str) -> None:
        super().__init__()
        self.inner, self.marker = inner, marker

    def forward(self, x):
        if not os.path.exists(self.marker):
            _wake(self.marker)
        return self.inner(x)


def _interrupted_wait(rank: int, world: int, where: str, marker: str) -> str:
    import pipeline_ext as pe

    signal.signal(signal.SIGINT, signal.default_int_handler)
    modules = build("mlp", world)
    module = _Slow(modules[0], marker) if (rank == 0 and where == "data") else modules[rank]
    # rank 1 would wait 60 s; rank 0 gives up on rank 1 after 2 s
    stage = pe.PipelineStage(module, rank, world, "cpu")
    sched = pe.ScheduleGPipe(stage, 2, loss_fn=loss_fn, timeout=60.0 if rank == 1 else 2.0)
    x, y = make_batch("mlp", 4)
    if rank == 0 and where == "record":
        _wake(marker)  # rank 1 waits for this rank's step record meanwhile
    if rank == 1:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    try:
        sched.step(x) if rank == 0 else sched.step(target=y)
    except KeyboardInterrupt:
        moved = os.path.exists(marker)
        open(marker + ".interrupted", "w").close()
        return f"KeyboardInterrupt {'after' if moved else 'before'} the peer moved ({time.monotonic() - start:.2f} s)"
    except Exception as exc:  # noqa: BLE001 - the peer's error is what the test reads
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["data", "record"])
def test_ctrl_c_ends_a_wait_for_a_peer_and_the_peer_names_the_rank(transport, where, tmp_path):
    said = rank_values(_interrupted_wait, 2, where, str(tmp_path / "peer-moved"), timeout=50)
    assert said[1].startswith("KeyboardInterrupt before the peer moved"), said
    # the peer fails (timed out, or saw rank 1 exit or close its connection), naming rank 1
    assert said[0] != "no error" and "rank 1" in said[0], said
