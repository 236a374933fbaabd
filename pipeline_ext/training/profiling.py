"""Measure each layer's cost on the user's device, then cut the layers into stages of least simulated step time.

Why: the multi-process stages are cut by hand or by layer count, and the
embedding and the LM head with its loss make the first and last stages
heavier than the blocks in between, so the pipeline waits on them every
microbatch. ``profile_layers`` times what each layer really costs (forward,
input-grad backward, weight-grad backward, with the user's loss on the last
layer) and counts the activation bytes it leaves for its backward;
``schedules.balance_stages`` (pure Python, no torch) picks the split whose
simulated step under the chosen schedule is shortest; ``balance_layers`` does
both and, across processes, makes every rank take rank 0's split (timings
differ between processes; the stages must not). ``LayerChain`` groups a slice
of layers into one stage module.

A language model's layer list is usually ``[embedding, blocks..., head]``
while its stage class takes a range of blocks plus "first"/"last" flags (a
Hugging Face model's stages, ``demo.gpt_stages``): ``block_ranges`` turns a
split of that list into each stage's block range, ``sizes_with_ends`` a
blocks-per-stage count into a split of the list (to simulate it).

Layers follow the multi-process stages' calling convention: a tuple output is
the next layer's positional arguments (a Hugging Face decoder stage passes
``(hidden, position_ids, attention_mask)``), anything else its one argument.
Profiling leaves the model as it was: it runs on a deep copy of one layer at a
time, in training mode, and gradients come from ``torch.autograd.grad`` (no
``.grad`` written). Timings are medians over ``repeats`` after ``warmup`` runs,
since a shared machine is noisy.
"""
from __future__ import annotations

import copy
import statistics
import time
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from pipeline_ext.runtime.memory import activation_bytes
from pipeline_ext.runtime.microbatch import to_device
from pipeline_ext.runtime.stage import detach_tree
from pipeline_ext.schedules import Balance, LayerCost, Schedule, balance_stages

__all__ = ["profile_layers", "balance_layers", "LayerChain", "stage_modules", "block_ranges", "sizes_with_ends"]


def _flat(x: Any) -> list[torch.Tensor]:
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _flat(item)]
    if isinstance(x, dict):
        return [t for item in x.values() for t in _flat(item)]
    return [x] if isinstance(x, torch.Tensor) else []


