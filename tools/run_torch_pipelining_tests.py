"""Runs PyTorch's own pipelining tests against torch and against pipeline_ext, on CPU with Gloo.

Why: pipeline_ext promises that a torch.distributed.pipelining user changes one
import. torch's test suite (``test/distributed/pipelining`` of a PyTorch source
checkout) is the spec of that promise; this tool measures how much of it holds.

    python tools/run_torch_pipelining_tests.py --torch-src ~/src/pytorch
    tools/run_torch_pipelining_tests.sh --torch-src ~/src/pytorch --files test_stage.py -k manual

``--torch-src`` is a PyTorch checkout, or any directory holding
``test/distributed/pipelining`` (or the test files themselves). Use a checkout
of the installed torch's release: newer tests call newer APIs.

What it does, mechanically (the checkout is never modified; nothing is kept
unless ``--keep``):

1. Copies the test files, ``model_registry.py``, ``schedule_registry.py`` and
   ``artifacts/`` to a temporary directory, twice.
2. Ports both copies to CPU + Gloo (``port_cpu_gloo``): the decorators that
   skip a test for want of accelerators (``requires_accelerator_dist_backend``,
   ``requires_nccl``, ``skip_if_lt_x_gpu``, ``skip_but_pass_in_sandcastle_if(not
   TEST_MULTIGPU / TEST_MULTIACCELERATOR)``) are removed; every other skip of
   torch's stays. A world size taken from the accelerator count becomes
   ``--world-size`` (CPU has one "device"), and ``device_id=`` is dropped from
   ``init_process_group`` (Gloo on CPU refuses it). Recent test files already
   pick "cpu" and "gloo" themselves when no accelerator is present.
3. In the second copy only, swaps the imports (``swap_imports``): every name
   imported from ``torch.distributed.pipelining`` or one of its submodules
   comes from its twin, ``pipeline_ext.pipelining`` or the same submodule of it
   (``from pipeline_ext.pipelining.schedules import NAME``), when pipeline_ext
   provides that name. A name it does not provide (or refuses, saying why:
   ``NotProvidedError``) stays torch's, and is listed: the test then mixes
   torch's object with ours, which is what a user who changed the import would
   get as an ImportError.
4. Runs pytest on both copies, each test under a watchdog (``--timeout``
   seconds without progress kills the run; the test counts as a timeout and
   the remaining tests continue in a fresh process). A failing test also ends
   its process: torch's ``MultiProcContinuousTest`` keeps its rank processes
   across tests and skips the rest of a class after one failure.
5. Prints, per file, how many tests pass on torch and on pipeline_ext, and
   each test that passes on torch but not on pipeline_ext with a one-line
   reason. ``--json PATH`` writes every result.

On a 2-core machine the four files take 8 to 10 minutes per variant. torch's
results depend on torch only: ``--json base.json`` once, then ``--baseline
base.json`` runs pipeline_ext alone. ``-k`` and ``--files`` filter.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

DEFAULT_FILES = ("test_schedule_multiproc.py", "test_stage.py", "test_schedule.py", "test_microbatch.py")
SUPPORT_FILES = ("model_registry.py", "schedule_registry.py")
TORCH_PKG = "torch.distributed.pipelining"

# Decorators that only say "this needs accelerators"; on CPU with Gloo the test can run.
_ACCELERATOR_ONLY_DECORATORS = {"requires_accelerator_dist_backend", "requires_nccl", "skip_if_lt_x_gpu"}
_ACCELERATOR_FLAGS = ("TEST_MULTIGPU", "TEST_MULTIACCELERATOR", "TEST_CUDA")


# ----------------------------------------------------------------------------- source rewriting (pure)

def _decorator_name(node: ast.expr) -> str:
    target = node.func if isinstance(node, ast.Call) else node
    if isinstance(target, ast.Attribute):
        return target.attr
    return target.id if isinstance(target, ast.Name) else ""


def _is_accelerator_only(node: ast.expr) -> bool:
    name = _decorator_name(node)
    if name in _ACCELERATOR_ONLY_DECORATORS:
        return True
    if name == "skip_but_pass_in_sandcastle_if" and isinstance(node, ast.Call) and node.args:
        condition = ast.unparse(node.args[0])
        return any(flag in condition for flag in _ACCELERATOR_FLAGS)
    return False


def _apply_line_edits(source: str, edits: list[tuple[int, int, list[str]]]) -> str:
    """Replaces 1-based inclusive line ranges, bottom-up so earlier numbers stay valid."""
    lines = source.splitlines(keepends=True)
    for first, last, new in sorted(edits, key=lambda e: e[0], reverse=True):
        lines[first - 1:last] = [line + "\n" for line in new]
    return "".join(lines)


def port_cpu_gloo(source: str, world_size: int = 2) -> str:
    """torch's test source, made to run on CPU with Gloo; torch's other skip conditions kept."""
    edits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for dec in node.decorator_list:
                if _is_accelerator_only(dec):
                    edits.append((dec.lineno, dec.end_lineno or dec.lineno, []))
    out = _apply_line_edits(source, edits)
    # The world size of a class that counts accelerators: CPU reports one device.
    out = re.sub(r"torch\.get_device_module\(device_type\)\.device_count\(\)", str(world_size), out)
    # Gloo on CPU refuses init_process_group(device_id=...).
    out = re.sub(r"(?m)^[ \t]*device_id=self\.device,[ \t]*\n", "", out)
    # Older test files hard-code NCCL and CUDA devices.
    out = re.sub(r'return "nccl"', 'return "gloo"', out)
    out = re.sub(r'torch\.device\(f"cuda:\{dev_id\}"\)', 'torch.device("cpu")', out)
    return out


def pipeline_ext_module(torch_module: str) -> str:
    """The twin of a torch pipelining module: ``torch.distributed.pipelining[.x]`` -> ``pipeline_ext.pipelining[.x]``."""
    return "pipeline_ext.pipelining" + torch_module[len(TORCH_PKG):]


def imported_pipelining_names(source: str) -> set[tuple[str, str]]:
    """(torch module, name) of every ``from torch.distributed.pipelining[...] import name``."""
    return {(node.module, alias.name) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
            and (node.module == TORCH_PKG or node.module.startswith(TORCH_PKG + "."))
            for alias in node.names}


def swap_imports(source: str, provided: set[tuple[str, str]]) -> tuple[str, list[str]]:
    """Imports of torch's pipelining names go to pipeline_ext where ``provided`` has (module, name).

    Returns the new source and the names left to torch (``module.name``).
    """
    edits, kept = [], []
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                and (node.module == TORCH_PKG or node.module.startswith(TORCH_PKG + "."))):
            continue
        ours = [a for a in node.names if (node.module, a.name) in provided]
        theirs = [a for a in node.names if (node.module, a.name) not in provided]
        if not ours:
            kept += [f"{node.module}.{a.name}" for a in theirs]
            continue
        indent = lines[node.lineno - 1][: node.col_offset]
        names = lambda aliases: ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in aliases)  # noqa: E731
        new = [f"{indent}from {pipeline_ext_module(node.module)} import {names(ours)}"]
        if theirs:
            new.append(f"{indent}from {node.module} import {names(theirs)}")
            kept += [f"{node.module}.{a.name}" for a in theirs]
        edits.append((node.lineno, node.end_lineno or node.lineno, new))
    return _apply_line_edits(source, edits), sorted(set(kept))


_EXC_LINE = re.compile(r"^(?:E\s+)?([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Timeout)\b:?.*)$")


def one_line_reason(text: str, limit: int = 200) -> str:
    """The innermost exception line of a pytest failure report (worker tracebacks included)."""
    lines = [line.rstrip() for line in text.splitlines()]
    start = max((i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line), default=0)
    for line in lines[start:]:
        match = _EXC_LINE.match(line.strip())
        if match and "Exception in worker process" not in match.group(1):
            return match.group(1)[:limit]
    for line in lines:
        if line.startswith("E "):
            return line[1:].strip()[:limit]
    return (lines[-1].strip() if lines else "failed")[:limit]


# ----------------------------------------------------------------------------- preparing the copies

def find_test_dir(torch_src: Path) -> Path:
    for candidate in (torch_src / "test" / "distributed" / "pipelining", torch_src):
        if (candidate / "model_registry.py").is_file():
            return candidate
    raise SystemExit(f"--torch-src {torch_src}: no test/distributed/pipelining/model_registry.py there")


def probe_provided(candidates: Iterable[tuple[str, str]]) -> set[tuple[str, str]]:
    """Which (torch module, name) pipeline_ext provides, asked in a fresh interpreter."""
    code = ("import importlib, json, sys\n"
            "out = []\n"
            "for mod, name, target in json.load(sys.stdin):\n"
            "    try:\n"
            "        getattr(importlib.import_module(target), name); out.append([mod, name])\n"
            "    except Exception:\n"
            "        pass\n"
            "print(json.dumps(out))\n")
    payload = json.dumps([[m, n, pipeline_ext_module(m)] for m, n in sorted(candidates)])
    res = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, text=True, check=True)
    return {tuple(x) for x in json.loads(res.stdout.strip().splitlines()[-1])}


_EVENTS_PLUGIN = '''\
"""Written by tools/run_torch_pipelining_tests.py: one JSON line per test start and result."""
import json, os

import torch.testing._internal.common_distributed as _cd

_cd.MultiProcContinuousTest.world_size = int(os.environ.get("PORT_WORLD_SIZE", "2"))  # CPU has no device count
_EVENTS = os.environ.get("PORT_EVENTS")
_done = set()


def _write(record):
    if not _EVENTS:
        return
    with open(_EVENTS, "a") as f:
        f.write(json.dumps(record) + "\\n")


def pytest_runtest_logstart(nodeid, location):
    _write({"ev": "start", "id": nodeid})


def pytest_runtest_logreport(report):
    if report.nodeid in _done or (report.when != "call" and report.outcome == "passed"):
        return
    _done.add(report.nodeid)
    text = report.longreprtext if report.outcome != "passed" else ""
    _write({"ev": "result", "id": report.nodeid, "outcome": report.outcome, "text": text[-20000:]})
'''


def prepare(test_dir: Path, dest: Path, files: list[str], world_size: int,
            provided: Optional[set[tuple[str, str]]]) -> dict[str, list[str]]:
    """Copies and ports the tests into ``dest``; returns the names left to torch, per file."""
    dest.mkdir(parents=True)
    if (test_dir / "artifacts").is_dir():
        shutil.copytree(test_dir / "artifacts", dest / "artifacts")
    kept: dict[str, list[str]] = {}
    for name in list(SUPPORT_FILES) + files:
        source = port_cpu_gloo((test_dir / name).read_text(), world_size)
        if provided is not None:
            source, kept[name] = swap_imports(source, provided)
        (dest / name).write_text(source)
    (dest / "conftest.py").write_text(_EVENTS_PLUGIN)
    return kept


# ----------------------------------------------------------------------------- running

@dataclass
class Result:
    outcome: str  # passed / failed / skipped / timeout / error
    reason: str = ""


@dataclass
class FileRun:
    ids: list[str] = field(default_factory=list)
    results: dict[str, Result] = field(default_factory=dict)


def _pytest(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:logging", "-q",
           "--no-header", "-o", "addopts=", "--rootdir", str(cwd), *args]
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def collect(cwd: Path, name: str, keyword: Optional[str], env: dict[str, str]) -> tuple[list[str], str]:
    args = ["--collect-only", name] + (["-k", keyword] if keyword else [])
    proc = _pytest(args, cwd, env)
    out, _ = proc.communicate(timeout=600)
    ids = [line.strip() for line in out.splitlines() if line.startswith(name + "::")]
    return ids, ("" if ids or proc.returncode in (0, 5) else one_line_reason(out))


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_file(cwd: Path, ids: list[str], timeout: float, env: dict[str, str], log) -> dict[str, Result]:
    """Runs ``ids``; a failure or a stall ends the process and the rest goes on in a fresh one."""
    results: dict[str, Result] = {}
    queue = list(ids)
    while queue:
        events_path = cwd / f".events-{len(results)}.jsonl"
        events_path.unlink(missing_ok=True)
        # -x: after a failure pytest starts nothing more (a test run in its debris would be misjudged)
        proc = _pytest(["-x", *queue], cwd, {**env, "PORT_EVENTS": str(events_path)})
        seen, current, since = 0, None, time.monotonic()
        started = since
        stop_reason = None
        while True:
            time.sleep(0.5)
            events = _read_events(events_path)
            for ev in events[seen:]:
                since = time.monotonic()
                if ev["ev"] == "start":
                    current = ev["id"]
                    continue
                current = None
                text = ev["text"]
                if ev["outcome"] == "skipped" and "Previous test failed" in text:
                    continue  # torch's poison pill: run it again in the next process
                outcome = {"passed": "passed", "skipped": "skipped"}.get(ev["outcome"], "failed")
                results[ev["id"]] = Result(outcome, one_line_reason(text) if outcome != "passed" else "")
                log(f"    {outcome:8s} {time.monotonic() - started:5.0f}s {ev['id']}"
                    + (f"  ({results[ev['id']].reason})" if outcome == "failed" else ""))
                if outcome == "failed":
                    stop_reason = "failure"
            seen = len(events)
            if stop_reason or proc.poll() is not None:
                break
            if time.monotonic() - since > timeout:
                stop_reason = "timeout"
                break
        if proc.poll() is None:
            _kill(proc)
        out = proc.stdout.read() if proc.stdout else ""
        if stop_reason == "timeout" and current is not None:
            results[current] = Result("timeout", f"no progress for {timeout:.0f} s")
            log(f"    timeout  {current}")
        remaining = [t for t in queue if t not in results]
        if remaining and len(remaining) == len(queue):  # no progress at all: the process itself failed
            reason = one_line_reason(out) if stop_reason != "timeout" else f"no progress for {timeout:.0f} s"
            results[remaining[0]] = Result("error", reason)
            remaining = remaining[1:]
        queue = remaining
    return results


def load_baseline(path: Path, files: list[str]) -> dict[str, FileRun]:
    """torch's results from an earlier ``--json``: they depend on torch only, not on pipeline_ext."""
    saved = json.loads(path.read_text())["results"]["torch"]
    runs = {}
    for name in files:
        if name not in saved:
            raise SystemExit(f"--baseline {path}: no torch results for {name}")
        runs[name] = FileRun(ids=list(saved[name]),
                             results={i: Result(**r) for i, r in saved[name].items() if r is not None})
    return runs


