"""Pipeline x tensor parallel in the training loop: eval, step_microbatches, clip_grad_norm_ and DCP checkpoints.

The set-up of tests/parallel/tp_case.py (4 Gloo CPU ranks, mesh (pp=2, tp=2),
two MLP blocks per stage made tensor-parallel with ``parallelize_module``,
Replicate or sequence-parallel ``Shard(1)`` DTensors between the stages), used
the way a torchtitan user trains: validation passes between the steps,
microbatches of different sequence lengths, gradient clipping over PP x TP and
a checkpoint resumed on fresh stages. Every check is against the unsplit model
(outputs, the loss, every full gradient, the clip total, the parameters after
the optimizer's steps). Several cases run in one rank function call: the
runtime of each test stays at a few seconds.
"""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mp_utils import no_complaints, rank_values
from models import TOL, run_stages
from tp_case import (D, M, ROWS, Stage, batch, full, grad_mismatches, loss_mismatch, mse, param_mismatches, parallelize,
                     placement, pp_tp_mesh, rank_copies, replicas_mean, schedule, sgd_pair, stages_on_rank,
                     unsplit_loss)

CLIP = 0.05  # below every step's total norm here: the clip scales every gradient


class NormStage(Stage):
    """A LayerNorm before the blocks, sequence-parallel (``SequenceParallel``: its weights are replicated over
    tp, their gradients ``Partial`` sums), as torchtitan's norms between its sequence-parallel blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        return self.blocks(self.norm(x))


def _stages(num_stages: int, case: str) -> list[nn.Module]:
    """The unsplit model's stages: with ``case`` "sequence_norm" or "local_norm", every stage but the first (whose
    input is the caller's, not sequence-sharded) has a norm (sequence-parallel, or a plain module whose plain
    gradients sit beside the blocks' DTensor ones)."""
    return [NormStage() if case.endswith("_norm") and s > 0 else Stage() for s in range(num_stages)]


def _pipeline(mesh, name: str, case: str, seed: int = 0, last_out: str = ""):
    """(stage indices on this rank, {stage: TP module}, the unsplit model's stages, schedule, optimizer, the
    unsplit model's optimizer); the pipeline's stages start from the weights of the unsplit model made with
    ``seed``; ``last_out``: the last stage returns a DTensor of that placement (else a plain tensor)."""
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    tp, pp = mesh["tp"], mesh["pp"]
    ns, mine = stages_on_rank(name, pp)
    torch.manual_seed(seed)
    ref, copies = _stages(ns, case), _stages(ns, case)
    modules = rank_copies(ref, mine, copies.__getitem__)
    for s in mine:
        modules[s] = parallelize(modules[s], s, ns, case.replace("_norm", ""), tp, last_out)
        if isinstance(modules[s], NormStage) and case == "sequence_norm":
            parallelize_module(modules[s], tp, {"norm": SequenceParallel()})
    _, sched = schedule(name, modules, mine, ns, pp)
    return (mine, modules, ref, sched, *sgd_pair(mine, modules, ref))


def _put(mesh, given: str):
    """The caller's tensors as DTensors of placement ``given`` on the tp mesh (as they are when ``given`` is "")."""
    from torch.distributed.tensor import distribute_tensor

    return (lambda t: distribute_tensor(t, mesh["tp"], [placement(given)])) if given else (lambda t: t)


