"""Whether a stage keeps the I/W split, asked before a run: ``split_check`` (a module) and ``split_obstacle`` (a graph).

Both read the graph the way ``backward_input`` does at I (``graph.analyse``)
and say why its I would run the whole backward, or None; neither runs
backward. ``schedules.select(split=...)`` takes one answer per rank share.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional, Sequence

import torch
from torch.autograd.graph import get_gradient_edge

from pipeline_ext.runtime.split.graph import analyse, needs_grad

__all__ = ["split_obstacle", "split_check"]


def split_obstacle(outputs: Sequence[Any], inputs: Sequence[torch.Tensor]) -> Optional[str]:
    """Why ``backward_input`` would run the whole backward of this graph at I (None: it would split).

    Reads the graph only: no engine call, no unpacking, no gradient touched.
    """
    roots = [o for o in outputs if needs_grad(o)]
    input_nodes = {get_gradient_edge(t).node for t in inputs if t.requires_grad}
    if not input_nodes or not roots:
        return None
    return analyse([(o, None) for o in roots], input_nodes)[2].obstacle


def split_check(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Optional[str]:
    """Whether ``module`` (a stage) keeps the I/W split: None, or why its I would run the whole backward.

    Runs one forward on the example arguments (floating-point tensors become
    inputs that require grad, as a stage's received activations do) and reads
    its graph (``split_obstacle``); nothing runs backward. Give
    ``schedules.select(split=...)`` one answer per rank share of the model.

    The forward leaves no trace in what training reads next: it runs on copies
    of the module's buffers (BatchNorm's running statistics stay as they were)
    and the CPU RNG state, and every initialized CUDA device's, are put back
    (dropout draws nothing from the training's stream). Other state the
    forward changes (Python attributes it sets, a parameter it modifies in
    place) is not put back.
    """
    def as_input(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()):
            return x.detach().requires_grad_(True)
        return x

    args = tuple(as_input(a) for a in args)
    kwargs = {k: as_input(v) for k, v in kwargs.items()}
    with _untouched(module), torch.enable_grad():
        out = module(*args, **kwargs)
    flat = out if isinstance(out, (tuple, list)) else (out,)
    outputs = [o for o in flat if isinstance(o, torch.Tensor) and o.requires_grad]
    inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.requires_grad]
    return split_obstacle(outputs, inputs)


@contextlib.contextmanager
def _untouched(module: torch.nn.Module) -> Any:
    """Run ``module`` on copies of its buffers, then put the originals back; the same for the RNG states."""
    modules = module.modules() if isinstance(module, torch.nn.Module) else ()
    swapped = [(m, name, b) for m in modules for name, b in m._buffers.items() if b is not None]
    cuda = torch.cuda.is_initialized()
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if cuda else []):
        try:
            with torch.no_grad():
                for m, name, b in swapped:
                    m._buffers[name] = b.clone()
            yield
        finally:
            for m, name, b in swapped:
                m._buffers[name] = b
            if not cuda and torch.cuda.is_initialized():  # the forward started CUDA: back to its seeds' start
                torch.cuda.manual_seed_all(torch.cuda.initial_seed())
