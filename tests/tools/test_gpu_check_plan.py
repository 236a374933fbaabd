"""tools/gpu_check.sh's plan, checked without a GPU (``GPU_CHECK_DRY=1``).

A GPU machine is lent for minutes, so the script must spend them in the
order that matters (what has never run elsewhere first) and never past its
budget: each step's timeout is what is left of ``--budget`` (less the
report's share) or its own cap, and a step with too little left is not
started. The dry run prints that plan on any machine and builds nothing.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from models import ROOT

ROOT = ROOT
ORDER = ["build", "versions", "nccl_probe", "pytest_multiprocess_cuda", "pytest_tp_cuda", "nccl_order",
         "steady_state_cuda", "pytest_cuda", "ipc_suites", "bench_pipeline_nccl", "bench_zb_cuda", "bench_transport_cuda",
         "sync_count_multiprocess", "sync_count", "bench_kernels", "bench_overlap",
         "sanitizer_memcheck", "sanitizer_racecheck", "pytest_all"]


def _plan(tmp_path: Path, *args: str) -> tuple[int, list[tuple[str, int]], str]:
    proc = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), *args, str(tmp_path / "report")],
                          cwd=ROOT, env=dict(os.environ, GPU_CHECK_DRY="1"), capture_output=True, text=True,
                          timeout=60)
    steps = []
    for line in proc.stdout.splitlines():
        m = re.match(r"^  (\w+): (?:(\d+)s: |not started)", line)
        if m:
            steps.append((m.group(1), int(m.group(2)) if m.group(2) else 0))
    return proc.returncode, steps, proc.stdout + proc.stderr


def test_a_budgeted_plan_runs_the_never_run_paths_first_and_fits_the_budget(tmp_path):
    rc, steps, out = _plan(tmp_path, "--budget", "480")
    assert rc == 0 and "dry run: nothing was built or run" in out, out
    assert [name for name, _ in steps] == ORDER, out
    started = [(name, t) for name, t in steps if t]
    assert [name for name, _ in started][:8] == ORDER[:8], out  # up to the single-process suite: see the 420 s plan
    assert all(0 < t <= 480 - 15 for _, t in started), out
    assert dict(steps)["pytest_multiprocess_cuda"] <= 480 * 2 // 5 and dict(steps)["ipc_suites"] <= 480 // 4, out
    assert dict(steps)["pytest_tp_cuda"] <= 480 // 5, out
    assert dict(steps)["pytest_all"] == 0, out  # nothing left for it in 8 minutes
    assert not (tmp_path / "report" / "report.md").exists()  # nothing ran, so nothing was reported
    assert not list((tmp_path / "report" / "logs").iterdir())


def test_seven_minutes_check_nccl_first_then_its_ordering_and_steady_steps_then_the_single_process_suite(tmp_path):
    """What a 7-minute lease checks, in this order: the multi-process pipelines over NCCL and DTensor stages on
    cuda (never passed on a GPU), the NCCL ordering model with its verdict against NCCL, the steady-state steps
    on cuda (no host synchronisation, the same messages every step), then the single-process CUDA suite."""
    rc, steps, out = _plan(tmp_path, "--budget", "420")
    assert rc == 0, out
    started = [name for name, t in steps if t]
    assert started == ["build", "versions", "nccl_probe", "pytest_multiprocess_cuda", "pytest_tp_cuda", "nccl_order",
                       "steady_state_cuda", "pytest_cuda"], out
    assert dict(steps)["pytest_cuda"] >= 30, out  # started, with what is left
    lines = {m.group(1): line for line in out.splitlines() if (m := re.match(r"^  (\w+): ", line))}
    assert "tests/schedules/test_nccl_order.py" in lines["nccl_order"], out
    assert "test_the_ordering_models_hang_case" in lines["nccl_order"], out
    assert "-m cuda -k steady_step" in lines["steady_state_cuda"] and "tests/runtime/test_steady_state.py" in lines[
        "steady_state_cuda"], out


def test_the_tests_the_script_names_exist():
    """A test the script names by node id (its GPU parameter) is collected here too (skipped without a GPU): a
    renamed one would fail the GPU step with "not found", on a lease."""
    script = (ROOT / "tools" / "gpu_check.sh").read_text()
    ids = sorted(set(re.findall(r'"(tests/[\w/]+\.py::[^"]+)"', script)))
    assert ids, "the script names no test by node id"
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_without_a_budget_every_step_gets_its_cap(tmp_path):
    rc, steps, out = _plan(tmp_path)
    assert rc == 0 and [name for name, _ in steps] == ORDER, out
    assert dict(steps)["build"] == 900 and dict(steps)["pytest_multiprocess_cuda"] == 900, out
    assert all(t > 0 for _, t in steps), out


def test_a_bad_argument_is_refused(tmp_path):
    rc, _, out = _plan(tmp_path, "--budgte", "480")
    assert rc == 2 and "usage: tools/gpu_check.sh [--budget SECONDS] REPORT_DIR" in out, out
