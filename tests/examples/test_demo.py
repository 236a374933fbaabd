"""The main-job demo runs end to end: workers start, the loss falls, the report and PNG appear.

Run as a user runs it (``python -m pipeline_ext.demo`` in a subprocess, with a
timeout), at tiny settings so it takes seconds. No timing is asserted.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from models import ROOT

ROOT = ROOT


def _run_demo(tmp_path: Path, *extra: str) -> tuple[str, Path]:
    png = tmp_path / "timeline.png"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "pipeline_ext.demo", "--steps", "8", "--batch", "16", "--layers", "2",
           "--trace-steps", "3", "--png", str(png), "--timeout", "100", *extra]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, png


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_demo_trains_and_reports(tmp_path):
    out, png = _run_demo(tmp_path, "--microbatches", "2")
    losses = [float(v) for v in re.findall(r"step +\d+/8 +loss ([0-9.]+)", out)]
    assert len(losses) == 8, out
    assert losses[-1] < losses[0] - 0.1, losses
    assert re.search(r"throughput: [0-9]+ tokens/s", out), out
    m = re.search(r"bubble: measured ([0-9.]+) vs simulated ([0-9.]+)", out)
    assert m and 0.0 <= float(m.group(1)) < 1.0 and 0.0 <= float(m.group(2)) < 1.0, out
    assert png.exists() and png.stat().st_size > 1000


def test_demo_rejects_an_impossible_schedule(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "pipeline_ext.demo", "--schedule", "interleaved_1f1b",
                           "--layers", "2"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "fewer than the 4 model stages" in proc.stderr
