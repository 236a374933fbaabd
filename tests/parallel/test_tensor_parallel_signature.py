"""A DTensor input's placements and mesh are part of the step's signature, not its global shape alone.

Layouts are cached per microbatch signature ([Note: known and discovery
steps] in ``comm/comm_plan.py``). A DTensor travels between stages as its
local shard ([Note: DTensors between stages]), whose shape follows from the
global shape *and* the placements and mesh. Keyed by global shape and dtype
alone, a step whose input had the same global shape as an earlier one but
another placement (``Shard(1)``, then ``Replicate``) ran as a known step
under the earlier step's layouts: the sender's local shard did not match
them and the step failed (``a known step must exchange the same messages as
the discovery step``, blaming data-dependent shapes). Nothing was misread
(a sender checks its layout before sending, and the placements travel with
every message), but a correct training loop stopped. Now a new placement or
mesh is a new signature, and its layouts are exchanged.

4 Gloo ranks, mesh (pp=2, tp=2); each stage is elementwise over replicated
DTensor parameters, so what it sends has its input's placement. Every step's
loss and full gradients are compared with the unsplit model's.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mp_utils import no_complaints
from tp_case import (D, batch, grad_mismatches, loss_mismatch, placement, pp_tp_mesh, replicas_mean, schedule, sgd_pair,
                     stages_on_rank, unsplit_loss)

#: each step's placement of the input and target (the same global shape every step)
PLACEMENTS = ["shard1", "replicate", "shard1", "shard0", "replicate"]


class Scale(nn.Module):
    """``tanh(x * w + b)``: elementwise, so its output keeps its input's placement."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(1 + 0.1 * torch.randn(D))
        self.b = nn.Parameter(0.1 * torch.randn(D))

    def forward(self, x):
        return torch.tanh(x * self.w + self.b)


def _placements_change(rank: int, world: int, name: str) -> list[str]:
    from torch.distributed.tensor import distribute_module, distribute_tensor

    mesh = pp_tp_mesh(world)
    tp, pp = mesh["tp"], mesh["pp"]
    ns, mine = stages_on_rank(name, pp)
    torch.manual_seed(0)
    ref = [Scale() for _ in range(ns)]
    torch.manual_seed(0)
    modules = {s: m for s, m in enumerate(Scale() for _ in range(ns)) if s in mine}
    for s in mine:
        distribute_module(modules[s], tp)  # every parameter a Replicate DTensor
    _, sched = schedule(name, modules, mine, ns, pp, timeout=60.0)
    opt, ref_opt = sgd_pair(mine, modules, ref)
    bad: list[str] = []
    for step, given in enumerate(PLACEMENTS):
        x, y = batch(step)
        xs, ys = (distribute_tensor(t, tp, [placement(given)]) for t in (x, y))
        where = f"{name} rank {rank} step {step} ({given})"
        losses: list = []
        try:
            sched.step(*((xs,) if 0 in mine else ()), target=ys if ns - 1 in mine else None, losses=losses)
        except Exception as exc:  # noqa: BLE001 - what the user reads is the test's subject
            bad.append(f"{where}: {type(exc).__name__}: {str(exc)[:400]}")
            break
        ref_opt.zero_grad()
        _, ref_loss = unsplit_loss(ref, x, y)
        if ns - 1 in mine:
            bad += loss_mismatch(where, replicas_mean(losses), ref_loss)
        bad += grad_mismatches(where, mine, modules, ref)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
    dist.barrier()
    return bad


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["1f1b", "zb_h1"])
def test_a_dtensor_input_of_the_same_global_shape_but_other_placements_exchanges_its_layouts_anew(name):
    no_complaints(_placements_change, 4, name, timeout=500)
