"""Rendering (ASCII, PNG, Chrome trace) and the command line."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pipeline_ext.schedules import build, render_ascii, render_png, simulate, to_chrome_trace
from models import ROOT

ROOT = str(ROOT)  # a str: it is joined into PYTHONPATH


def cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "pipeline_ext.schedules", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)


def test_ascii_timeline():
    text = render_ascii(build("zb_h1", 4, 8))
    rows = text.splitlines()
    assert len(rows) == 4
    assert rows[0].startswith("rank 0 |F0 F1 F2 F3 .  .  .  I0 W0 F4")
    assert rows[3].startswith("rank 3 |.  .  .  F0 I0 F1")
    assert rows[3].endswith("W7")


def test_ascii_labels_stages_on_multi_stage_ranks():
    text = render_ascii(simulate(build("zbv", 2, 4)))
    assert text.startswith("rank 0 |0F0 0F1 0F2 1F0 ") or "3F0" in text


def test_chrome_trace(tmp_path):
    res = simulate(build("1f1b", 2, 2))
    path = tmp_path / "t.json"
    trace = to_chrome_trace(res, str(path))
    loaded = json.loads(path.read_text())
    assert loaded == trace
    spans = [e for e in loaded["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 8 and {e["tid"] for e in spans} == {0, 1}
    names = {e["args"]["name"] for e in loaded["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"rank 0", "rank 1"}
    first = min(spans, key=lambda e: (e["tid"], e["ts"]))
    assert (first["name"], first["ts"], first["dur"]) == ("0F0", 0.0, 1000.0)


def test_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "s.png"
    render_png(simulate(build("zb_h1", 4, 8)), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        render_png(simulate(build("gpipe", 2, 2)), str(tmp_path / "x.png"))


def test_cli_show(tmp_path):
    trace = tmp_path / "t.json"
    out = cli("show", "zb_h1", "--ranks", "4", "--microbatches", "8", "--trace", str(trace))
    assert out.returncode == 0, out.stderr
    assert "zb_h1: 4 ranks, 4 stages, 8 microbatches" in out.stdout
    assert "rank 0 |F0 F1 F2 F3" in out.stdout
    assert "bubble rate 0.1111" in out.stdout
    assert "rank 0: bubble 0.1111, peak activations 4" in out.stdout
    assert json.loads(trace.read_text())["traceEvents"]


def test_cli_show_costs_and_errors():
    out = cli("show", "1f1b", "-p", "8", "-m", "24", "--costs", "18.522,18.086,9.337,0.601")
    assert out.returncode == 0 and "bubble rate 0.2431" in out.stdout
    out = cli("show", "1f1b", "-p", "4", "-m", "2")
    assert out.returncode == 2
    assert "1f1b needs n_microbatches >= num_ranks (got n_microbatches=2, num_ranks=4)" in out.stderr


@pytest.mark.parametrize("args, said", [
    (("--ranks", "99999999999999999999", "-m", "4"), "argument --ranks/-p: 99999999999999999999 is not between 1 and 1024"),
    (("--ranks", "4", "-m", "0"), "argument --microbatches/-m: 0 is not between 1 and 4096"),
    (("--ranks", "4", "-m", "8", "--costs", "inf,1,1,0"), "costs must be finite and non-negative"),
    (("--ranks", "4", "-m", "8", "--costs", "1,-1,1,0"), "costs must be finite and non-negative"),
])
def test_cli_bounds_its_numbers_and_says_which(args, said):
    """A huge rank count ran for minutes and an infinite cost ended in a traceback: both are refused."""
    out = cli("compare", *args)
    assert out.returncode == 2 and said in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_cli_compare():
    out = cli("compare", "--ranks", "4", "--microbatches", "8")
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()[4:]}
    assert set(rows) == {"gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "looped_bfs", "zb_h1", "zb_h2", "zbv",
                         "dualpipev", "v_half", "v_min"}
    assert rows["1f1b"][3] == "0.2727" and rows["zb_h1"][3] == "0.1111" and rows["zbv"][3] == "0.0000"
    # peak memory in units of a rank's share: 1F1B 4, V-Half 3, V-Min 2 ("rank 0 / max")
    assert rows["1f1b"][4:7] == ["4", "/", "4"] and rows["v_half"][6] == "3" and rows["v_min"][6] == "2"


def test_cli_show_over_sequence_pieces():
    """--seq-chunks builds the Seq1F1B order and simulates it at the same work per microbatch: p + K - 1 pieces in
    flight on rank 0 (module doc of pieces.py), fewer microbatches' activations and a shorter makespan than whole
    microbatches (33 for 1f1b -p 4 -m 8)."""
    out = cli("show", "1f1b", "-p", "4", "-m", "8", "--seq-chunks", "4")
    assert out.returncode == 0, out.stderr
    assert "1f1b[seq_chunks=4]: 4 ranks, 4 stages, 8 microbatches of 4 pieces" in out.stdout
    assert "costs 1.000 1.000 1.000 1.000" in out.stdout  # equal cut, priced as it assumes
    assert "makespan 26.25, bubble rate 0.0857" in out.stdout
    assert "rank 0: bubble 0.0857, peak activations 7 pieces, 1.75 microbatches" in out.stdout
    assert "rank 3: bubble 0.0857, peak activations 4 pieces, 1 microbatches" in out.stdout


def test_cli_prices_pieces_by_the_cut_and_the_attention_share():
    """Equal lengths under attention's share 0.6 cost more the later the piece (its keys); cut for that share they
    cost the same, and the longer first piece holds more activations."""
    out = cli("show", "zb_h1", "-p", "2", "-m", "4", "-k", "4", "--attention-share", "0.6")
    assert out.returncode == 0, out.stderr
    assert "piece lengths 0.250 0.250 0.250 0.250, costs 0.550 0.850 1.150 1.450" in out.stdout
    out = cli("show", "zb_h1", "-p", "2", "-m", "4", "-k", "4", "--seq-split", "0.6", "--attention-share", "0.6")
    assert out.returncode == 0, out.stderr
    assert "piece lengths 0.393 0.245 0.195 0.167, costs 1.000 1.000 1.000 1.000" in out.stdout
    out = cli("show", "zb_h1", "-p", "2", "-m", "4", "-k", "4", "--seq-split", "balanced")
    assert out.returncode == 0 and "attention share 1: piece lengths 0.500 0.207 0.159 0.134" in out.stdout


@pytest.mark.parametrize("args, said", [
    (("show", "gpipe", "-p", "2", "-m", "4", "--seq-chunks", "2"),
     "error: schedule 'gpipe' does not run sequence pieces (seq_chunks); those that do: 1f1b, interleaved_1f1b, zb_h1"),
    (("show", "1f1b", "-p", "2", "-m", "4", "--seq-split", "balanced"),
     "--seq-split and --attention-share describe sequence pieces: give --seq-chunks K > 1"),
    (("show", "1f1b", "-p", "2", "-m", "4", "-k", "2", "--seq-split", "1.5"), "argument --seq-split: seq_split must be"),
    (("show", "1f1b", "-p", "2", "-m", "4", "-k", "2", "--attention-share", "x"), "'x' is not a number in [0, 1]"),
    (("show", "1f1b", "-p", "2", "-m", "4", "-k", "65"), "argument --seq-chunks/-k: 65 is not between 1 and 64"),
    (("show", "1f1b", "-p", "2", "-m", "4000", "-k", "2"), "4000 microbatches x seq_chunks=2 is 8000 pieces"),
])
def test_cli_refuses_pieces_it_cannot_run_and_says_why(args, said):
    out = cli(*args)
    assert out.returncode == 2 and said in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_cli_compare_over_pieces_lists_the_schedules_that_run_them():
    out = cli("compare", "-p", "4", "-m", "8", "-k", "4")
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()[5:]}
    assert set(rows) == {"1f1b", "interleaved_1f1b", "zb_h1"}
    assert rows["1f1b"][2:4] == ["26.25", "0.0857"] and rows["1f1b"][4:7] == ["1.75", "/", "1.75"]


def test_cli_validates_an_order_over_pieces_with_its_piece_constraints(monkeypatch, capsys):
    """The CLI validates with pieces=K: an order that runs a sequence's forwards out of piece order (valid as an
    order over microbatches) is refused, not simulated."""
    from pipeline_ext.schedules import __main__ as cli_main
    from pipeline_ext.schedules.ir import Action, ActionKind, Schedule
    from pipeline_ext.schedules.pieces import build_pieces

    def swapped(*args, **kwargs):  # every stage runs piece 1 of sequence 0 forward before piece 0
        sched = build_pieces(*args, **kwargs)
        swap = {ActionKind.F: {0: 1, 1: 0}}
        rows = [[Action(a.stage, a.kind, swap.get(a.kind, {}).get(a.microbatch, a.microbatch)) for a in acts]
                for acts in sched.actions]
        return Schedule(rows, list(sched.stage_to_rank), sched.n_microbatches, sched.name)

    monkeypatch.setattr(cli_main, "build_pieces", swapped)
    assert cli_main.main(["show", "1f1b", "-p", "2", "-m", "2", "-k", "2"]) == 2
    assert "must run in piece order" in capsys.readouterr().err


def test_package_imports_without_torch():
    code = "import sys, pipeline_ext.schedules; assert 'torch' not in sys.modules; print('ok')"
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr
