"""The pipeline x tensor parallel case the tests under tests/parallel/ share (a helper module, not a test file).

4 Gloo CPU ranks, mesh (pp=2, tp=2); each stage two MLP blocks (``Stage``)
made tensor-parallel with ``parallelize_module`` (w1 colwise, w2 rowwise), as
a torchtitan user writes it; every check is against the unsplit model, the
same stages run in order on the whole batch in one process. Here once: the
sizes and the model, the loss, the placements by name, the mesh, which stages
sit on this rank, the pipeline and its optimizer beside the unsplit model's,
and the comparisons (loss, every full gradient, every parameter after a step)
as lists of complaints naming where (stage, parameter, step, rank) and by how
much. The rank functions stay in the test files: the rank pool's workers
import them by their module's name. This file's name is unique under tests/
(test modules are imported by file name, and conftest refuses a name used twice).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from models import TOL, run_stages
from mp_utils import forget_dtensor_caches

#: model width, MLP hidden width, sequence length, rows per step, microbatches per step, SGD steps per case
D, H, SEQ, ROWS, M, STEPS = 8, 16, 4, 8, 4, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())

    def forward(self, x):
        return self.blocks(x)


def mse(out, y):
    """The mean squared error, written out: ``mse_loss(reduction="mean")`` of two ``Shard(0)`` DTensors has twice
    the gradient in torch 2.13 (its own ``loss.backward()``, no pipeline); this is exact on plain tensors and
    DTensors alike."""
    return ((out - y) ** 2).mean()


def placement(name: str):
    """A DTensor placement by the name the tests' parameters use."""
    from torch.distributed.tensor import Replicate, Shard

    return {"replicate": Replicate(), "shard0": Shard(0), "shard1": Shard(1)}[name]


