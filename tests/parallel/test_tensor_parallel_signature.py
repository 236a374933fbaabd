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
from mp_utils import forget_dtensor_caches as _fresh_dtensor_caches
from models import TOL

D, SEQ, ROWS, M = 8, 4, 8, 4
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


def _placement(name: str):
    from torch.distributed.tensor import Replicate, Shard

    return {"replicate": Replicate(), "shard0": Shard(0), "shard1": Shard(1)}[name]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def _loss(out, y):
    return ((out - y) ** 2).mean()


def _placements_change(rank: int, world: int, name: str) -> list[str]:
    import pipeline_ext as pe
    from pipeline_ext import schedules as S
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_module, distribute_tensor

    _fresh_dtensor_caches()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "tp"))
    tp, pp = mesh["tp"], mesh["pp"]
    plan = S.build(name, 2, M)
    ns = plan.num_stages
    mine = [s for s, r in enumerate(plan.stage_to_rank) if r == pp.get_local_rank()]
    torch.manual_seed(0)
    ref = [Scale() for _ in range(ns)]
    torch.manual_seed(0)
    modules = {s: m for s, m in enumerate(Scale() for _ in range(ns)) if s in mine}
    for s in mine:
        distribute_module(modules[s], tp)  # every parameter a Replicate DTensor
    stages = [pe.PipelineStage(modules[s], s, ns, "cpu", group=pp) for s in mine]
    sched = pe.get_schedule_class(name)(stages if len(stages) > 1 else stages[0], M, loss_fn=_loss, timeout=60.0)
    opt = torch.optim.SGD([p for s in mine for p in modules[s].parameters()], lr=0.1)
    ref_opt = torch.optim.SGD([p for m in ref for p in m.parameters()], lr=0.1)
    bad: list[str] = []
    for step, given in enumerate(PLACEMENTS):
        g = torch.Generator().manual_seed(step)
        x, y = (torch.randn(ROWS, SEQ, D, generator=g) for _ in range(2))
        xs, ys = (distribute_tensor(t, tp, [_placement(given)]) for t in (x, y))
        where = f"{name} rank {rank} step {step} ({given})"
        losses: list = []
        try:
            sched.step(*((xs,) if 0 in mine else ()), target=ys if ns - 1 in mine else None, losses=losses)
        except Exception as exc:  # noqa: BLE001 - what the user reads is the test's subject
            bad.append(f"{where}: {type(exc).__name__}: {str(exc)[:400]}")
            break
        ref_opt.zero_grad()
        out = x
        for m in ref:
            out = m(out)
        ref_loss = _loss(out, y)
        ref_loss.backward()
        if ns - 1 in mine:
            got = torch.stack([_full(v) for v in losses]).mean()
            if not torch.allclose(got, ref_loss.detach(), **TOL):
                bad.append(f"{where}: loss {got.item()} != {ref_loss.item()}")
        for s in mine:
            for (pn, p), q in zip(modules[s].named_parameters(), ref[s].parameters()):
                if p.grad is None or not torch.allclose(_full(p.grad), q.grad, **TOL):
                    bad.append(f"{where}: stage {s} {pn}.grad differs")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
    dist.barrier()
    return bad


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["1f1b", "zb_h1"])
def test_a_dtensor_input_of_the_same_global_shape_but_other_placements_exchanges_its_layouts_anew(name):
    no_complaints(_placements_change, 4, name, timeout=500)

