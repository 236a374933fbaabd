"""``comm.launch.spawn`` as a script uses it: ranks forked from a server that ran the script once.

A rank must not run the caller's script again (multiprocessing's own
``"__main__"`` preload does nothing before Python 3.13.8, so a script that
imports ``transformers`` cost every rank seconds): the script's top level runs
in the caller and once in the fork server, for any number of ranks and
calls, and the ranks still see the script's functions and globals. A script
whose top level raises in the server still runs (each rank runs it itself).
A rank that dies without reporting is named with its exit code, not taken
for a hang.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline_ext.comm.launch import RankError, spawn
from models import ROOT

ROOT = ROOT

SCRIPT = textwrap.dedent("""
    import os, sys
    from pathlib import Path

    LOG = Path(os.environ["LAUNCH_TEST_LOG"])
    if os.environ.get("LAUNCH_TEST_FAIL_ONCE") and __name__ == "__mp_main__" and not LOG.with_suffix(".failed").exists():
        LOG.with_suffix(".failed").touch()
        raise RuntimeError("the script's top level raised once")
    with LOG.open("a") as f:
        print(f"{__name__} {os.getpid()}", file=f)
    GREETING = "from the script's globals"

    def work(rank, world, scale):
        return (rank * scale, GREETING, sys.modules["__main__"].__file__)

    if __name__ == "__main__":
        from pipeline_ext.comm.launch import spawn
        for _ in range(2):
            out = spawn(work, 3, 10, timeout=120)
            assert {r: v[0] for r, (s, v) in out.items()} == {0: 0, 1: 10, 2: 20}, out
            assert all(v[1] == GREETING and v[2] == __file__ for _, v in out.values()), out
        print("ok")
""")


def _run_script(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    script, log = tmp_path / "user_script.py", tmp_path / "runs.log"
    script.write_text(SCRIPT)
    environ = {**os.environ, "LAUNCH_TEST_LOG": str(log), **env,
               "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(script)], env=environ, capture_output=True, text=True, timeout=180)
    return proc, log.read_text().split() if log.exists() else []


@pytest.mark.timeout(200)
def test_ranks_do_not_run_the_callers_script_again(tmp_path):
    proc, runs = _run_script(tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr
    # the caller, then the fork server: never the six ranks of the two calls
    assert runs[0::2] == ["__main__", "__mp_main__"], runs


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_script_that_raises_in_the_fork_server_still_runs_in_each_rank(tmp_path):
    proc, runs = _run_script(tmp_path, LAUNCH_TEST_FAIL_ONCE="1")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr
    assert runs[0::2] == ["__main__"] + ["__mp_main__"] * 6, runs  # the server kept nothing: each rank ran it


def _die(rank: int, world: int) -> None:
    import torch.distributed as dist

    dist.barrier()  # both ranks through the group's connection set-up: rank 0's own start-up never sees the exit
    if rank == 1:
        os._exit(7)


@pytest.mark.timeout(120)
def test_a_rank_that_dies_without_reporting_is_named_with_its_exit_code():
    with pytest.raises(RankError, match=r"rank 1: exited with code 7 without reporting") as exc:
        spawn(_die, 2, timeout=60, pg_timeout=20)
    assert "did not report within" not in str(exc.value)
    out = spawn(_die, 2, timeout=60, pg_timeout=20, raise_errors=False)
    assert out == {0: ("ok", None), 1: ("died", 7)}