def parallelize(stage: nn.Module, index: int, num_stages: int, case: str, tp, last_out: str = "") -> nn.Module:
    """w1 colwise, w2 rowwise; between stages: ``case`` ("local": plain tensors, "replicate": Replicate DTensors,
    "sequence": sequence-parallel ``Shard(1)`` DTensors; the last block of the last stage returns a plain tensor,
    or with ``last_out`` a DTensor of that placement)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for b in range(2):
        first, last = index == 0 and b == 0, index == num_stages - 1 and b == 1
        if case == "local" or last:
            plan[f"blocks.{b}.w1"], plan[f"blocks.{b}.w2"] = ColwiseParallel(), RowwiseParallel()
        elif case == "replicate":
            plan[f"blocks.{b}.w1"] = ColwiseParallel()
            plan[f"blocks.{b}.w2"] = RowwiseParallel(use_local_output=False)
        else:  # sequence parallel: activations sharded on the sequence dim between the blocks and the stages
            plan[f"blocks.{b}.w1"] = ColwiseParallel(input_layouts=Replicate() if first else Shard(1))
            plan[f"blocks.{b}.w2"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
        if last and case == "sequence":
            plan[f"blocks.{b}.w1"] = ColwiseParallel(input_layouts=Shard(1))
    if last_out and index == num_stages - 1:
        plan["blocks.1.w2"] = RowwiseParallel(output_layouts=placement(last_out), use_local_output=False)
    return parallelize_module(stage, tp, plan)


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (what the unsplit model holds), a plain tensor as it is; detached."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def pp_tp_mesh(world: int = 4, dp: int = 0, device: str = "cpu"):
    """The (pp=2, tp) mesh of ``world`` ranks, or with ``dp`` (pp=2, dp_shard=dp, tp) for FSDP. DTensor's caches
    are forgotten first: a pool worker runs many tests, and a new mesh equals an old one by value, so a cache keyed
    by it would hand back the old mesh with its destroyed groups (``mp_utils.forget_dtensor_caches``)."""
    from torch.distributed.device_mesh import init_device_mesh

    forget_dtensor_caches()
    if dp:
        return init_device_mesh(device, (2, dp, world // (2 * dp)), mesh_dim_names=("pp", "dp_shard", "tp"))
    return init_device_mesh(device, (2, world // 2), mesh_dim_names=("pp", "tp"))


def stages_on_rank(name: str, pp) -> tuple[int, list[int]]:
    """(the number of stages, the stages on this rank) of schedule ``name`` over the two pp ranks of ``pp``."""
    from pipeline_ext import schedules as S

    plan = S.build(name, 2, M)
    return plan.num_stages, [s for s, r in enumerate(plan.stage_to_rank) if r == pp.get_local_rank()]


def rank_copies(ref: list[nn.Module], mine: list[int], make) -> dict[int, nn.Module]:
    """{stage: ``make(stage)`` with the weights of the unsplit model's ``ref[stage]``} for this rank's stages."""
    modules = {}
    for s in mine:
        modules[s] = make(s)
        modules[s].load_state_dict(ref[s].state_dict())
    return modules


def schedule(name: str, modules: dict, mine: list[int], ns: int, pp, device="cpu", timeout: float = 120.0,
             sched_kw: Optional[dict] = None, **stage_kw):
    """(this rank's ``PipelineStage``s over ``modules``, schedule ``name`` of ``M`` microbatches over them, ``mse``
    its loss); ``stage_kw``: ``mesh=`` or ``get_mesh=`` for the receiving stage; ``sched_kw``: the schedule's
    own (``max_active_stages=``)."""
    import pipeline_ext as pe

    stages = [pe.PipelineStage(modules[s], s, ns, device, group=pp, **stage_kw) for s in mine]
    return stages, pe.get_schedule_class(name)(stages if len(stages) > 1 else stages[0], M, loss_fn=mse,
                                               timeout=timeout, **(sched_kw or {}))


def sgd_pair(mine: list[int], modules: dict, ref: list[nn.Module], lr: float = 0.1):
    """SGD over this rank's stages and SGD over the unsplit model (each parameter once: a tied one too)."""
    return (torch.optim.SGD([p for s in mine for p in modules[s].parameters()], lr=lr),
            torch.optim.SGD(nn.ModuleList(ref).parameters(), lr=lr))


def batch(step: int, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's inputs and targets (``ROWS`` rows), seeded by ``step``: the same numbers on every rank."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(ROWS, seq, D, generator=g), torch.randn(ROWS, seq, D, generator=g)


def unsplit_loss(ref: list[nn.Module], x: torch.Tensor, y: torch.Tensor, backward: bool = True):
    """(output, loss) of the unsplit model (``ref``'s stages in order) on the whole batch; its gradients with
    ``backward``."""
    out = run_stages(ref, x)
    ref_loss = mse(out, y)
    if backward:
        ref_loss.backward()
    return out, ref_loss


def replicas_mean(losses: list, mesh=None, dp: int = 1) -> torch.Tensor:
    """The step's mean loss over its microbatches, and over the ``dp`` FSDP replicas (``mesh["dp_shard"]``):
    with equal rows per replica, the whole batch's mean is the replicas' mean."""
    got = torch.stack([full(v) for v in losses]).mean()
    if dp > 1:
        dist.all_reduce(got, group=mesh["dp_shard"].get_group())
        got /= dp
    return got


def loss_mismatch(where: str, got: torch.Tensor, want: torch.Tensor, tol=TOL, what: str = "loss") -> list[str]:
    """[] when the pipeline's loss ``got`` is the unsplit model's ``want``, else the complaint naming both."""
    if torch.allclose(got, want.detach(), **tol):
        return []
    return [f"{where}: {what} {got.item()} != {want.item()}"]


def grad_mismatches(where: str, mine: list[int], modules: dict, ref: list[nn.Module], tol=TOL,
                    ratio: bool = False) -> list[str]:
    """Every parameter's full gradient on this rank's stages against the unsplit model's, paired by name (a tied
    weight of the unsplit model is one parameter of two stages); a missing one counts. ``ratio``: the complaint
    shows the first few ratios too (a wrong factor, such as mse_loss's doubled one, shows as a constant)."""
    bad = []
    for s in mine:
        for pn, p in modules[s].named_parameters():
            q = ref[s].get_parameter(pn)
            if p.grad is not None and torch.allclose(full(p.grad), q.grad, **tol):
                continue
            err = "none" if p.grad is None else f"{(full(p.grad) - q.grad).abs().max():.3g}"
            bad.append(f"{where}: stage {s} {pn} grad differs (max err {err})"
                       + (f" ratio {(full(p.grad) / q.grad).flatten()[:3].tolist()}"
                          if ratio and p.grad is not None else ""))
    return bad


def param_mismatches(where: str, mine: list[int], modules: dict, ref: list[nn.Module], tol=TOL) -> list[str]:
    """Every parameter on this rank's stages against the unsplit model's after the optimizers' step, paired by
    name."""
    bad = []
    for s in mine:
        for pn, p in modules[s].named_parameters():
            q = ref[s].get_parameter(pn).detach()
            if not torch.allclose(full(p), q, **tol):
                bad.append(f"{where}: stage {s} {pn} differs after the step (max err {(full(p) - q).abs().max():.3g})")
    return bad


def split_fallbacks(where: str, stages: list) -> list[str]:
    """The zero-bubble schedules' I/W split held on every stage that split: W ran over the (DTensor) parameters,
    I did not silently run the whole backward."""
    return [f"{where}: stage {st.stage_index}'s I ran the whole backward: {st._runner.split_fallback}"
            for st in stages if st._runner.split_seen and st._runner.split_fallback is not None]


def first_step_error(stage) -> str:
    """What one 1F1B step over ``stage`` (of two) raises on this rank, as "TypeName: message", or "no error": a
    refusal's test checks the message every rank gets."""
    import pipeline_ext as pe

    sched = pe.Schedule1F1B(stage, M, loss_fn=mse, timeout=60.0)
    x, y = torch.randn(ROWS, SEQ, D), torch.randn(ROWS, SEQ, D)
    try:
        sched.step(x) if sched.has_first_stage else sched.step(target=y)
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return f"{type(exc).__name__}: {exc}"
    return "no error"
