"""Pipe never hangs: a stalled stage, concurrent use from two threads, Ctrl-C then a stuck worker.

No timed assertions: a stall is an Event the test releases, and the checks are
on what was raised and what the pipe refuses while a worker is still stuck.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from torch import nn

import pipeline_ext as pe
from pipeline_ext.pipe import PipeBusyError
from models import ATOL, RTOL, unsplit



class Gate(nn.Module):
    """Blocks its first forward until ``release`` is set (a stalled stage), then passes through."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release, self.calls = threading.Event(), threading.Event(), 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            self.release.wait(120)
        return x


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def _check_grads(model, x, y):
    for a, b in zip([p.grad for p in model.parameters()], unsplit([_model()], x, y)[1]):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_stalled_stage_raises_within_the_timeout_and_the_pipe_recovers():
    model, gate = _model(), Gate()
    layers = list(model)
    pipe = pe.Pipe(nn.Sequential(layers[0], gate, *layers[1:]), balance=[1, 3], devices=["cpu", "cpu"], chunks=2,
                   schedule="1f1b", timeout=1.0)
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    try:
        with pytest.raises(pe.ChannelTimeout, match=r"timeout=1 s.*worker 1 in F of stage 1") as info:
            pipe.step(x, target=y, loss_fn=nn.functional.mse_loss)
        assert any("abandoned" in n for n in info.value.__notes__)
        with pytest.raises(PipeBusyError, match="cancelled call is still running"):  # the stuck worker still runs
            pipe(x)
    finally:
        gate.release.set()
    for t, _ in pipe._abandoned:
        t.join(60)
    pipe.zero_grad()
    pipe.step(x, target=y, loss_fn=nn.functional.mse_loss)  # it stopped at its next action: nothing was added
    _check_grads(model, x, y)


def test_same_pipe_from_two_threads_is_refused():
    model, gate = _model(), Gate()
    layers = list(model)
    pipe = pe.Pipe(nn.Sequential(layers[0], gate, *layers[1:]), balance=[1, 3], devices=["cpu", "cpu"], chunks=2)
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    errors: list[BaseException] = []

    def first():
        try:
            pipe.step(x, target=y, loss_fn=nn.functional.mse_loss)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=first)
    t.start()
    try:
        assert gate.entered.wait(60)
        with pytest.raises(PipeBusyError, match="already running a step"):
            pipe.step(x, target=y, loss_fn=nn.functional.mse_loss)
    finally:
        gate.release.set()
    t.join(60)
    assert not errors
    _check_grads(model, x, y)  # exactly one step's gradients


def test_ctrl_c_with_a_stuck_worker_does_not_hold_up_interpreter_exit():
    """Ctrl-C while a stage is stuck: the KeyboardInterrupt reaches the caller naming the stuck
    worker, and the process exits although that worker never returns (timeout=10: past what Ctrl-C takes to
    arrive, and a short grace period, 2 s, before the worker is abandoned)."""
    script = textwrap.dedent(
        """
        import _thread, signal, threading, torch
        from torch import nn
        import pipeline_ext as pe

        signal.signal(signal.SIGINT, signal.default_int_handler)  # ignored in a background job of a script

        class Stuck(nn.Module):
            def forward(self, x):
                _thread.interrupt_main()
                threading.Event().wait()  # never returns
                return x

        pipe = pe.Pipe(nn.Sequential(nn.Linear(4, 4), Stuck()), balance=[1, 1], devices=["cpu", "cpu"], timeout=10)
        try:
            pipe(torch.randn(2, 4))
        except KeyboardInterrupt as exc:
            print("NOTES", getattr(exc, "__notes__", None))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "abandoned" in out.stdout and "F of stage 1, microbatch 0" in out.stdout, out.stdout
