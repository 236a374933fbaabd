"""examples/llama_pipeline.py runs (2 stages x 2 data-parallel replicas, tied embeddings, clipping, token mean).

Run as a user runs it (``python examples/llama_pipeline.py --spawn 4 --pp 2
--check`` in a subprocess, at tiny settings): it prints its layout, its
first step matches the unsplit Hugging Face model on the global batch
(``check: PASS``, exit status 0), training moves the loss down, and the
example's own transformers calls raise no deprecation warning. The layout
and the verdict are also checked without processes. ``transformers`` is
installed in CI (requirements-dev.txt); without it the tests are skipped,
never faked.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import llama_pipeline  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_llama_example_pp2_dp2_prints_layout_passes_check_and_trains():
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # -W reaches the spawned ranks too (multiprocessing passes the interpreter's warning options on)
    cmd = [sys.executable, "-W", "default::FutureWarning", str(ROOT / "examples" / "llama_pipeline.py"),
           "--spawn", "4", "--pp", "2", "--check", "--batch", "8", "--seq", "16", "--microbatches", "2", "--steps", "3"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=220)
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert out.count("layout: ") == 1 and ("layout: pp=2 x dp=2, schedule 1f1b, 1 stage per rank; "
                                           "rank 0: stage 0 (dp replica 0), rank 1: stage 1 (dp replica 0), "
                                           "rank 2: stage 0 (dp replica 1), rank 3: stage 1 (dp replica 1)\n") in out, out
    m = re.search(r"^check: PASS \(max grad rel err (\S+), norm rel err (\S+), loss rel err (\S+)\)$", out, re.M)
    assert m and out.count("check: ") == 1, out
    assert all(float(x) < 1e-5 for x in m.groups()), m.group(0)  # the tiny model is far inside the tolerance
    losses = [float(x) for x in re.findall(r"^step +\d+ +loss ([0-9.]+)", out, re.M)]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], out
    assert not [line for line in err.splitlines() if "FutureWarning" in line and "past_key_values" in line], err


def test_llama_example_layout_names_each_ranks_stages():
    assert llama_pipeline.describe_layout(2, 2, "zbv") == (
        "layout: pp=2 x dp=1, schedule zbv, 2 stages per rank; "
        "rank 0: stages 0, 3 (dp replica 0), rank 1: stages 1, 2 (dp replica 0)")
    with pytest.raises(ValueError, match="not a multiple"):
        llama_pipeline.describe_layout(3, 2, "1f1b")


def test_llama_example_check_verdict():
    ok = {0: {"grad_rel_err": 2e-7, "norm_err": 1e-7}, 1: {"grad_rel_err": 5e-7, "norm_err": 1e-7, "loss_err": 0.0}}
    assert llama_pipeline.check_verdict(ok) == (
        True, "check: PASS (max grad rel err 5.0e-07, norm rel err 1.0e-07, loss rel err 0.0e+00)")
    bad = {0: {"grad_rel_err": 0.14, "norm_err": math.nan}}  # a wrong gradient, a NaN norm, no last stage reported
    assert llama_pipeline.check_verdict(bad) == (
        False, "check: FAIL (max grad rel err 1.4e-01 > 1e-04, norm rel err nan > 1e-04, loss rel err missing)")
