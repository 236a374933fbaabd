"""Cut an ``nn.Sequential`` into contiguous stages of balanced cost.

A pipeline runs at the pace of its slowest stage, so the split minimises the
largest per-stage cost. ``balance_by_params`` uses parameter counts (free, a
fair proxy for compute in uniform stacks); ``balance_by_time`` profiles each
layer's forward and backward on a sample batch.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from torch import nn

__all__ = ["balance_by_params", "balance_by_time", "split_min_max"]


def split_min_max(costs: Sequence[float], n: int) -> list[int]:
    """Sizes of ``n`` contiguous non-empty blocks of ``costs`` minimising the largest block sum.

    Exact dynamic programme, O(n * len(costs)^2): layer counts are small.
    """
    k = len(costs)
    if not 1 <= n <= k:
        raise ValueError(f"cannot split {k} layers into {n} stages: need 1 <= stages <= layers")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[j][i]: minimal max-block cost splitting the first i layers into j blocks
    best = [[inf] * (k + 1) for _ in range(n + 1)]
    cut = [[0] * (k + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for j in range(1, n + 1):
        for i in range(j, k - (n - j) + 1):
            for t in range(j - 1, i):
                v = max(best[j - 1][t], prefix[i] - prefix[t])
                if v < best[j][i]:
                    best[j][i], cut[j][i] = v, t
    sizes, i = [], k
    for j in range(n, 0, -1):
        t = cut[j][i]
        sizes.append(i - t)
        i = t
    return sizes[::-1]


def _layers(module: nn.Module) -> list[nn.Module]:
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"balancing needs an nn.Sequential, got {type(module).__name__}")
    return list(module.children())


def balance_by_params(module: nn.Sequential, n: int) -> list[int]:
    """Layers per stage so that parameter counts are as even as contiguity allows."""
    costs = [sum(p.numel() for p in layer.parameters()) + 1 for layer in _layers(module)]  # +1: no free layers
    return split_min_max(costs, n)


def balance_by_time(module: nn.Sequential, sample: Any, n: int, repeats: int = 3) -> list[int]:
    """Layers per stage from measured forward+backward time of each layer on ``sample``.

    Each layer is timed on the activation the previous layers produce for
    ``sample``, as a leaf that requires grad, so its backward is timed too. The
    module's parameters' ``.grad`` are left as they were.
    """
    layers = _layers(module)
    saved = {p: p.grad for p in module.parameters()}
    costs: list[float] = []
    x = sample
    try:
        for layer in layers:
            times = []
            for _ in range(repeats):
                inp = _leaf(x)
                t0 = time.perf_counter()
                out = layer(*inp) if isinstance(inp, tuple) else layer(inp)
                tensors = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor) and o.requires_grad]
                if tensors:
                    torch.autograd.backward(tensors, [torch.ones_like(o) for o in tensors])
                times.append(time.perf_counter() - t0)
            costs.append(sorted(times)[len(times) // 2])
            with torch.no_grad():
                x = layer(*x) if isinstance(x, tuple) else layer(x)
    finally:
        for p, g in saved.items():
            p.grad = g
    return split_min_max(costs, n)


def _leaf(x: Any) -> Any:
    if isinstance(x, tuple):
        return tuple(_leaf(t) for t in x)
    if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()):
        return x.detach().requires_grad_(True)
    return x
