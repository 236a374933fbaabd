"""Pipeline x tensor parallel in the training loop: eval, step_microbatches, clip_grad_norm_ and DCP checkpoints.

The set-up of tests/parallel/test_tensor_parallel.py (4 Gloo CPU ranks, mesh (pp=2, tp=2),
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
from test_tensor_parallel import D, M, ROWS, SEQ, Stage, _fresh_dtensor_caches, _full, _loss, _parallelize, _placement
from models import TOL

CLIP = 0.05  # below every step's total norm here: the clip scales every gradient


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    _fresh_dtensor_caches()
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))


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

    import pipeline_ext as pe
    from pipeline_ext import schedules as S

    tp, pp = mesh["tp"], mesh["pp"]
    plan = S.build(name, 2, M)
    ns = plan.num_stages
    mine = [s for s, r in enumerate(plan.stage_to_rank) if r == pp.get_local_rank()]
    torch.manual_seed(seed)
    ref, copies = _stages(ns, case), _stages(ns, case)
    modules = {s: copies[s] for s in mine}
    for s in mine:
        modules[s].load_state_dict(ref[s].state_dict())
        modules[s] = _parallelize(modules[s], s, ns, case.replace("_norm", ""), tp, last_out)
        if isinstance(modules[s], NormStage) and case == "sequence_norm":
            parallelize_module(modules[s], tp, {"norm": SequenceParallel()})
    stages = [pe.PipelineStage(modules[s], s, ns, "cpu", group=pp) for s in mine]
    sched = pe.get_schedule_class(name)(stages if len(stages) > 1 else stages[0], M, loss_fn=_loss, timeout=120.0)
    opt = torch.optim.SGD([p for s in mine for p in modules[s].parameters()], lr=0.1)
    ref_opt = torch.optim.SGD([p for m in ref for p in m.parameters()], lr=0.1)
    return mine, modules, ref, sched, opt, ref_opt


def _put(mesh, given: str):
    """The caller's tensors as DTensors of placement ``given`` on the tp mesh (as they are when ``given`` is "")."""
    from torch.distributed.tensor import distribute_tensor

    return (lambda t: distribute_tensor(t, mesh["tp"], [_placement(given)])) if given else (lambda t: t)


def _unsplit(ref, x: torch.Tensor) -> torch.Tensor:
    for m in ref:
        x = m(x)
    return x


