"""Gradient sync of data-parallel wrapped stages (DDP, FSDP2) under a pipeline schedule.

Why this exists: DDP and FSDP2 reduce gradients from autograd hooks, once per
``backward()``. A pipeline step runs one backward per microbatch, interleaved
with other microbatches' forwards, and the zero-bubble schedules split each
backward into an input half (I, ``autograd.grad``: no ``.grad`` is written, no
DDP hook fires) and a weight half (W, several engine calls, outside any hook
DDP prepared). Left alone, DDP reduces partial gradients per microbatch and
mixes them (silently wrong) and FSDP2 frees unsharded parameters between I and
W. The fix is the gradient-accumulation recipe each wrapper documents, applied
per stage: accumulate locally through the whole step, then reduce exactly once,
after the last backward action (B or W) that touches the stage's parameters.

- DDP: every forward runs with ``require_backward_grad_sync`` off (what
  ``no_sync()`` does), so no hook does anything and gradients accumulate in
  ``.grad``. After the last B/W, DDP's own reducer is armed
  (``reducer.prepare_for_backward``) and a zero gradient is backpropagated into
  every parameter: each parameter's hook fires once, and the reducer buckets,
  averages over DDP's process group (or runs the registered comm hook) and
  writes back ``.grad``, as after any synced backward. Adding zero is exact.
- FSDP2: for the step ``set_requires_gradient_sync(False)``,
  ``set_reshard_after_backward(False)`` and ``set_is_last_backward(False)``;
  parameters are unsharded before every backward action (a W may follow a
  forward that resharded them); after the last B/W the user's settings come
  back and each parameter group's ``post_backward`` runs once, followed by the
  root's final callback, so the reduce-scatter happens once (what
  ``torch.distributed.pipelining`` does in ``perform_reduce_grad``).

A wrapper this module cannot make exact is refused when the stage is built
(:func:`gradient_sync_for`), with an error naming it. A step run while the user
has turned syncing off (inside ``ddp.no_sync()``, or after
``set_requires_gradient_sync(False)``) accumulates only, as it would without a
pipeline.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipeline_ext.runtime.stage import GradientSync

__all__ = ["GradientSync", "DDPSync", "FSDPSync", "UnsupportedWrapperError", "gradient_sync_for"]


class UnsupportedWrapperError(TypeError):
    """A stage is wrapped in something whose gradient sync a pipeline step cannot make exact."""


class DDPSync(GradientSync):
    """Accumulate under ``require_backward_grad_sync=False``; reduce once with DDP's reducer."""

    name = "DistributedDataParallel"

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.modules = list(modules)
        self._user_sync: list[bool] = []

    def begin(self, planned: bool = False) -> None:
        self._user_sync = [m.require_backward_grad_sync for m in self.modules]
        for m in self.modules:
            m.require_backward_grad_sync = False

    def finish(self, replace: Optional[Callable[[], None]] = None) -> None:
        try:
            for m, sync in zip(self.modules, self._user_sync):
                if sync:
                    _ddp_reduce(m)
        finally:
            self.abort()

    def abort(self) -> None:
        for m, sync in zip(self.modules, self._user_sync):
            m.require_backward_grad_sync = sync
        self._user_sync = []


def _ddp_reduce(ddp: nn.Module) -> None:
    """Fire each DDP-managed parameter's reducer hook once, with a zero gradient added.

    The reducer reads ``.grad`` when a hook fires, so it sees the whole step's
    accumulated gradient; with ``find_unused_parameters`` a parameter that got
    no gradient on this rank is left out, so the reducer's used-map handles it
    as DDP would (globally unused: ``.grad`` stays None).
    """
    params = [
        p for n, p in ddp.module.named_parameters()
        if p.requires_grad and n not in ddp.parameters_to_ignore
        and (p.grad is not None or not ddp.find_unused_parameters)
    ]
    roots = [p.view_as(p) for p in params]
    ddp.reducer.prepare_for_backward(roots)
    # the reducer's final callback (bucket waits, copy back into .grad) runs at the end of this call
    torch.autograd.backward(roots, [p.new_zeros(()).expand_as(p) for p in params])
    ddp.require_forward_param_sync = True  # next forward broadcasts buffers, as after any synced backward