# ----------------------------------------------------------------------------- report

def report(files: list[str], runs: dict[str, dict[str, FileRun]], kept: dict[str, list[str]]) -> str:
    out = []
    variants = list(runs)
    header = f"{'test file':34s} {'tests':>5s} " + " ".join(f"{v + ' passes':>20s}" for v in variants)
    out += [header, "-" * len(header)]
    for name in files:
        base = runs[variants[0]][name]
        cells = []
        for v in variants:
            run = runs[v][name]
            passed = sum(i in run.results and run.results[i].outcome == "passed" for i in base.ids)
            cells.append(f"{passed:>11d} of {len(base.ids):<5d}")
        out.append(f"{name:34s} {len(base.ids):5d} " + " ".join(f"{c:>20s}" for c in cells))
    if "torch" in runs and "pipeline_ext" in runs:
        out.append("\nPass on torch, fail on pipeline_ext:")
        for name in files:
            t, p = runs["torch"][name], runs["pipeline_ext"][name]
            for test_id in t.ids:
                tr, pr = t.results.get(test_id), p.results.get(test_id, Result("error", "not run"))
                if tr and tr.outcome == "passed" and pr.outcome != "passed":
                    out.append(f"  {test_id}: [{pr.outcome}] {pr.reason}")
    if kept:
        out.append("\nNames pipeline_ext does not provide (left to torch in the pipeline_ext run):")
        for name, names in kept.items():
            if names:
                out.append(f"  {name}: {', '.join(names)}")
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch-src", required=True, type=Path, help="PyTorch source checkout")
    parser.add_argument("--files", nargs="+", default=list(DEFAULT_FILES), help="test files to run")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    parser.add_argument("--variants", default="torch,pipeline_ext", help="torch, pipeline_ext or both")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds without progress before a test is killed")
    parser.add_argument("--world-size", type=int, default=2, help="ranks for classes that count accelerators")
    parser.add_argument("--json", type=Path, help="write every result here")
    parser.add_argument("--keep", type=Path, help="keep the ported copies in this (new) directory")
    parser.add_argument("--baseline", type=Path,
                        help="torch's results from an earlier --json (same files and torch): torch is not run again")
    args = parser.parse_args(argv)

    test_dir = find_test_dir(args.torch_src.expanduser())
    files = [f for f in args.files if (test_dir / f).is_file()]
    for missing in set(args.files) - set(files):
        print(f"skipping {missing}: not in {test_dir}")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    root = args.keep or Path(tempfile.mkdtemp(prefix="torch_pp_tests_"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(PORT_WORLD_SIZE=str(args.world_size), PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores: oversubscribed threads spin in Gloo
    log = lambda msg: print(msg, flush=True)  # noqa: E731

    candidates = set().union(*((imported_pipelining_names((test_dir / f).read_text())
                                for f in list(SUPPORT_FILES) + files)))
    provided = probe_provided(candidates) if "pipeline_ext" in variants else set()
    kept: dict[str, list[str]] = {}
    runs: dict[str, dict[str, FileRun]] = {}
    if args.baseline:
        runs["torch"] = load_baseline(args.baseline, files)
        variants = [v for v in variants if v != "torch"]
    started = time.monotonic()
    try:
        for variant in variants:
            cwd = root / variant
            k = prepare(test_dir, cwd, files, args.world_size, provided if variant == "pipeline_ext" else None)
            if variant == "pipeline_ext":
                kept = k
            runs[variant] = {}
            for name in files:
                ids, err = collect(cwd, name, args.keyword, env)
                log(f"[{variant}] {name}: {len(ids)} tests" + (f" (collection failed: {err})" if err else ""))
                run = FileRun(ids=ids)
                run.results = run_file(cwd, ids, args.timeout, env, log) if ids else {}
                runs[variant][name] = run
        if args.baseline and args.keyword and "pipeline_ext" in runs:  # the baseline holds every test
            for name in files:
                selected = set(runs["pipeline_ext"][name].ids)
                runs["torch"][name].ids = [i for i in runs["torch"][name].ids if i in selected]
        # A file that does not even import under pipeline_ext: its tests are torch's, all failed.
        if "torch" in runs and "pipeline_ext" in runs:
            for name in files:
                t, p = runs["torch"][name], runs["pipeline_ext"][name]
                if t.ids and not p.ids:
                    _, err = collect(root / "pipeline_ext", name, args.keyword, env)
                    p.ids = list(t.ids)
                    p.results = {i: Result("error", f"collection: {err}") for i in t.ids}
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print(report(files, runs, kept))
    print(f"\n{time.monotonic() - started:.0f} s; torch {__import__('torch').__version__}; tests from {test_dir}")
    if args.json:
        args.json.write_text(json.dumps({
            "torch_src": str(test_dir), "kept_torch_names": kept,
            "results": {v: {f: {i: vars(r.results[i]) if i in r.results else None for i in r.ids}
                            for f, r in fr.items()} for v, fr in runs.items()},
        }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