# -- 1. eval between training steps ------------------------------------------------------------------------
def _eval_between_steps(rank: int, world: int, cases: list[tuple[str, str, str]]) -> list[str]:
    """A validate-then-train loop: eval (with a target: losses, no gradients), step, eval, step; DTensor
    activations cross the stages in both the forward-only and the training schedule. ``given``: the batch's
    inputs, targets and the last stage's outputs are DTensors of that placement (else plain tensors)."""
    mesh = pp_tp_mesh()
    bad: list[str] = []
    for name, case, given in cases:
        mine, modules, ref, sched, opt, ref_opt = _pipeline(mesh, name, case, last_out=given)
        put = _put(mesh, given)
        last = sched.has_last_stage
        for step in range(2):
            where = f"{case} {name} given={given} rank {rank} step {step}"
            x, y = batch(10 + step)
            losses: list = []
            out = sched.eval(*((put(x),) if sched.has_first_stage else ()), target=put(y) if last else None,
                             losses=losses)
            with torch.no_grad():
                want = run_stages(ref, x)
            if last:
                if not torch.allclose(full(out), want, **TOL):
                    bad.append(f"{where}: eval output differs (max err {(full(out) - want).abs().max():.3g})")
                bad += loss_mismatch(where, replicas_mean(losses), mse(want, y), what="eval loss")
            if any(p.grad is not None for s in mine for p in modules[s].parameters()):
                bad.append(f"{where}: eval produced gradients")
            x, y = batch(step)
            losses = []
            sched.step(*((put(x),) if sched.has_first_stage else ()), target=put(y) if last else None, losses=losses)
            _, ref_loss = unsplit_loss(ref, x, y)
            if last:
                bad += loss_mismatch(where, replicas_mean(losses), ref_loss, what="training loss")
            bad += grad_mismatches(where, mine, modules, ref)
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
        dist.barrier()
    return bad


@pytest.mark.timeout(300)
def test_eval_with_dtensor_activations_between_training_steps_matches_the_unsplit_model():
    no_complaints(_eval_between_steps, 4, [("1f1b", "replicate", ""), ("interleaved_1f1b", "sequence", ""),
                                           ("zb_h1", "sequence", "shard0")], timeout=280)


# -- 2. step_microbatches: DTensors of a different sequence length per microbatch --------------------------
# per step, one sequence length per microbatch; 5 and 3 do not divide over tp=2 (uneven Shard(1)); the second
# step has the first one's lengths in another order, the third new ones
LENGTHS = [[4, 6, 5, 3], [5, 3, 6, 4], [2, 7, 4, 8]]


