"""Shared fixtures."""
from __future__ import annotations

import os
import signal

import pytest

from pipeline_ext.dist.shm import TRANSPORT_ENV


@pytest.fixture(params=["gloo", "shm"])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a multi-process test once per transport: the spawned ranks inherit ``$PIPELINE_EXT_TRANSPORT``.

    "shm" is forced (not "auto"), so a rank that cannot use shared memory fails
    the test instead of quietly running on Gloo.
    """
    monkeypatch.setenv(TRANSPORT_ENV, request.param)
    return request.param


def _shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("pipeline_ext")} if os.path.isdir("/dev/shm") else set()


@pytest.fixture(autouse=True, scope="session")
def dev_shm_left_as_found():
    """The whole suite (crashes, kills and timeouts included) leaves nothing of ours in /dev/shm."""
    before = _shm_names()
    yield
    left = _shm_names() - before
    assert not left, f"the test session left {sorted(left)} in /dev/shm"


@pytest.fixture
def sigint_raises():
    """Ctrl-C (SIGINT, or ``_thread.interrupt_main``) raises KeyboardInterrupt during the test.

    A test must not depend on how it was started: a background job of a
    non-interactive script inherits SIGINT *ignored*, and ``interrupt_main``
    then does nothing.
    """
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)