class FSDPSync(GradientSync):
    """FSDP2: accumulate unsharded gradients through the step, reduce-scatter once after the stage's last backward.

    Unplanned (no parameter budget), FSDP's own hooks gather the parameters
    before each forward and backward, as the user configured them
    (``reshard_after_forward``); ``before_backward`` gathers again before a W,
    which no hook precedes. Planned ([Note: parameters placed by the
    schedule] in runtime/stage.py), the schedule's UNSHARD / RESHARD /
    REDUCE_GRAD actions decide, and FSDP's post-forward reshard is off for
    the step (each group's ``post_forward_mesh_info``, what
    ``set_reshard_after_forward`` rewrites, is put back at the step's end).
    """

    name = "fully_shard"
    shards = True

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.modules = list(modules)  # every FSDP2 module in the stage, outermost first
        self.tops = [m for m in self.modules if not any(m is not o and _contains(o, m) for o in self.modules)]
        self._saved: Optional[list[tuple[object, bool, bool, bool, object]]] = None
        self._saved_last: list[tuple[object, bool]] = []
        self.planned = False
        self._gathering: list[object] = []  # the UNSHARD's handles, waited by ``ready`` or ``reshard``
        self._finalize: list[nn.Module] = []  # roots whose reduce-scatters REDUCE_GRAD issued, waited at the step's end

    def _groups(self) -> Iterator[object]:
        for m in self.modules:
            yield from m._get_fsdp_state()._fsdp_param_groups

    def reshards_after_forward(self) -> bool:
        """Whether any of the stage's groups frees its parameters after each forward (FSDP's default)."""
        return any(g.post_forward_mesh_info is not None for g in self._groups())

    def param_bytes(self) -> int:
        total = 0
        for g in self._groups():
            for fp in g.fsdp_params:  # the gathered size, in the dtype it is gathered in (mixed precision's, if set)
                dtype = getattr(fp, "param_dtype", None) or fp.sharded_param.dtype
                total += fp._orig_size.numel() * torch.empty((), dtype=dtype).element_size()
        return total

    def begin(self, planned: bool = False) -> None:
        self.planned = planned
        self._saved = [(g, g.reduce_grads, g.all_reduce_grads, g.reshard_after_backward, g.post_forward_mesh_info)
                       for g in self._groups()]
        self._saved_last = [(ctx, ctx.is_last_backward) for ctx in self._contexts()]
        for top in self.tops:
            top.set_requires_gradient_sync(False)
            top.set_reshard_after_backward(False)
            top.set_is_last_backward(False)
        if planned:
            for g in self._groups():
                g.post_forward_mesh_info = None

    def before_backward(self) -> None:
        if self.planned:
            return  # the plan's UNSHARD came first; ``ready`` waited for it
        for m in self.modules:
            m.unshard()  # no-op when unsharded; after a resharding forward, gathers the same values again

    def unshard(self) -> None:
        if self._gathering:
            return
        self._gathering = [h for h in (m.unshard(async_op=True) for m in self.modules) if h is not None]

    def _wait(self) -> None:
        handles, self._gathering = self._gathering, []
        for h in handles:
            h.wait()

    def ready(self, what: str) -> None:
        self._wait()
        sharded = [g for g in self._groups() if not g.is_unsharded]
        if sharded:
            raise RuntimeError(
                f"{what}: {len(sharded)} of the stage's fully_shard parameter groups are sharded; the schedule's "
                "plan must UNSHARD a stage before any F, B, I or W of it (FSDP would gather it here unplanned)")

    def reshard(self) -> None:
        self._wait()
        for m in self.modules:
            m.reshard()

    def finish(self, replace: Optional[Callable[[], None]] = None) -> None:
        if self._saved is None:
            return
        self._wait()
        planned = self.planned
        self._restore()
        if replace is not None:
            replace()
            return
        for top in self.tops:
            state = top._get_fsdp_state()
            for st in state._state_ctx.all_states:
                for group in st._fsdp_param_groups:
                    group.post_backward()
        if planned:  # REDUCE_GRAD: the reduce-scatters run (on CUDA, on FSDP's stream) while the step goes on
            self._finalize.extend(self.tops)
        else:
            for top in self.tops:
                top._get_fsdp_state()._root_post_backward_final_callback()

    def end_step(self) -> None:
        """The step's end: wait for the reduce-scatters REDUCE_GRAD issued and finalize the sharded gradients;
        after a planned eval (no gradients, no REDUCE_GRAD) put the user's settings back."""
        if self._saved is not None and not self._finalize:
            self._wait()
            self._restore()
        tops, self._finalize = self._finalize, []
        for top in tops:
            top._get_fsdp_state()._root_post_backward_final_callback()

    def abort(self) -> None:
        if self._saved is None and not self._finalize:
            return
        self._wait()
        self._restore()
        self._finalize = []
        for top in self.tops:
            state = top._get_fsdp_state()
            if getattr(state, "_is_root", False) and hasattr(top, "reset_iter_state"):
                with contextlib.suppress(Exception):
                    top.reset_iter_state()

    def _contexts(self) -> list[object]:
        seen: dict[int, object] = {}
        for top in self.tops:
            ctx = top._get_fsdp_state()._state_ctx
            seen.setdefault(id(ctx), ctx)
        return list(seen.values())

    def _restore(self) -> None:
        for g, reduce, all_reduce, reshard, post_forward in self._saved or []:
            g.reduce_grads, g.all_reduce_grads, g.reshard_after_backward = reduce, all_reduce, reshard
            g.post_forward_mesh_info = post_forward
        for ctx, last in self._saved_last:
            ctx.is_last_backward = last
        # lazy init on the first forward may have put the states under a new shared context
        if self._saved_last:
            for ctx in self._contexts():
                ctx.is_last_backward = self._saved_last[0][1]
        self._saved, self._saved_last, self.planned = None, [], False


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


