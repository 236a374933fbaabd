"""Zero-bubble I/W split over DTensor stages whose replicated norm's gradient goes through a TP all-reduce.

Red-team issue 54, item 1: mesh (pp=2, tp=2) on 4 Gloo ranks, each stage two
MLP blocks with a LayerNorm made a replicated DTensor module
(``distribute_module``), ``w1`` colwise and ``w2`` rowwise with
``use_local_output=False``: Replicate DTensor activations, the batch and the
target Replicate DTensors. The gradient reaching a norm from ``w1`` is a
``Partial`` DTensor (each tp rank holds its shard's share of the sum), so the
norm's backward redistributes it before it computes the weight gradients. 1F1B
was exact while ZB-H1 and ZBV gave the last stage's norm weight and bias
gradients 20-50 % off and different on the two tp ranks (a Replicate parameter
whose replicas disagree), silently: W re-entered the boundary nodes in a set's
order, which follows node addresses and so differs between processes, and the
two norms' all-reduces paired one block's gradient on one tp rank with the
other block's on the other ([Note: W's order is the same on every rank] in
pipeline_ext/runtime/split/graph.py). Everything is checked against the unsplit
model: the loss, every full gradient, the parameters after each of two SGD
steps, and that a replicated parameter's gradient is the same on every tp rank.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mp_utils import no_complaints
from models import TOL
from tp_case import (D, H, SEQ, STEPS, batch, grad_mismatches, loss_mismatch, param_mismatches, pp_tp_mesh,
                     rank_copies, replicas_mean, schedule, sgd_pair, split_fallbacks, stages_on_rank, unsplit_loss)


class NormBlock(nn.Module):
    """A pre-norm MLP block (``residual``: with its skip connection, as a transformer's)."""

    def __init__(self, residual: bool) -> None:
        super().__init__()
        self.residual = residual
        self.norm = nn.LayerNorm(D)
        self.w1, self.w2 = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        y = self.w2(torch.relu(self.w1(self.norm(x))))
        return x + y if self.residual else y


class NormStage(nn.Module):
    def __init__(self, residual: bool) -> None:
        super().__init__()
        self.blocks = nn.Sequential(NormBlock(residual), NormBlock(residual))

    def forward(self, x):
        return self.blocks(x)


def _parallelize(stage: NormStage, tp) -> NormStage:
    """The user's plan: each norm a replicated DTensor module, w1 colwise, w2 rowwise returning a Replicate
    DTensor (between the blocks and the stages, and the last stage's output)."""
    from torch.distributed.tensor import distribute_module
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in stage.blocks:
        distribute_module(block.norm, tp)
    plan = {}
    for b in range(2):
        plan[f"blocks.{b}.w1"] = ColwiseParallel()
        plan[f"blocks.{b}.w2"] = RowwiseParallel(use_local_output=False)
    return parallelize_module(stage, tp, plan)


def _replicated(p: torch.Tensor) -> bool:
    return hasattr(p, "placements") and all(pl.is_replicate() for pl in p.placements)


def _replicas_disagree(where: str, s: int, pn: str, grad: torch.Tensor, tp) -> list[str]:
    """A Replicate gradient must hold the same values on every tp rank (else ``full_tensor()`` is rank-dependent)."""
    local = grad.to_local().detach().contiguous()
    copies = [torch.empty_like(local) for _ in range(tp.size())]
    dist.all_gather(copies, local, group=tp.get_group())
    if all(torch.equal(c, copies[0]) for c in copies):
        return []
    spread = max((c - copies[0]).abs().max().item() for c in copies)
    return [f"{where}: stage {s} {pn}'s Replicate grad differs across the tp ranks (by up to {spread:.3g})"]


def _train(rank: int, world: int, residual: bool, names: list[str]) -> list[str]:
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = pp_tp_mesh()
    tp, pp = mesh["tp"], mesh["pp"]
    bad: list[str] = []
    for name in names:
        ns, mine = stages_on_rank(name, pp)
        torch.manual_seed(0)
        ref = [NormStage(residual) for _ in range(ns)]
        for m in ref:  # away from LayerNorm's ones and zeros, so a wrong weight gradient shows everywhere
            with torch.no_grad():
                for blk in m.blocks:
                    blk.norm.weight.uniform_(0.5, 1.5), blk.norm.bias.uniform_(-0.5, 0.5)
        modules = rank_copies(ref, mine, lambda s: NormStage(residual))
        modules = {s: _parallelize(m, tp) for s, m in modules.items()}
        stages, sched = schedule(name, modules, mine, ns, pp)
        opt, ref_opt = sgd_pair(mine, modules, ref)
        for step in range(STEPS):
            where = f"residual={residual} {name} rank {rank} step {step}"
            x, y = batch(step)
            xs, ys = (distribute_tensor(t, tp, [Replicate()]) for t in (x, y))
            losses: list = []
            sched.step(*((xs,) if 0 in mine else ()), target=ys if ns - 1 in mine else None, losses=losses)
            _, ref_loss = unsplit_loss(ref, x, y)
            if ns - 1 in mine:
                bad += loss_mismatch(where, replicas_mean(losses), ref_loss)
            for s in mine:  # a Replicate gradient the same on every tp rank (in the same order there: a collective)
                for pn, p in modules[s].named_parameters():
                    if p.grad is not None and _replicated(p):
                        bad += _replicas_disagree(where, s, pn, p.grad, tp)
            bad += grad_mismatches(where, mine, modules, ref)
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
            bad += param_mismatches(where, mine, modules, ref)
        # the split held (no silent fallback to the whole backward at I)
        bad += split_fallbacks(f"residual={residual} {name} rank {rank}", stages)
        dist.barrier()
    return bad


def test_w_reenters_the_boundary_nodes_in_the_order_a_backward_runs_them():
    """The order of W's engine calls (one per boundary node) is the same on every rank: it is the graph's own
    (sequence numbers, descending: B's order), not a set's iteration order, which follows node addresses and
    differs between processes ([Note: W's order is the same on every rank]). One process, plain tensors: the
    order is what matters, a node's collectives are only what makes it matter."""
    from pipeline_ext.runtime.split import backward_input, backward_weight

    torch.manual_seed(0)
    model = nn.Sequential(*[NormBlock(residual=True) for _ in range(4)])
    whole = copy.deepcopy(model)
    x, gy = torch.randn(2, SEQ, D), torch.randn(2, SEQ, D)
    xi = x.clone().requires_grad_(True)
    (gx,), deferred = backward_input([model(xi)], [gy], [xi])
    seq = [b.node._sequence_nr() for b in deferred.branches]
    assert len(seq) == 4 * 3 and seq == sorted(seq, reverse=True), seq
    backward_weight(deferred)
    xw = x.clone().requires_grad_(True)
    whole(xw).backward(gy)
    assert torch.allclose(gx, xw.grad, **TOL)
    for (n, p), q in zip(model.named_parameters(), whole.parameters()):
        assert torch.allclose(p.grad, q.grad, **TOL), n


@pytest.mark.timeout(600)
@pytest.mark.parametrize("residual", [False, True], ids=["mlp", "residual"])
def test_zero_bubble_with_replicated_dtensor_norms_matches_the_unsplit_model(residual):
    """1F1B (the control), ZB-H1 and ZBV (two stages per rank) on the same model."""
    no_complaints(_train, 4, residual, ["1f1b", "zb_h1", "zbv"], timeout=500)
