"""Cut an ``nn.Sequential`` into contiguous stages of balanced cost.

A pipeline runs at the pace of its slowest stage, so the split minimises the
largest per-stage cost. ``balance_by_params`` uses parameter counts (free, a
fair proxy for compute in uniform stacks); ``balance_by_time`` profiles each
layer's forward and backward on a sample batch; ``balance_by_size`` balances
memory (torchgpipe's): measured CUDA memory of each layer's forward on a GPU,
parameter and activation sizes on the CPU. The min-max split itself
(``split_min_max``) is the schedules package's, shared with
``schedules.balance_stages``, which minimises a schedule's simulated step
time instead (for the multi-process stages, ``pipeline_ext.training.profiling``).

Profiling leaves the model as it was: it runs on deep copies of the layers in
training mode (BatchNorm running statistics and ``.grad`` untouched, the
model's own training flag kept). A layer's output goes to the next layer as one
argument, as in ``Pipe``.
"""
from __future__ import annotations

import copy
import time
from typing import Any, Iterator

import torch
from torch import nn

from pipeline_ext.runtime.microbatch import to_device
from pipeline_ext.runtime.stage import detach_tree
from pipeline_ext.schedules.balance import split_min_max
from pipeline_ext.skip.tracker import SkipKey, SkipTracker, use_skip_tracker

__all__ = ["balance_by_params", "balance_by_time", "balance_by_size", "split_min_max"]


def _layers(module: nn.Module) -> list[nn.Module]:
    """Every entry of the Sequential, in order (a module used twice counts twice, as Pipe runs it)."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"balancing needs an nn.Sequential, got {type(module).__name__}")
    return list(module._modules.values())


def balance_by_params(module: nn.Sequential, n: int) -> list[int]:
    """Layers per stage so that parameter counts are as even as contiguity allows."""
    costs = [sum(p.numel() for p in layer.parameters()) + 1 for layer in _layers(module)]  # +1: no free layers
    return split_min_max(costs, n)


def _sandbox(module: nn.Sequential, device: torch.device | None = None) -> Iterator[nn.Module]:
    """Each layer as a training-mode deep copy (on ``device``): profiling never touches the model."""
    for layer in _layers(module):
        copied = copy.deepcopy(layer)
        if device is not None:
            copied = copied.to(device)
        yield copied.train()


class _ProfilingSkips(SkipTracker):
    """Skip connections while layers are profiled one at a time, each several times.

    A stash is kept (detached) instead of handed over once, and every pop gets
    a fresh leaf of it, so each measured run of a popping layer sees its skip
    like a stage input, and no backward reaches into an earlier layer's graph.
    """

    def save(self, key: SkipKey, tensor: Any) -> None:
        self.tensors[key] = detach_tree(tensor)

    def load(self, key: SkipKey) -> Any:
        return _leaf(self.tensors[key])


def _profile(module: nn.Sequential, sample: Any, device: torch.device | None, measure) -> list[float]:
    """``measure(layer, input) -> (cost, output)`` per layer, each fed the previous layer's output."""
    x = sample if device is None else to_device(sample, device)
    costs = []
    with use_skip_tracker(_ProfilingSkips()):
        for layer in _sandbox(module, device):
            cost, x = measure(layer, _leaf(x))
            costs.append(cost)
            x = detach_tree(x)
    return costs


def balance_by_time(module: nn.Sequential, sample: Any, n: int, repeats: int = 3) -> list[int]:
    """Layers per stage from measured forward+backward time of each layer on ``sample``.

    Each layer is timed on the activation the previous layers produce for
    ``sample``, as a leaf that requires grad, so its backward is timed too.
    """

    def measure(layer: nn.Module, inp: Any) -> tuple[float, Any]:
        times, out = [], None
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = layer(inp)
            _backward(out)
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2], out

    return split_min_max(_profile(module, sample, None, measure), n)


def balance_by_size(module: nn.Sequential, sample: Any, n: int, chunks: int = 1, param_scale: float = 2.0,
                    device: Any = None) -> list[int]:
    """Layers per stage balancing memory: activations of one microbatch plus ``param_scale`` x parameters.

    ``param_scale`` counts what lives as long as a parameter (2.0: the weight
    and its gradient; more with optimizer state, e.g. 4.0 for Adam). On CUDA
    (``device``, or the sample's device) each layer's forward is measured with
    ``torch.cuda.max_memory_allocated`` on a microbatch (``sample`` split in
    ``chunks``); on the CPU the activation cost is the bytes of the tensors
    autograd saves for backward.
    """
    dev = torch.device(device) if device is not None else _device_of(sample)
    micro = _first_chunk(sample, chunks)

    def measure(layer: nn.Module, inp: Any) -> tuple[float, Any]:
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            out = layer(inp)
            torch.cuda.synchronize(dev)
            latent = torch.cuda.max_memory_allocated(dev) - base
        else:
            saved: list[int] = []

            def pack(t: torch.Tensor) -> torch.Tensor:
                saved.append(t.numel() * t.element_size())
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = layer(inp)
            latent = sum(saved)
        return latent + param_scale * params, out

    return split_min_max(_profile(module, micro, dev if dev.type == "cuda" else None, measure), n)


def _backward(out: Any) -> None:
    tensors = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor) and o.requires_grad]
    if tensors:
        torch.autograd.backward(tensors, [torch.ones_like(o) for o in tensors])


def _device_of(x: Any) -> torch.device:
    if isinstance(x, (tuple, list)):
        for t in x:
            return _device_of(t)
    return x.device if isinstance(x, torch.Tensor) else torch.device("cpu")


def _first_chunk(x: Any, chunks: int) -> Any:
    if isinstance(x, (tuple, list)):
        return type(x)(_first_chunk(t, chunks) for t in x)
    if isinstance(x, torch.Tensor) and x.dim() > 0 and chunks > 1:
        return x.chunk(chunks)[0]
    return x


def _leaf(x: Any) -> Any:
    if isinstance(x, tuple):
        return tuple(_leaf(t) for t in x)
    if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()):
        return x.detach().requires_grad_(True)
    return x