# -- what is accepted, and why the rest is refused ---------------------------------------------
def _ddp_problem(ddp: nn.Module) -> Optional[str]:
    """Why this DDP configuration cannot be made exact under a pipeline (None if it can)."""
    if getattr(ddp, "static_graph", False):
        return ("static_graph=True: DDP's first-iteration delayed all-reduce runs at the first microbatch's "
                "backward, before the other microbatches' gradients exist; construct DDP without static_graph")
    if getattr(ddp, "_use_python_reducer", False):
        return "the Python reducer (compiled autograd) is used; its hooks reduce on every backward"
    if getattr(ddp, "_delay_all_reduce_params", None):
        return "delay_all_reduce_named_params is set; those parameters are reduced from a per-backward hook"
    if getattr(ddp, "mixed_precision", None) is not None:
        return "DDP's mixed_precision is set; use torch.autocast inside the stage instead"
    if any(hasattr(p, "_in_backward_optimizers") for p in ddp.module.parameters()):
        return "an optimizer runs in backward (apply_optim_in_backward); it would step once per microbatch"
    for name, m in ddp.module.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
            return f"{name or 'the module'} produces sparse gradients"
    return None


def _group_ranks(group: Optional[dist.ProcessGroup]) -> set[int]:
    return set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _check_disjoint(what: str, dp_ranks: set[int], pp_ranks: set[int]) -> None:
    shared = sorted(dp_ranks & pp_ranks - {dist.get_rank()})
    if shared:
        raise UnsupportedWrapperError(
            f"the stage's {what} reduces gradients over ranks {sorted(dp_ranks)}, which include ranks {shared} "
            f"of the pipeline group {sorted(pp_ranks)} (other stages, not replicas of this one): give it the "
            "data-parallel group, e.g. mesh['dp'] of pipeline_ext.pipeline_mesh(pp, dp)"
        )