def _batch(step: int, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(ROWS, seq, D, generator=g), torch.randn(ROWS, seq, D, generator=g)


def _compare_grads(where: str, mine, modules, ref) -> list[str]:
    bad = []
    for s in mine:
        for (pn, p), q in zip(modules[s].named_parameters(), ref[s].parameters()):
            if p.grad is None or not torch.allclose(_full(p.grad), q.grad, **TOL):
                err = "none" if p.grad is None else f"{(_full(p.grad) - q.grad).abs().max():.3g}"
                bad.append(f"{where}: stage {s} {pn} grad differs (max err {err})")
    return bad


def _compare_params(where: str, mine, modules, ref, exact: bool = False) -> list[str]:
    bad = []
    for s in mine:
        for (pn, p), q in zip(modules[s].named_parameters(), ref[s].parameters()):
            same = torch.equal(_full(p), q.detach()) if exact else torch.allclose(_full(p), q.detach(), **TOL)
            if not same:
                bad.append(f"{where}: stage {s} {pn} differs after the step "
                           f"(max err {(_full(p) - q.detach()).abs().max():.3g})")
    return bad


# -- 1. eval between training steps ------------------------------------------------------------------------
def _eval_between_steps(rank: int, world: int, cases: list[tuple[str, str, str]]) -> list[str]:
    """A validate-then-train loop: eval (with a target: losses, no gradients), step, eval, step; DTensor
    activations cross the stages in both the forward-only and the training schedule. ``given``: the batch's
    inputs, targets and the last stage's outputs are DTensors of that placement (else plain tensors)."""
    mesh = _mesh()
    bad: list[str] = []
    for name, case, given in cases:
        mine, modules, ref, sched, opt, ref_opt = _pipeline(mesh, name, case, last_out=given)
        put = _put(mesh, given)
        last = sched.has_last_stage
        for step in range(2):
            where = f"{case} {name} given={given} rank {rank} step {step}"
            x, y = _batch(10 + step)
            losses: list = []
            out = sched.eval(*((put(x),) if sched.has_first_stage else ()), target=put(y) if last else None,
                             losses=losses)
            with torch.no_grad():
                want = _unsplit(ref, x)
            if last:
                if not torch.allclose(_full(out), want, **TOL):
                    bad.append(f"{where}: eval output differs (max err {(_full(out) - want).abs().max():.3g})")
                got = torch.stack([_full(v) for v in losses]).mean()
                if not torch.allclose(got, _loss(want, y), **TOL):
                    bad.append(f"{where}: eval loss {got.item()} != {_loss(want, y).item()}")
            if any(p.grad is not None for s in mine for p in modules[s].parameters()):
                bad.append(f"{where}: eval produced gradients")
            x, y = _batch(step)
            losses = []
            sched.step(*((put(x),) if sched.has_first_stage else ()), target=put(y) if last else None, losses=losses)
            ref_loss = _loss(_unsplit(ref, x), y)
            ref_loss.backward()
            if last and not torch.allclose(torch.stack([_full(v) for v in losses]).mean(), ref_loss.detach(), **TOL):
                bad.append(f"{where}: training loss differs")
            bad += _compare_grads(where, mine, modules, ref)
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
    mesh = _mesh()
    bad: list[str] = []
    for name, case, given in cases:
        mine, modules, ref, sched, opt, ref_opt = _pipeline(mesh, name, case, last_out=given)
        put = _put(mesh, given)
        first, last = sched.has_first_stage, sched.has_last_stage
        for step, lengths in enumerate(LENGTHS):
            where = f"{case} {name} given={given} rank {rank} step {step}"
            pairs = [_batch(100 * step + k, seq) for k, seq in enumerate(lengths)]
            xs, ys = [p[0][: ROWS // M] for p in pairs], [p[1][: ROWS // M] for p in pairs]
            losses: list = []
            outs = sched.step_microbatches([(put(x),) for x in xs] if first else None,
                                           target_mbs=[put(y) for y in ys] if last else None, losses=losses)
            # the unsplit model on the same microbatches, each microbatch's loss weighted by its rows (all equal)
            want = [_unsplit(ref, x) for x in xs]
            ref_losses = [_loss(o, y) for o, y in zip(want, ys)]
            torch.stack(ref_losses).mean().backward()
            if last:
                for k, (o, w) in enumerate(zip(outs, want)):
                    if tuple(o.shape) != tuple(w.shape) or not torch.allclose(_full(o), w.detach(), **TOL):
                        bad.append(f"{where}: microbatch {k}'s output differs")
                for k, (v, w) in enumerate(zip(losses, ref_losses)):
                    if not torch.allclose(_full(v), w.detach(), **TOL):
                        bad.append(f"{where}: microbatch {k}'s loss {_full(v).item()} != {w.item()}")
            bad += _compare_grads(where, mine, modules, ref)
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
            if step == 0:  # validation between the steps, on the microbatches in another order
                evals = sched.eval_microbatches([(put(x),) for x in xs[::-1]] if first else None)
                if last:
                    with torch.no_grad():
                        want = [_unsplit(ref, x) for x in xs[::-1]]
                    if not all(torch.allclose(_full(o), w, **TOL) for o, w in zip(evals, want)):
                        bad.append(f"{where}: eval_microbatches' outputs differ")
        bad += _compare_params(f"{case} {name} given={given} rank {rank}", mine, modules, ref)
        dist.barrier()
    return bad


@pytest.mark.timeout(300)
def test_step_microbatches_with_dtensors_of_different_sequence_lengths_matches_the_unsplit_model():
    no_complaints(_microbatches_of_lengths, 4, [("1f1b", "sequence", ""), ("zb_h1", "replicate", "replicate"),
                                                ("interleaved_1f1b", "sequence", "shard1")], timeout=280)


# -- 3. clip_grad_norm_ over PP x TP -----------------------------------------------------------------------
def _clip(rank: int, world: int, cases: list[tuple[str, str]]) -> list[str]:
    import pipeline_ext as pe

    mesh = _mesh()
    bad: list[str] = []
    for name, case in cases:
        mine, modules, ref, sched, opt, ref_opt = _pipeline(mesh, name, case)
        for step in range(2):
            where = f"{case} {name} rank {rank} step {step}"
            x, y = _batch(step)
            sched.step(*((x,) if sched.has_first_stage else ()), target=y if sched.has_last_stage else None)
            _loss(_unsplit(ref, x), y).backward()
            ref_grads = [p.grad for m in ref for p in m.parameters()]
            for order in (1.0, float("inf")):  # a sum and a max over the TP shards and the stages
                got = _full(pe.training.total_grad_norm(sched, order))
                want = torch.nn.utils.get_total_norm(ref_grads, order)
                if not torch.allclose(got, want, **TOL):
                    bad.append(f"{where}: total norm of order {order} {got.item()} != the unsplit model's "
                               f"{want.item()}")
            total = pe.clip_grad_norm_(sched, CLIP)
            ref_total = torch.nn.utils.clip_grad_norm_([p for m in ref for p in m.parameters()], CLIP)
            if not torch.allclose(_full(total), ref_total, **TOL):
                bad.append(f"{where}: clip total {_full(total).item()} != the unsplit model's {ref_total.item()}")
            bad += _compare_grads(f"{where} (clipped)", mine, modules, ref)
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
            bad += _compare_params(where, mine, modules, ref)
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

    mesh = _mesh()
    bad: list[str] = []
    full_saved: dict[str, dict] = {}
    for name, case in cases:
        where = f"{case} {name} rank {rank}"
        ckpt = os.path.join(path, f"{name}-{case}")

        def train(sched, opt, steps) -> None:
            for step in steps:
                x, y = _batch(step)
                sched.step(*((x,) if sched.has_first_stage else ()), target=y if sched.has_last_stage else None)
                opt.step()
                opt.zero_grad()

        mine, modules, ref, sched, _, _ = _pipeline(mesh, name, case, seed=0)
        opt = torch.optim.AdamW([p for s in mine for p in modules[s].parameters()], lr=0.05)
        fqn_maps = {s: f"{s}." for s in mine}  # the unsplit model is nn.Sequential(*stages)
        train(sched, opt, range(2))
        saved = {s: {k: _full(v).clone() for k, v in modules[s].state_dict().items()} for s in mine}
        pe.save_checkpoint(ckpt, sched, opt, fqn_maps=fqn_maps)
        full_saved[ckpt] = {f"{s}.{k}": v.numpy() for s in mine for k, v in saved[s].items()}
        train(sched, opt, range(2, 4))
        _, fresh, _, sched2, _, _ = _pipeline(mesh, name, case, seed=1)
        opt2 = torch.optim.AdamW([p for s in mine for p in fresh[s].parameters()], lr=0.05)
        pe.load_checkpoint(ckpt, sched2, opt2, fqn_maps=fqn_maps)
        for s in mine:
            for k, v in saved[s].items():
                got = fresh[s].state_dict()[k]
                if not torch.equal(_full(got), v) or type(got) is not type(modules[s].state_dict()[k]):
                    bad.append(f"{where}: stage {s} {k} was not loaded as saved")
        train(sched2, opt2, range(2, 4))
        for s in mine:
            for (k, p), q in zip(modules[s].named_parameters(), fresh[s].parameters()):
                if not torch.equal(_full(p), _full(q)):
                    bad.append(f"{where}: stage {s} {k} after resuming differs from not stopping "
                               f"(max err {(_full(p) - _full(q)).abs().max():.3g})")
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
