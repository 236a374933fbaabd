"""Deferred batch norm: running statistics per mini-batch, not per microbatch (torchgpipe's option).

A BatchNorm layer in a pipeline sees one microbatch at a time and would update
its running mean and variance once per microbatch, with statistics of a few
rows: after training, the running statistics differ from those of the unsplit
model trained on the same batches. ``Pipe(deferred_batch_norm=True)`` makes
each training call (``step()`` or ``pipe(x)``) update them once, from the
statistics of the whole batch, as the unsplit model would.

The user's BatchNorm modules are kept (not replaced, so state-dict keys,
parameter identity and the user's references all stay): a pre-hook records the
microbatch's per-channel sums (not during recomputation, which would count it
twice) and lets the layer update copies of the running buffers, a post-hook puts the real ones back, and
``DeferredStats.commit`` applies the batch's update once the call's forwards
are done. The hooks do nothing outside a call of the pipe that owns them.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from pipeline_ext.pipe.recompute import is_recomputing

__all__ = ["DeferredStats"]


class _Sums:
    """One layer's statistics over the microbatches of the current call."""

    def __init__(self) -> None:
        self.total = None  # per-channel sum
        self.squares = None  # per-channel sum of squares
        self.count = 0  # elements per channel
        self.lock = threading.Lock()  # a layer shared by two stages of one device


class DeferredStats:
    """The deferred-statistics hooks on every tracking BatchNorm of ``modules``."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.layers: list[_BatchNorm] = []
        seen: set[int] = set()
        for root in modules:
            for m in root.modules():
                if isinstance(m, _BatchNorm) and m.track_running_stats and id(m) not in seen:
                    seen.add(id(m))
                    self.layers.append(m)
        self.active = False
        self._sums: dict[int, _Sums] = {id(m): _Sums() for m in self.layers}
        self._saved = threading.local()
        me = weakref.ref(self)
        for m in self.layers:
            m.register_forward_pre_hook(lambda mod, args, me=me: _pre(me, mod, args))
            m.register_forward_hook(lambda mod, args, out, me=me: _post(me, mod))

    def begin(self, training: bool) -> None:
        self.active = training and bool(self.layers)

    def commit(self) -> None:
        """Update every layer's running statistics once, from the call's whole batch."""
        if not self.active:
            return
        self.active = False
        with torch.no_grad():
            for m in self.layers:
                s = self._sums[id(m)]
                if s.count == 0:
                    continue
                mean = s.total / s.count
                var = (s.squares / s.count - mean**2).clamp_min(0) * (s.count / max(s.count - 1, 1))
                m.num_batches_tracked.add_(1)
                factor = 1.0 / float(m.num_batches_tracked) if m.momentum is None else m.momentum
                m.running_mean.mul_(1 - factor).add_(mean.to(m.running_mean.dtype), alpha=factor)
                m.running_var.mul_(1 - factor).add_(var.to(m.running_var.dtype), alpha=factor)
                s.total = s.squares = None
                s.count = 0

    def discard(self) -> None:
        """Forget a failed call's statistics."""
        self.active = False
        for s in self._sums.values():
            s.total = s.squares = None
            s.count = 0


_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def _pre(ref: "weakref.ref[DeferredStats]", m: _BatchNorm, args: tuple[Any, ...]) -> None:
    stats = ref()
    # a recomputation runs in backward, after its call returned: it updates nothing either
    if stats is None or not m.training or not (stats.active or is_recomputing()):
        return
    x = args[0]
    with torch.no_grad():
        saved = getattr(stats._saved, "by_layer", None)
        if saved is None:
            saved = stats._saved.by_layer = {}
        # The layer updates throwaway copies; the real buffers are put back by _post (swapped, not
        # copied into: autograd may have saved the buffers the layer used).
        saved[id(m)] = [getattr(m, name) for name in _BUFFERS]
        for name in _BUFFERS:
            setattr(m, name, getattr(m, name).clone())
        if stats.active and not is_recomputing():
            dims = [0, *range(2, x.dim())]
            total, squares = x.sum(dims).float(), (x.float() ** 2).sum(dims)
            s = stats._sums[id(m)]
            with s.lock:
                s.total = total if s.total is None else s.total + total
                s.squares = squares if s.squares is None else s.squares + squares
                s.count += x.numel() // x.shape[1]


def _post(ref: "weakref.ref[DeferredStats]", m: _BatchNorm) -> None:
    stats = ref()
    if stats is None:
        return
    saved = getattr(stats._saved, "by_layer", {}).pop(id(m), None)
    if saved is None:
        return
    for name, b in zip(_BUFFERS, saved):
        setattr(m, name, b)