def gradient_sync_for(module: nn.Module, pp_group: Optional[dist.ProcessGroup] = None) -> Optional[GradientSync]:
    """The gradient sync a stage module needs: None (plain), DDP or FSDP2; raise for anything else.

    Raises :class:`UnsupportedWrapperError` naming the wrapper for torch's
    ``FullyShardedDataParallel`` (FSDP1), ``DataParallel``, the DDP-based
    ``replicate``, DDP options that reduce from per-backward hooks, DDP and
    FSDP2 mixed in one stage, a data-parallel group that overlaps the
    pipeline group, and parameters with post-accumulate-grad hooks outside
    FSDP2 (they would fire once per microbatch).
    """
    from torch.nn.parallel import DistributedDataParallel

    # [Note: wrappers are looked for only where they can exist] An FSDP module exists only in a program that imported
    # torch.distributed.fsdp (fully_shard and FSDP1 both live there), so a program that did not is not made to import
    # it (with DTensor, about 1.5 s of every rank's start-up on a small machine) only to learn that nothing is one.
    fsdp = sys.modules.get("torch.distributed.fsdp")
    FSDPModule, FullyShardedDataParallel = (fsdp.FSDPModule, fsdp.FullyShardedDataParallel) if fsdp else (_Never, _Never)
    ddps, fsdps = [], []
    pp_ranks = _group_ranks(pp_group) if dist.is_initialized() else set()
    for name, m in module.named_modules():
        where = f"submodule {name!r}" if name else "the stage module"
        if isinstance(m, FullyShardedDataParallel):
            raise UnsupportedWrapperError(
                f"{where} is wrapped in torch.distributed.fsdp.FullyShardedDataParallel (FSDP1), whose per-backward "
                "hooks cannot be deferred to the end of a pipeline step; use FSDP2 "
                "(torch.distributed.fsdp.fully_shard) or DistributedDataParallel"
            )
        if isinstance(m, nn.DataParallel):
            raise UnsupportedWrapperError(
                f"{where} is wrapped in torch.nn.DataParallel (one process, several devices); a pipeline stage runs "
                "on one device: use DistributedDataParallel or fully_shard over a data-parallel process group"
            )
        if _is_ddp_replicate(m):
            raise UnsupportedWrapperError(
                f"{where} uses torch.distributed._composable.replicate (DDP-based), which syncs on every backward; "
                "wrap the stage in DistributedDataParallel or fully_shard instead"
            )
        if isinstance(m, DistributedDataParallel):
            problem = _ddp_problem(m)
            if problem is not None:
                raise UnsupportedWrapperError(f"{where} is DistributedDataParallel with {problem}")
            if pp_ranks:
                _check_disjoint("DistributedDataParallel", _group_ranks(m.process_group), pp_ranks)
            ddps.append(m)
        elif isinstance(m, FSDPModule):
            if pp_ranks:
                for g in m._get_fsdp_state()._fsdp_param_groups:
                    _check_disjoint("fully_shard (FSDP2)", set(g.mesh_info.mesh.mesh.flatten().tolist()), pp_ranks)
            fsdps.append(m)
    if ddps and fsdps:
        raise UnsupportedWrapperError("the stage mixes DistributedDataParallel and fully_shard (FSDP2); use one")
    sharded = {id(p) for m in fsdps for p in m.parameters()}
    for name, p in module.named_parameters():
        if id(p) not in sharded and getattr(p, "_post_accumulate_grad_hooks", None):
            raise UnsupportedWrapperError(
                f"parameter {name!r} has a post-accumulate-grad hook; under a pipeline step it would fire once per "
                "microbatch on a partial gradient, never once per step. Sync gradients with "
                "DistributedDataParallel or fully_shard, or after step() returns"
            )
    if ddps:
        return DDPSync(ddps)
    if fsdps:
        return FSDPSync(fsdps)
    return None


class _Never:
    """A class no object is an instance of: a wrapper class of a module the program never imported."""


def _is_ddp_replicate(m: nn.Module) -> bool:
    """Whether ``replicate(m)`` (the DDP-based composable API, not FSDP2's replicate) was applied."""
    if "torch.distributed._composable.replicate" not in sys.modules:  # see [Note: wrappers are looked for only ...]
        return False
    try:
        from torch.distributed._composable.replicate import _ReplicateState
        from torch.distributed._composable_state import _get_module_state
    except ImportError:  # pragma: no cover - a torch without them
        return False
    return isinstance(_get_module_state(m), _ReplicateState)