def _microbatches_of_lengths(rank: int, world: int, cases: list[tuple[str, str, bool]]) -> list[str]:
    """``given``: each microbatch's input, target and output are DTensors of that placement (else plain
    tensors)."""
    mesh = pp_tp_mesh()
    bad: list[str] = []
    for name, case, given in cases:
        mine, modules, ref, sched, opt, ref_opt = _pipeline(mesh, name, case, last_out=given)
        put = _put(mesh, given)
        first, last = sched.has_first_stage, sched.has_last_stage
        for step, lengths in enumerate(LENGTHS):
            where = f"{case} {name} given={given} rank {rank} step {step}"
            pairs = [batch(100 * step + k, seq) for k, seq in enumerate(lengths)]
            xs, ys = [p[0][: ROWS // M] for p in pairs], [p[1][: ROWS // M] for p in pairs]
            losses: list = []
            outs = sched.step_microbatches([(put(x),) for x in xs] if first else None,
                                           target_mbs=[put(y) for y in ys] if last else None, losses=losses)
            # the unsplit model on the same microbatches, each microbatch's loss weighted by its rows (all equal)
            want = [run_stages(ref, x) for x in xs]
            ref_losses = [mse(o, y) for o, y in zip(want, ys)]
            torch.stack(ref_losses).mean().backward()
            if last:
                for k, (o, w) in enumerate(zip(outs, want)):
                    if tuple(o.shape) != tuple(w.shape) or not torch.allclose(full(o), w.detach(), **TOL):
                        bad.append(f"{where}: microbatch {k}'s output differs")
                for k, (v, w) in enumerate(zip(losses, ref_losses)):
                    bad += loss_mismatch(where, full(v), w, what=f"microbatch {k}'s loss")
            bad += grad_mismatches(where, mine, modules, ref)
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
            if step == 0:  # validation between the steps, on the microbatches in another order
                evals = sched.eval_microbatches([(put(x),) for x in xs[::-1]] if first else None)
                if last:
                    with torch.no_grad():
                        want = [run_stages(ref, x) for x in xs[::-1]]
                    if not all(torch.allclose(full(o), w, **TOL) for o, w in zip(evals, want)):
                        bad.append(f"{where}: eval_microbatches' outputs differ")
        bad += param_mismatches(f"{case} {name} given={given} rank {rank}", mine, modules, ref)
        dist.barrier()
    return bad


@pytest.mark.timeout(300)
def test_step_microbatches_with_dtensors_of_different_sequence_lengths_matches_the_unsplit_model():
    no_complaints(_microbatches_of_lengths, 4, [("1f1b", "sequence", ""), ("zb_h1", "replicate", "replicate"),
                                                ("interleaved_1f1b", "sequence", "shard1")], timeout=280)


# -- 3. clip_grad_norm_ over PP x TP -----------------------------------------------------------------------
def _clip(rank: int, world: int, cases: list[tuple[str, str]]) -> list[str]:
    import pipeline_ext as pe

    mesh = pp_tp_mesh()
    bad: list[str] = []
    for name, case in cases:
        mine, modules, ref, sched, opt, ref_opt = _pipeline(mesh, name, case)
        for step in range(2):
            where = f"{case} {name} rank {rank} step {step}"
            x, y = batch(step)
            sched.step(*((x,) if sched.has_first_stage else ()), target=y if sched.has_last_stage else None)
            unsplit_loss(ref, x, y)
            ref_grads = [p.grad for m in ref for p in m.parameters()]
            for order in (1.0, float("inf")):  # a sum and a max over the TP shards and the stages
                got = full(pe.training.total_grad_norm(sched, order))
                want = torch.nn.utils.get_total_norm(ref_grads, order)
                if not torch.allclose(got, want, **TOL):
                    bad.append(f"{where}: total norm of order {order} {got.item()} != the unsplit model's "
                               f"{want.item()}")
            total = pe.clip_grad_norm_(sched, CLIP)
            ref_total = torch.nn.utils.clip_grad_norm_([p for m in ref for p in m.parameters()], CLIP)
            if not torch.allclose(full(total), ref_total, **TOL):
                bad.append(f"{where}: clip total {full(total).item()} != the unsplit model's {ref_total.item()}")
            bad += grad_mismatches(f"{where} (clipped)", mine, modules, ref)
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
            bad += param_mismatches(where, mine, modules, ref)
        dist.barrier()
    return bad


@pytest.mark.timeout(300)
def test_clip_grad_norm_over_pp_x_tp_matches_the_unsplit_model():
    no_complaints(_clip, 4, [("1f1b", "replicate"), ("interleaved_1f1b", "sequence_norm"), ("1f1b", "local_norm")],
                  timeout=280)


# -- 4. DCP save and load of a PP x TP model ---------------------------------------------------------------
def _save_resume(rank: int, world: int, path: str, cases: list[tuple[str, str]]) -> tuple[list[str], dict]:
    """Train 2 steps, save, train 2 more; fresh stages (other weights, no optimizer state) load the checkpoint
    and train the same 2: every parameter ends bitwise where the first stages did. Returns the complaints and,
    per case, the full tensors saved (unsplit names, numpy: no shared memory)."""
    import pipeline_ext as pe

    mesh = pp_tp_mesh()
    bad: list[str] = []
    full_saved: dict[str, dict] = {}
    for name, case in cases:
        where = f"{case} {name} rank {rank}"
        ckpt = os.path.join(path, f"{name}-{case}")

        def train(sched, opt, steps) -> None:
            for step in steps:
                x, y = batch(step)
                sched.step(*((x,) if sched.has_first_stage else ()), target=y if sched.has_last_stage else None)
                opt.step()
                opt.zero_grad()

        mine, modules, ref, sched, _, _ = _pipeline(mesh, name, case, seed=0)
        opt = torch.optim.AdamW([p for s in mine for p in modules[s].parameters()], lr=0.05)
        fqn_maps = {s: f"{s}." for s in mine}  # the unsplit model is nn.Sequential(*stages)
        train(sched, opt, range(2))
        saved = {s: {k: full(v).clone() for k, v in modules[s].state_dict().items()} for s in mine}
        pe.save_checkpoint(ckpt, sched, opt, fqn_maps=fqn_maps)
        full_saved[ckpt] = {f"{s}.{k}": v.numpy() for s in mine for k, v in saved[s].items()}
        train(sched, opt, range(2, 4))
        _, fresh, _, sched2, _, _ = _pipeline(mesh, name, case, seed=1)
        opt2 = torch.optim.AdamW([p for s in mine for p in fresh[s].parameters()], lr=0.05)
        pe.load_checkpoint(ckpt, sched2, opt2, fqn_maps=fqn_maps)
        for s in mine:
            for k, v in saved[s].items():
                got = fresh[s].state_dict()[k]
                if not torch.equal(full(got), v) or type(got) is not type(modules[s].state_dict()[k]):
                    bad.append(f"{where}: stage {s} {k} was not loaded as saved")
        train(sched2, opt2, range(2, 4))
        for s in mine:
            for (k, p), q in zip(modules[s].named_parameters(), fresh[s].parameters()):
                if not torch.equal(full(p), full(q)):
                    bad.append(f"{where}: stage {s} {k} after resuming differs from not stopping "
                               f"(max err {(full(p) - full(q)).abs().max():.3g})")
        # the same stages without tensor parallelism (every tp rank a replica) load it too: DCP reshards
        plain = _stages(len(ref), case)
        plain_stages = [pe.PipelineStage(plain[s], s, len(plain), "cpu", group=mesh["pp"]) for s in mine]
        opt3 = torch.optim.AdamW([p for s in mine for p in plain[s].parameters()], lr=0.05)
        pe.load_checkpoint(ckpt, plain_stages, opt3, fqn_maps=fqn_maps)
        for s in mine:
            for k, v in saved[s].items():
                if not torch.equal(plain[s].state_dict()[k], v):
                    bad.append(f"{where}: stage {s} {k} was not loaded as saved into a stage without TP")
        if any(float(st["step"]) != 2 for st in opt3.state.values()) or len(opt3.state) != len(opt2.state):
            bad.append(f"{where}: the optimizer state was not loaded into the stages without TP")
        dist.barrier()
    return bad, full_saved


@pytest.mark.timeout(300)
def test_dcp_save_and_load_of_pp_x_tp_stages_resumes_bitwise_and_the_unsplit_model_loads_it():
    import pipeline_ext as pe

    cases = [("1f1b", "replicate"), ("interleaved_1f1b", "sequence_norm")]
    with tempfile.TemporaryDirectory() as tmp:
        said = rank_values(_save_resume, 4, tmp, cases, timeout=280)
        assert not [c for bad, _ in said.values() for c in bad], said
        # the checkpoint is the unsplit model's: full tensors under its names (the TP shards put together), and
        # its optimizer state; it loads in a process without torch.distributed
        for name, case in cases:
            ckpt = os.path.join(tmp, f"{name}-{case}")
            saved = {k: torch.from_numpy(v) for _, per_case in said.values() for k, v in per_case[ckpt].items()}
            unsplit = nn.Sequential(*_stages(2 if name == "1f1b" else 4, case))
            opt = torch.optim.AdamW(unsplit.parameters(), lr=0.05)
            pe.load_checkpoint(ckpt, unsplit, opt)
            assert unsplit.state_dict().keys() == saved.keys(), (name, case)
            for k, v in unsplit.state_dict().items():
                assert torch.equal(v, saved[k]), (name, case, k)
            assert len(opt.state) == len(saved) and all(float(st["step"]) == 2 for st in opt.state.values())