def _leaf(x: Any) -> Any:
    """A detached copy of ``x`` whose floating tensors require grad: a stage input, so the input-grad is timed."""
    if isinstance(x, (tuple, list)):
        return type(x)(_leaf(t) for t in x)
    if isinstance(x, dict):
        return {k: _leaf(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(x.is_floating_point() or x.is_complex())
    return x


def _call(layer: nn.Module, args: tuple, kwargs: dict) -> Any:
    return layer(*args, **kwargs)


def _as_args(out: Any) -> tuple:
    return tuple(out) if isinstance(out, tuple) else (out,)


class _WithLoss(nn.Module):
    """The last layer followed by the loss, so the loss is timed and its saved tensors counted with it."""

    def __init__(self, layer: nn.Module, loss_fn: Callable[..., torch.Tensor], target: Any) -> None:
        super().__init__()
        self.layer, self.loss_fn, self.target = layer, loss_fn, target

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.loss_fn(self.layer(*args, **kwargs), self.target)


def _sync(device: Optional[torch.device]) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_layers(layers: Sequence[nn.Module], example_args: Union[tuple, Any], example_kwargs: Optional[dict] = None,
                   loss_fn: Optional[Callable[..., torch.Tensor]] = None, target: Any = None, repeats: int = 5,
                   warmup: int = 1, device: Union[torch.device, str, None] = None) -> list[LayerCost]:
    """One :class:`~pipeline_ext.schedules.LayerCost` per layer for one example microbatch.

    ``example_args`` (a tuple, or the one argument) and ``example_kwargs`` go
    to the first layer; each later layer gets the previous one's output. With
    ``loss_fn``, the last layer's cost includes ``loss_fn(output, target)``
    (its forward and its share of the backward). Per layer: ``f`` the forward,
    ``b`` the backward to the layer's inputs only (what a split backward's I
    does), ``w`` the full backward minus ``b`` (the weight-gradient half; 0 for
    a layer without parameters), each the median of ``repeats`` timed runs
    after ``warmup`` untimed ones, in seconds; ``activation_bytes`` as
    ``pe.activation_bytes`` counts it (inputs, outputs, saved tensors;
    parameters left out), ``input_bytes`` the layer's tensor inputs,
    ``param_bytes`` its parameters. ``device``: where to run (layers and
    inputs are copied there; default: where they are).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    dev = torch.device(device) if device is not None else None
    args = tuple(example_args) if isinstance(example_args, tuple) else (example_args,)
    kwargs = dict(example_kwargs or {})
    if dev is not None:
        args, kwargs, target = to_device(args, dev), to_device(kwargs, dev), to_device(target, dev)
    out: list[LayerCost] = []
    for i, original in enumerate(layers):
        layer = copy.deepcopy(original)
        if dev is not None:
            layer = layer.to(dev)
        layer.train()
        last = i == len(layers) - 1
        run = _WithLoss(layer, loss_fn, target) if last and loss_fn is not None else layer
        inputs = _leaf(args), _leaf(kwargs)
        grads_to = [t for t in _flat(inputs) if t.requires_grad]
        params = [p for p in run.parameters() if p.requires_grad]
        fwd, full, inp = [], [], []
        result: Any = None
        for rep in range(warmup + repeats):
            _sync(dev)
            t0 = time.perf_counter()
            result = _call(run, *inputs)
            _sync(dev)
            t1 = time.perf_counter()
            outs = [t for t in _flat(result) if t.requires_grad]
            if outs and (grads_to or params):
                torch.autograd.grad(outs, grads_to + params, [torch.ones_like(t) for t in outs], allow_unused=True)
            _sync(dev)
            t2 = time.perf_counter()
            t_in = 0.0
            if grads_to:
                outs = [t for t in _flat(_call(run, *inputs)) if t.requires_grad]
                if outs:
                    _sync(dev)
                    t3 = time.perf_counter()
                    torch.autograd.grad(outs, grads_to, [torch.ones_like(t) for t in outs], allow_unused=True)
                    _sync(dev)
                    t_in = time.perf_counter() - t3
            if rep >= warmup:
                fwd.append(t1 - t0)
                full.append(t2 - t1)
                inp.append(t_in)
        f, total = statistics.median(fwd), statistics.median(full)
        b = min(statistics.median(inp), total)
        w = total - b if params else 0.0
        if not params:
            b = total
        out.append(LayerCost(
            f=f, b=b, w=w,
            activation_bytes=float(activation_bytes(run, *inputs[0], **inputs[1])),
            input_bytes=float(sum(t.untyped_storage().nbytes() for t in {id(t): t for t in _flat(inputs)}.values())),
            param_bytes=float(sum(p.numel() * p.element_size() for p in {id(p): p for p in layer.parameters()}.values())),
        ))
        with torch.no_grad():
            args, kwargs = detach_tree(_as_args(layer(*inputs[0], **inputs[1]))), {}
    return out


def balance_layers(layers: Sequence[nn.Module], example_args: Union[tuple, Any], schedule: Union[str, Schedule],
                   num_ranks: Optional[int] = None, microbatches: Optional[int] = None,
                   stages_per_rank: Optional[int] = None, example_kwargs: Optional[dict] = None,
                   loss_fn: Optional[Callable[..., torch.Tensor]] = None, target: Any = None, repeats: int = 5,
                   comm: float = 0.0, budget_bytes: Optional[float] = None, group: Any = None,
                   src: int = 0, **search: Any) -> Balance:
    """Profile ``layers`` (``profile_layers``) and split them for ``schedule`` (``schedules.balance_stages``).

    When torch.distributed is initialised, only global rank ``src`` profiles
    (within ``group``, default the world) and every rank gets its split: the
    stages must be cut the same everywhere, and timings differ by process.
    ``budget_bytes`` bounds each rank's activation peak plus parameter bytes
    (scale ``param_bytes`` yourself for gradients and optimizer state by
    passing a lower budget). ``search``: ``exhaustive_limit``, ``max_shift``.
    """
    import torch.distributed as dist

    shared = dist.is_available() and dist.is_initialized()
    costs: list[Optional[list[LayerCost]]] = [None]
    if not shared or dist.get_rank() == src:
        costs[0] = profile_layers(layers, example_args, example_kwargs, loss_fn, target, repeats=repeats)
    if shared:
        dist.broadcast_object_list(costs, src=src, group=group)
    assert costs[0] is not None
    return balance_stages(costs[0], schedule, num_ranks, microbatches, stages_per_rank, comm=comm,
                          budget_bytes=budget_bytes, **search)


class LayerChain(nn.Sequential):
    """Layers run in order as one stage, a tuple output spread over the next layer's arguments.

    An ``nn.Sequential`` (same children, same ``state_dict`` names) that calls
    its layers the way stages on different ranks call each other, so a slice
    of the layer list computes exactly what the same layers do across a cut.
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out: Any = args
        for i, layer in enumerate(self):
            out = layer(*(_as_args(out) if i else out), **(kwargs if i == 0 else {}))
        return out


def stage_modules(layers: Sequence[nn.Module], sizes: Sequence[int]) -> list[LayerChain]:
    """The layers (the same modules, not copies) grouped into one ``LayerChain`` per stage of ``sizes``."""
    if sum(sizes) != len(layers) or any(s < 1 for s in sizes):
        raise ValueError(f"sizes {list(sizes)} do not split {len(layers)} layers into non-empty stages")
    out, lo = [], 0
    for s in sizes:
        out.append(LayerChain(*layers[lo:lo + s]))
        lo += s
    return out


def block_ranges(sizes: Sequence[int], first: int = 1, last: int = 1) -> list[tuple[int, int]]:
    """Each stage's ``(lo, hi)`` range of blocks (end exclusive) for a split of ``[first ends, blocks, last ends]``.

    ``sizes`` splits a layer list whose ``first`` leading entries (the
    embedding) and ``last`` trailing ones (the norm and head) are not blocks,
    as ``balance_layers`` returns it for ``demo.gpt_layers`` or the Llama
    example's layers; block ``i`` is entry ``first + i``. The ends fall on the
    first and last stages, which may then hold no block (``(0, 0)``: only the
    embedding). ``block_ranges([2, 3, 3, 2])`` is ``[(0, 1), (1, 4), (4, 7), (7, 8)]``.
    """
    if any(s < 1 for s in sizes) or sum(sizes) < first + last:
        raise ValueError(f"sizes {list(sizes)} are not a split of {first} + blocks + {last} layers into "
                         "non-empty stages")
    blocks, out, lo = sum(sizes) - first - last, [], 0
    for s in sizes:
        out.append((min(max(lo - first, 0), blocks), min(max(lo + s - first, 0), blocks)))
        lo += s
    return out


def sizes_with_ends(blocks: Sequence[int], first: int = 1, last: int = 1) -> list[int]:
    """Blocks per stage as a split of ``[first ends, blocks, last ends]``: the inverse of ``block_ranges``.

    ``sizes_with_ends([1, 3, 3, 1])`` is ``[2, 3, 3, 2]`` (what an equal block
    split is, for ``schedules.evaluate_split`` over ``balance_layers``' costs).
    """
    if not blocks or any(b < 0 for b in blocks):
        raise ValueError(f"blocks per stage must be >= 0, got {list(blocks)}")
    out = list(blocks)
    out[0] += first
    out[-1] += last
    if any(s < 1 for s in out):
        raise ValueError(f"blocks per stage {list(blocks)} leave a middle stage empty")
    return out
