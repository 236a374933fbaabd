"""examples/llama_pipeline.py runs (2 stages x 2 data-parallel replicas, tied embeddings, clipping, token mean;
with ``--tp 2`` on 8 ranks: 2 stages x 2 TP ranks x 2 FSDP replicas).

Run as a user runs it (``python examples/llama_pipeline.py --spawn 4 --pp 2
--check`` in a subprocess, at tiny settings): it prints its layout, its
first step matches the unsplit Hugging Face model on the global batch
(``check: PASS``, exit status 0), training moves the loss down, and the
example's own transformers calls raise no deprecation warning. With
``--balance`` on 4 stages the split rank 0 measured is printed in the layout
line, is a split of [embedding, decoder layers, head] into non-empty stages,
and the check still passes (the split is whatever the timings give, so the
cutting itself is also checked on fixed splits, the embedding and the head
alone on a stage included, without processes). The layout, the verdict and
``--balance``'s error on too many stages are also checked without processes. ``transformers`` is
installed in CI (requirements-dev.txt); without it the tests are skipped,
never faked.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest
import torch

from models import ROOT, TOL

pytest.importorskip("transformers")
sys.path.insert(0, str(ROOT / "examples"))
import llama_pipeline  # noqa: E402

import pipeline_ext as pe  # noqa: E402


def _run_example(*args: str, timeout: int = 220) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # -W reaches the spawned ranks too (multiprocessing passes the interpreter's warning options on)
    cmd = [sys.executable, "-W", "default::FutureWarning", str(ROOT / "examples" / "llama_pipeline.py"), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_llama_example_pp2_dp2_prints_layout_passes_check_and_trains():
    proc = _run_example("--spawn", "4", "--pp", "2", "--check", "--batch", "8", "--seq", "16", "--microbatches", "2",
                        "--steps", "3")
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


@pytest.mark.slow
@pytest.mark.ranks8
@pytest.mark.timeout(300)
def test_llama_example_pp2_tp2_dp2_on_8_ranks_passes_check_and_trains():
    """pp x tp x FSDP as torchtitan composes it (TP, then fully_shard over dp, then the stage on pp), tied embedding
    and head sharded over TP: the first step matches the unsplit model on the global batch, the loss goes down."""
    proc = _run_example("--spawn", "8", "--pp", "2", "--tp", "2", "--check", "--batch", "8", "--seq", "16",
                        "--microbatches", "2", "--steps", "3", timeout=280)
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert out.count("layout: ") == 1 and out.startswith(
        "layout: pp=2 x dp=2 x tp=2, schedule 1f1b, 1 stage per rank; rank 0: stage 0 (dp replica 0, tp rank 0), "
        "rank 1: stage 0 (dp replica 0, tp rank 1), rank 2: stage 1 (dp replica 0, tp rank 0), "), out
    m = re.search(r"^check: PASS \(max grad rel err (\S+), norm rel err (\S+), loss rel err (\S+)\)$", out, re.M)
    assert m and out.count("check: ") == 1, out
    assert all(float(x) < 1e-5 for x in m.groups()), m.group(0)
    losses = [float(x) for x in re.findall(r"^step +\d+ +loss ([0-9.]+)", out, re.M)]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_llama_example_balance_on_4_stages_prints_a_valid_split_and_passes_check():
    proc = _run_example("--spawn", "4", "--pp", "4", "--balance", "--check", "--batch", "8", "--seq", "16",
                        "--microbatches", "4", "--steps", "2")
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    m = re.search(r"^layout: pp=4 x dp=1, schedule 1f1b, 1 stage per rank, split \[([0-9, ]+)\] of "
                  r"\[embedding, 4 decoder layers, head\]; rank 0: stage 0 \(dp replica 0\), .*rank 3: stage 3 "
                  r"\(dp replica 0\)$", out, re.M)
    assert m and out.count("layout: ") == 1, out
    split = [int(x) for x in m.group(1).split(",")]
    assert len(split) == 4 and sum(split) == 4 + 2 and min(split) >= 1, split
    c = re.search(r"^check: PASS \(max grad rel err (\S+), norm rel err (\S+), loss rel err (\S+)\)$", out, re.M)
    assert c and out.count("check: ") == 1, out
    assert all(float(x) < 1e-5 for x in c.groups()), c.group(0)


@pytest.mark.parametrize("split", [[2, 1, 1, 2], [1, 2, 2, 1], [4, 1, 1], [1, 5]])
def test_llama_stages_cut_by_a_split_compute_the_unsplit_model(split):
    torch.manual_seed(0)
    full = llama_pipeline.LlamaForCausalLM(llama_pipeline.llama_config("tiny", 16)).eval()
    ids, mask, _ = llama_pipeline.make_batch(3, 16, full.config.vocab_size, 0)
    ranges, n = pe.block_ranges(split), len(split)
    stages = [llama_pipeline.LlamaStage(full, lo, hi, first=s == 0, last=s == n - 1)
              for s, (lo, hi) in enumerate(ranges)]
    with torch.no_grad():
        out = pe.LayerChain(*stages)(ids, attention_mask=mask)
        ref = full(ids, attention_mask=mask, position_ids=torch.arange(16).repeat(3, 1)).logits
    assert torch.allclose(out, ref, **TOL)
    assert sorted(k for st in stages for k in st.state_dict()) == sorted(full.state_dict())  # every weight, once


def test_llama_balanced_split_is_a_valid_split_without_processes():
    torch.manual_seed(0)
    full = llama_pipeline.LlamaForCausalLM(llama_pipeline.llama_config("tiny", 16))
    split = llama_pipeline.balanced_split(full, "zbv", 2, 4, 2, 16, torch.device("cpu"), repeats=1)
    assert len(split) == 4 and sum(split) == 6 and min(split) >= 1
    assert all(p.grad is None for p in full.parameters())  # profiling leaves the model as it was


def test_llama_example_balance_refuses_more_stages_than_it_can_cut(capsys):
    with pytest.raises(SystemExit) as exc:  # tiny: 4 decoder layers, so 6 entries; 8 stages
        llama_pipeline.main(["--balance", "--spawn", "8", "--pp", "8"])
    assert exc.value.code == 2
    assert "--balance: 1f1b on --pp 8 has 8 stages, more than the 6 entries (embedding, 4 decoder layers, head)" \
        in capsys.readouterr().err


def test_llama_example_layout_names_each_ranks_stages():
    assert llama_pipeline.describe_layout(2, 2, "zbv") == (
        "layout: pp=2 x dp=1, schedule zbv, 2 stages per rank; "
        "rank 0: stages 0, 3 (dp replica 0), rank 1: stages 1, 2 (dp replica 0)")
    with pytest.raises(ValueError, match="not a multiple"):
        llama_pipeline.describe_layout(3, 2, "1f1b")
    assert llama_pipeline.describe_layout(2, 2, "1f1b", [1, 5]) == (
        "layout: pp=2 x dp=1, schedule 1f1b, 1 stage per rank, split [1, 5] of [embedding, 4 decoder layers, head]; "
        "rank 0: stage 0 (dp replica 0), rank 1: stage 1 (dp replica 0)")


def test_llama_example_balance_refuses_tp(capsys):
    with pytest.raises(SystemExit) as exc:
        llama_pipeline.main(["--balance", "--spawn", "4", "--pp", "2", "--tp", "2"])
    assert exc.value.code == 2
    assert "--balance times layers on one rank: it does not combine with --tp" in capsys.readouterr().err


def test_llama_example_layout_with_tp_names_each_ranks_stages_and_tp_rank():
    assert llama_pipeline.describe_layout(4, 2, "1f1b", tp=2) == (
        "layout: pp=2 x dp=1 x tp=2, schedule 1f1b, 1 stage per rank; "
        "rank 0: stage 0 (dp replica 0, tp rank 0), rank 1: stage 0 (dp replica 0, tp rank 1), "
        "rank 2: stage 1 (dp replica 0, tp rank 0), rank 3: stage 1 (dp replica 0, tp rank 1)")
    assert llama_pipeline.planned_layout(8, 2, "zbv", tp=2)[5] == (1, (0, 3))  # replica 1, pipeline rank 0
    with pytest.raises(ValueError, match="not a multiple of --pp 2 x --tp 4"):
        llama_pipeline.describe_layout(4, 2, "1f1b", tp=4)


def test_llama_example_check_verdict():
    ok = {0: {"grad_rel_err": 2e-7, "norm_err": 1e-7}, 1: {"grad_rel_err": 5e-7, "norm_err": 1e-7, "loss_err": 0.0}}
    assert llama_pipeline.check_verdict(ok) == (
        True, "check: PASS (max grad rel err 5.0e-07, norm rel err 1.0e-07, loss rel err 0.0e+00)")
    bad = {0: {"grad_rel_err": 0.14, "norm_err": math.nan}}  # a wrong gradient, a NaN norm, no last stage reported
    assert llama_pipeline.check_verdict(bad) == (
        False, "check: FAIL (max grad rel err 1.4e-01 > 1e-04, norm rel err nan > 1e-04, loss rel err missing)")


# -- sequence pieces (seq_chunks, Seq1F1B) on the Hugging Face Llama -------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule,pieces,split", [("1f1b", 4, "cost"), ("zb_h1", 2, "equal"),
                                                   ("interleaved_1f1b", 2, "equal")])
def test_llama_example_with_sequence_pieces_passes_check(schedule, pieces, split):
    """The user's command with ``--seq-chunks``: padded sequences (the attention mask cut with them), the first
    step against the unsplit Hugging Face model on the whole sequences; pieces of equal length, or of equal cost
    (unequal lengths)."""
    proc = _run_example("--spawn", "2", "--pp", "2", "--check", "--batch", "8", "--seq", "33", "--microbatches", "2",
                        "--steps", "2", "--schedule", schedule, "--seq-chunks", str(pieces), "--seq-split", split)
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    m = re.search(r"^check: PASS \(max grad rel err (\S+), norm rel err (\S+), loss rel err (\S+)\)$", out, re.M)
    assert m and all(float(x) < 1e-5 for x in m.groups()), out[-2000:]


def _llama_pieces(rank: int, world: int, attn: str) -> list[str]:
    """Two microbatches of different lengths (``step_microbatches``), each cut into 2 pieces, on a 2-stage HF
    Llama: loss and every gradient against the unsplit model on each whole sequence; or, with the model's
    attention left on ``attn`` (not the one that carries pieces), the error this rank raised."""
    from pipeline_ext.seqchunks import register_hf_attention

    config = llama_pipeline.llama_config("tiny", 24)
    config.tie_word_embeddings = False  # no tie_parameters here: the unsplit model's embedding and head apart
    config._attn_implementation = register_hf_attention() if attn == "pieces" else attn
    torch.manual_seed(0)
    full = llama_pipeline.LlamaForCausalLM(config)
    ref = llama_pipeline.LlamaForCausalLM(config)
    ref.load_state_dict(full.state_dict())
    ranges = pe.block_ranges([3, 3])
    stage = llama_pipeline.LlamaStage(full, *ranges[rank], first=rank == 0, last=rank == 1)
    loss_fn = pe.TokenMeanLoss()
    batches = [llama_pipeline.make_batch(2, n, config.vocab_size, n) for n in (24, 17)]
    try:
        sched = pe.Schedule1F1B(pe.PipelineStage(stage, rank, 2, "cpu"), 2, loss_fn=loss_fn, seq_chunks=2, timeout=60)
        sched.step_microbatches(arg_mbs=[(ids,) for ids, _, _ in batches] if rank == 0 else None,
                                kwarg_mbs=[{"attention_mask": m} for _, m, _ in batches] if rank == 0 else None,
                                target_mbs=[lab for _, _, lab in batches] if rank == 1 else None, losses=(losses := []))
    except Exception as exc:  # noqa: BLE001 - the message is what the refusal test reads
        return [f"{type(exc).__name__}: {exc}"]
    tokens = sum(int((lab != -100).sum()) for _, _, lab in batches)
    ref_loss = sum(llama_pipeline.lm_loss(ref(ids, attention_mask=m).logits, lab) * int((lab != -100).sum())
                   for ids, m, lab in batches) / tokens
    ref_loss.backward()
    bad = []
    if rank == 1 and not torch.allclose(loss_fn.combine(losses), ref_loss.detach(), **TOL):
        bad.append(f"loss {float(loss_fn.combine(losses))} != {float(ref_loss)}")
    for fqn, p in stage.named_parameters():
        q = ref.get_parameter(fqn)
        if p.grad is None or not torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6):
            bad.append(f"rank {rank} {fqn}: grad differs")
    return bad


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_llama_pieces_of_microbatches_of_different_lengths_match_the_unsplit_model():
    from mp_utils import rank_values

    bad = [b for v in rank_values(_llama_pieces, 2, "pieces", timeout=200).values() for b in v]
    assert not bad, "\n".join(bad[:10])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_llama_whose_attention_does_not_carry_pieces_is_refused_by_name_on_every_rank():
    """Refused when the schedule is built, before any step, by every rank for its own stages."""
    from mp_utils import rank_values

    for rank, said in rank_values(_llama_pieces, 2, "sdpa", timeout=200).items():
        assert len(said) == 1 and said[0].startswith("PiecesNotSupportedError"), said
        assert all(w in said[0] for w in ("does not carry sequence pieces", "'sdpa'", "register_hf_attention")), said
