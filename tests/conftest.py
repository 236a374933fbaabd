"""Shared fixtures."""
from __future__ import annotations

import pytest

from pipeline_ext.runtime.shm import TRANSPORT_ENV


@pytest.fixture(params=["gloo", "shm"])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a multi-process test once per transport: the spawned ranks inherit ``$PIPELINE_EXT_TRANSPORT``.

    "shm" is forced (not "auto"), so a rank that cannot use shared memory fails
    the test instead of quietly running on Gloo.
    """
    monkeypatch.setenv(TRANSPORT_ENV, request.param)
    return request.param
