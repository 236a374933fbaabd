"""Global-norm gradient clipping over a whole pipeline.

Why this exists: ``torch.nn.utils.clip_grad_norm_`` sees only the parameters
it is given, i.e. one rank's stages, so on a pipeline each rank clips by its
own partial norm (measured: 0.84 reported where the model's norm is 1.02) and
the ranks scale their gradients differently: the update is no longer the
unsplit model's. Here every rank computes the norm of its local gradients with
torch's own ``get_total_norm``, the pieces are combined over the pipeline
group, and torch's ``clip_grads_with_norm_`` scales by the global total.

What is counted once:
- parameters tied across stages (``tie_parameters``): after the step their
  copies hold the same summed gradient, and the unsplit model has one tensor;
  only the first stage's copy counts (the others are still scaled);
- one Parameter used by two local stages: counted once (deduplicated);
- data-parallel replicas (DDP, or a manual all-reduce): every replica holds
  the same gradients, so nothing is reduced over the DP axis;
- DTensor gradients (FSDP2 shards, tensor-parallel shards, replicas over a
  TP mesh): torch's norm of a DTensor knows its placements (a shard's norm is
  a partial over its mesh, a Replicate one is counted once), and
  ``full_tensor()`` completes it over that mesh (the same recipe torchtitan
  uses); only then is it combined over the pipeline group.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from pipeline_ext.pipelining.schedules import PipelineSchedule
from pipeline_ext.pipelining.stage import PipelineStage

from pipeline_ext.training.stages import local_stages
from pipeline_ext.training.tied import TiedParameters, ties_of

__all__ = ["clip_grad_norm_", "total_grad_norm"]


def _parameters(obj: Any) -> tuple[list[torch.Tensor], Optional[dist.ProcessGroup], list[TiedParameters], bool]:
    """(distinct parameters, pipeline group, registered ties, whether a pipeline was given)."""
    if isinstance(obj, torch.Tensor):
        return [obj], None, [], False
    if not isinstance(obj, nn.Module):
        if not isinstance(obj, (PipelineSchedule, PipelineStage)) and not (
                isinstance(obj, (list, tuple)) and obj and isinstance(obj[0], PipelineStage)):
            return list(obj), None, [], False  # an iterable of parameters
    stages = local_stages(obj)
    seen: dict[int, torch.Tensor] = {}
    for _, module in sorted(stages.modules.items()):
        for p in module.parameters():
            seen.setdefault(id(p), p)
    is_pipeline = not isinstance(obj, nn.Module)
    return list(seen.values()), stages.group if is_pipeline else None, ties_of(stages.schedule), is_pipeline


def total_grad_norm(obj: Union[Any, Iterable[torch.Tensor]], norm_type: float = 2.0,
                    group: Optional[dist.ProcessGroup] = None, ties: Iterable[TiedParameters] = (),
                    error_if_nonfinite: bool = False, foreach: Optional[bool] = None) -> torch.Tensor:
    """The global gradient norm (see ``clip_grad_norm_``), same value on every rank; nothing is scaled."""
    return _total(_parameters(obj), float(norm_type), group, ties, error_if_nonfinite, foreach)


def _total(found: tuple[list[torch.Tensor], Optional[dist.ProcessGroup], list[TiedParameters], bool],
           norm_type: float, group: Optional[dist.ProcessGroup], ties: Iterable[TiedParameters],
           error_if_nonfinite: bool, foreach: Optional[bool]) -> torch.Tensor:
    params, pp_group, registered, is_pipeline = found
    if group is None:
        group = pp_group
    distributed = dist.is_available() and dist.is_initialized()
    if not is_pipeline and group is None and distributed and dist.get_world_size() > 1:
        raise ValueError("clip_grad_norm_ was given parameters, not a schedule or stages: pass group= (the "
                         "pipeline group, e.g. mesh['pp'].get_group()); the world group would count "
                         "data-parallel replicas more than once")
    copies = set().union(*(t.copies() for t in [*registered, *ties]))
    grads = [p.grad for p in params if p.grad is not None and id(p) not in copies]
    device = grads[0].device if grads else (params[0].device if params else torch.device("cpu"))
    norms = []
    for gs in _by_kind(grads).values():
        n = torch.nn.utils.get_total_norm(gs, norm_type, error_if_nonfinite, foreach)
        norms.append(n.full_tensor() if hasattr(n, "full_tensor") else n)  # FSDP shards: complete over DP
    if norms:
        total = torch.linalg.vector_norm(torch.stack([n.float().to(device) for n in norms]), norm_type)
    else:
        total = torch.zeros((), device=device)
    if distributed and (group is not None or is_pipeline) and dist.get_world_size(group) > 1:
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        else:
            total = total ** norm_type
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
            total = total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the pipeline's gradients is non-finite")
    return total


def _by_kind(tensors: Iterable[torch.Tensor], of: Any = lambda t: t) -> dict[Any, list[torch.Tensor]]:
    """``tensors`` grouped by the kind of ``of(tensor)``: plain, or a DTensor of each mesh. torch's foreach
    kernels (its norms and its clipping) refuse a list that mixes them, as a stage with tensor-parallel blocks
    and a plain norm has."""
    kinds: dict[Any, list[torch.Tensor]] = {}
    for t in tensors:
        kinds.setdefault(getattr(of(t), "device_mesh", None), []).append(t)
    return kinds


def clip_grad_norm_(obj: Union[Any, Iterable[torch.Tensor]], max_norm: float, norm_type: float = 2.0,
                    group: Optional[dist.ProcessGroup] = None, ties: Iterable[TiedParameters] = (),
                    error_if_nonfinite: bool = False, foreach: Optional[bool] = None) -> torch.Tensor:
    """Clip the gradients of a whole pipeline by their global norm; return that norm (same on every rank).

    ``obj``: this rank's ``PipelineSchedule`` (its pipeline group and the ties
    registered by ``tie_parameters`` are used), its stage(s), or its
    parameters (then pass ``group=``, the pipeline group). Equals
    ``torch.nn.utils.clip_grad_norm_`` on the unsplit model: same total, same
    clipped gradients. A collective over the pipeline group (and, for FSDP2
    gradients, over their DP mesh): call it on every rank. Do not pass the
    world group under data parallelism: replicas would be counted again.
    """
    found = _parameters(obj)
    total = _total(found, float(norm_type), group, list(ties), error_if_nonfinite, foreach)
    for params in _by_kind((p for p in found[0] if p.grad is not None), of=lambda p: p.grad).values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
    return total
