"""Shared fixtures."""
from __future__ import annotations

import signal
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch


def _feature_folders_on_path() -> None:
    """Every folder of tests on ``sys.path``, before anything is collected.

    Test files are modules named by their file's name alone (no
    ``__init__.py``): the rank pool's workers import a rank function by its
    module's name, and test files import helpers from each other across
    folders (``from test_distributed import SCHEDULES``). pytest puts a
    folder on the path only when it collects a file from it, so a file that
    imports one from a folder collected later would fail; hence all of them,
    here, and a name used twice is refused rather than shadowed.
    """
    here = Path(__file__).resolve().parent
    files = [f for f in here.rglob("*.py") if "__pycache__" not in f.parts]
    twice = [n for n, c in Counter(f.name for f in files).items() if c > 1 and n != "conftest.py"]
    if twice:
        raise RuntimeError(f"test modules are imported by file name; these names are used twice: {sorted(twice)}")
    for folder in sorted({f.parent for f in files} - {here}, reverse=True):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))


_feature_folders_on_path()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks ``long`` the variants ``tests/tiers.py`` moves out of the default run (its docstring says why).

    Runs before ``-m`` deselects, so ``-m long`` selects them and the default run leaves them out. When the
    whole suite is collected, an entry that names no test fails the collection: a renamed test must be moved
    again, not silently come back or drop out.
    """
    from tiers import LONG

    here = Path(__file__).resolve().parent
    seen = set()
    for item in items:
        rel = Path(str(item.path)).resolve().relative_to(here).as_posix() + "::" + item.name
        if rel in LONG:
            item.add_marker(pytest.mark.long)
            seen.add(rel)
    whole = [Path(a).resolve() for a in config.args] in ([here], [here.parent], [])
    missing = sorted(set(LONG) - seen)
    if whole and not config.option.keyword and missing:
        raise pytest.UsageError(f"tests/tiers.py names tests that do not exist: {missing}")

import mp_utils
from mp_pool import shutdown_pools
from mp_utils import TEST_DEVICE_ENV
from pipeline_ext.comm.transport import TRANSPORT_ENV
from models import shm_names


def pytest_configure(config: pytest.Config) -> None:
    """One intra-op thread in the pytest process, as every rank process has (``run_ranks`` passes threads=1).

    A single-process pipeline (``pe.Pipe``) runs each stage on a thread of its
    own; with torch's default of one intra-op thread per core, every stage
    thread's ops start an OpenMP team of their own on the same cores, and the
    teams spin against each other: test_single_process_200_steps_no_memory_growth
    took 0.40 s a step with 2 threads on the 2-core machine and 0.086 s with
    one. Nothing tested depends on the thread count.
    """
    torch.set_num_threads(1)


@pytest.fixture(params=["gloo", "shm"])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a multi-process test once per transport: the spawned ranks inherit ``$PIPELINE_EXT_TRANSPORT``.

    "shm" is forced (not "auto"), so a rank that cannot use shared memory fails
    the test instead of quietly running on Gloo.
    """
    monkeypatch.setenv(TRANSPORT_ENV, request.param)
    return request.param


#: a parameter that needs a GPU: marked ``cuda`` (tools/gpu_check.sh selects those), skipped without one
_ON_GPU = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(params=[
    pytest.param(("cpu", "gloo"), id="gloo"),
    pytest.param(("cpu", "shm"), id="shm"),
    pytest.param(("cuda", "process_group"), id="cuda-nccl", marks=_ON_GPU),
])
def rank_device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a multi-process test once per transport on CPU stages, and once with every stage on ``cuda:0``.

    The spawned ranks inherit both choices (``$PIPELINE_EXT_TRANSPORT``, and
    ``$PIPELINE_EXT_TEST_DEVICE`` that ``tests/models.py`` and ``mp_utils``
    read): on the GPU the default group is Gloo + NCCL and every rank is an
    NCCL host of its own (``comm.launch.spawn(own_nccl_host=True)``), so
    ranks sharing one GPU run the NCCL path. The reference model runs on the
    same device.
    """
    device, transport = request.param
    monkeypatch.setenv(TRANSPORT_ENV, transport)
    monkeypatch.setenv(TEST_DEVICE_ENV, device)
    return device


@pytest.fixture(params=[
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda-nccl", marks=_ON_GPU),
])
def stage_device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``rank_device`` for tests that run on one CPU transport (the default): CPU stages, then ``cuda:0`` over NCCL."""
    monkeypatch.setenv(TEST_DEVICE_ENV, request.param)
    if request.param == "cuda":
        monkeypatch.setenv(TRANSPORT_ENV, "process_group")
    return request.param


@pytest.fixture(autouse=True, scope="session")
def dev_shm_left_as_found():
    """The whole suite (crashes, kills and timeouts included) leaves nothing of ours in /dev/shm."""
    before = shm_names()
    yield
    left = shm_names() - before
    assert not left, f"the test session left {sorted(left)} in /dev/shm"


@pytest.fixture(autouse=True, scope="session")
def rank_pools(dev_shm_left_as_found):
    """The pools of rank processes (``mp_pool``) stop at the session's end, before /dev/shm is checked."""
    yield
    shutdown_pools()


@pytest.fixture(autouse=True)
def isolated_ranks(request: pytest.FixtureRequest):
    """A test marked ``isolated`` gets fresh rank processes from ``run_ranks``, not the session's pool."""
    mp_utils.isolated = request.node.get_closest_marker("isolated") is not None
    yield
    mp_utils.isolated = False


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
