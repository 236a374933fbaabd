"""Tests and benchmarks reach the library through its extension points, never by writing its state (issue 55).

A per-action recorder registers with ``sched.register_action_hook`` (not by
taking the tracer's slot, ``sched._tracer``); the executor knows the overlap
runner by its type, ``PairRunner`` (not by a mark on a function,
``.pair_messages``); a ``StageRunner`` gets what it runs with as constructor
arguments and measuring tools through ``instrument`` ([Note: a runner is
configured once, instruments attach] in ``runtime/stage.py``), so nothing
assigns ``on_kept``, ``meshes``, ``release_outputs``, ``keep_outputs`` or
``call`` into one after it was built. The scan is textual on purpose: an
assignment in a test or benchmark is what would bring the old ways back.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn
from models import ROOT

ROOT = ROOT

#: writes that have a public way instead: ``<anything>.<name> = ...`` (not ``==``)
FORBIDDEN = re.compile(r"\.(_tracer|pair_messages|on_kept|meshes|release_outputs|keep_outputs|call)\s*=(?!=)")
#: where the library itself may assign them: the owner's own constructor or method
OWNERS = {"pipeline_ext/runtime/stage.py", "pipeline_ext/pipe/connected.py", "pipeline_ext/pipelining/stage.py",
          "pipeline_ext/pipelining/_schedule_base.py"}


def _writes(paths: list[Path]) -> list[str]:
    found = []
    for path in paths:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if FORBIDDEN.search(code):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    return found


def test_no_test_or_benchmark_writes_the_tracer_the_pair_mark_or_a_runners_attributes():
    files = sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "benchmarks").rglob("*.py"))
    files = [f for f in files if f.resolve() != Path(__file__).resolve()]
    found = _writes(files)
    assert not found, ("use register_action_hook / PairRunner / StageRunner's constructor or instrument():\n"
                       + "\n".join(found))


def test_the_library_assigns_them_only_in_their_owners():
    files = [f for f in sorted((ROOT / "pipeline_ext").rglob("*.py"))
             if str(f.relative_to(ROOT)) not in OWNERS]
    found = _writes(files)
    assert not found, "\n".join(found)
    for owner in OWNERS:  # and there only on ``self``
        others = [w for w in _writes([ROOT / owner]) if not re.search(r"\bself\.\w+\s*=", w.split(": ", 1)[1])]
        assert not others, "\n".join(others)


def test_an_instrument_adds_to_the_runner_and_comes_off_again():
    """``instrument``'s wrap sees every forward and its ``on_kept`` runs beside the constructor's; ``remove()``
    restores the runner as built."""
    from pipeline_ext.runtime.stage import StageRunner

    built_kept: list = []
    runner = StageRunner(nn.Linear(4, 4), 1, 2, on_kept=built_kept.append)
    calls: list[int] = []

    def wrap(call):
        def counted(mb, module, args, kwargs):
            calls.append(mb)
            return call(mb, module, args, kwargs)
        return counted

    attached_kept: list = []
    handle = runner.instrument(wrap_call=wrap, on_kept=attached_kept.append)
    for mb in (0, 1):
        if mb == 1:
            handle.remove()
        runner.forward(mb, (torch.randn(2, 4, requires_grad=True),))
        runner.backward_input(mb, [torch.ones(2, 4)])
        runner.backward_weight(mb)
    assert calls == [0]
    assert len(built_kept) == 2 and len(attached_kept) == 1


def test_the_overlap_runner_is_a_pair_runner_and_a_plain_function_is_not():
    from pipeline_ext.runtime.group_run import PairRunner
    from pipeline_ext.runtime.overlap import OVERLAPPED, run_overlapped

    assert isinstance(OVERLAPPED, PairRunner) and OVERLAPPED.fn is run_overlapped
    assert not hasattr(run_overlapped, "pair_messages")
    assert not isinstance(run_overlapped, PairRunner)
