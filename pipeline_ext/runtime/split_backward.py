"""Split one backward pass into an input-grad half (I) and a weight-grad half (W).

Zero-bubble schedules run I as soon as the next stage's gradient arrives (the
previous stage waits for it) and push W later to fill bubbles. For that to pay,
I must do only the input-grad math and W must not redo it.

The autograd graph of a stage splits into the *input region* (nodes on a path to
a stage input) and weight-only subgraphs hanging off it. A *boundary* node is an
input-region node with edges into a weight-only subgraph, e.g. ``AddmmBackward``
of a Linear: its input edge belongs to I, its weight edge to W.

- I runs ``autograd.grad(outputs, inputs)``. The engine then evaluates only the
  edges that lead to inputs (for a Linear: ``grad @ W``, not ``grad.T @ x``).
  A pre-hook on each boundary node records the gradient arriving there.
- W re-enters each boundary node with that gradient and asks only for the
  parameters of its own weight-only subgraph, so the engine evaluates only the
  weight edges (``grad.T @ x``). Outputs that do not depend on any input are
  backpropagated whole in W.

Each piece of math runs once; the price is one extra engine call per boundary
node. If two boundary nodes share part of their weight-only subgraphs (tied
weights used twice in a stage), re-entering per node would count the shared
part twice, so W falls back to one backward over the whole graph restricted to
the parameters: still exact, but W then costs about a full backward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["DeferredWeightGrad", "backward_input", "backward_weight"]


def _input_region(roots: Sequence[Any], input_nodes: set[Any]) -> set[Any]:
    """Nodes reachable from ``roots`` that lead to one of ``input_nodes`` (included)."""
    leads: dict[Any, bool] = {}
    for root in roots:
        stack: list[tuple[Any, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            children = [c for c, _ in node.next_functions if c is not None]
            if expanded:
                leads[node] = node in input_nodes or any(leads.get(c, False) for c in children)
            elif node not in leads:
                leads[node] = node in input_nodes  # provisional; final value set on the way back
                stack.append((node, True))
                stack.extend((c, False) for c in children if c not in leads)
    return {n for n, ok in leads.items() if ok}


def _weight_leaves(starts: Sequence[Any], owner: dict[Any, int], tag: int) -> Optional[list[torch.Tensor]]:
    """Leaf tensors of the weight-only subgraph below ``starts``.

    ``owner`` records which boundary first reached each node; None is returned
    when a node already belongs to another boundary (the subgraphs overlap).
    No node below ``starts`` is in the input region: a node that led to an
    input would itself be in it.
    """
    leaves: list[torch.Tensor] = []
    stack = list(starts)
    while stack:
        node = stack.pop()
        prev = owner.get(node)
        if prev == tag:
            continue
        if prev is not None:
            return None
        owner[node] = tag
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.append(variable)
        stack.extend(c for c, _ in node.next_functions if c is not None)
    return leaves


@dataclass
class _Boundary:
    node: Any
    params: list[torch.Tensor]
    grads: Optional[tuple[Optional[torch.Tensor], ...]] = None


@dataclass
class DeferredWeightGrad:
    """What I leaves for W."""

    boundaries: list[_Boundary] = field(default_factory=list)
    # outputs backpropagated whole in W (they do not depend on any input)
    outputs: list[torch.Tensor] = field(default_factory=list)
    output_grads: list[Optional[torch.Tensor]] = field(default_factory=list)
    # fallback: the whole backward restricted to these leaves
    fallback_params: Optional[list[torch.Tensor]] = None

    def clear(self) -> None:
        self.boundaries.clear()
        self.outputs.clear()
        self.output_grads.clear()
        self.fallback_params = None


def _plan(region: set[Any]) -> Optional[list[_Boundary]]:
    """Boundary nodes and their weight leaves, or None if weight-only subgraphs overlap."""
    owner: dict[Any, int] = {}
    boundaries: list[_Boundary] = []
    for tag, node in enumerate(region):
        starts = [c for c, _ in node.next_functions if c is not None and c not in region]
        if not starts:
            continue
        leaves = _weight_leaves(starts, owner, tag)
        if leaves is None:
            return None
        if leaves:
            boundaries.append(_Boundary(node, leaves))
    return boundaries


def _all_leaves(roots: Sequence[Any], exclude: set[Any]) -> list[torch.Tensor]:
    seen: set[Any] = set()
    leaves: list[torch.Tensor] = []
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None and node not in exclude:
            leaves.append(variable)
        stack.extend(c for c, _ in node.next_functions if c is not None)
    return leaves


def backward_input(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[Optional[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
) -> tuple[list[Optional[torch.Tensor]], DeferredWeightGrad]:
    """Compute the grads of ``inputs`` only; return them and what W needs.

    ``outputs`` with their ``grad_outputs`` (None for a scalar loss); outputs
    that do not require grad are ignored. ``inputs`` are the stage inputs that
    require grad. An input that gets no gradient comes back as None.
    """
    deferred = DeferredWeightGrad()
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
    input_nodes = {get_gradient_edge(t).node for t in inputs}
    region = _input_region([get_gradient_edge(o).node for o, _ in pairs], input_nodes) if input_nodes else set()
    in_region = [(o, g) for o, g in pairs if get_gradient_edge(o).node in region]
    for o, g in pairs:
        if get_gradient_edge(o).node not in region:
            deferred.outputs.append(o)
            deferred.output_grads.append(g)
    if not in_region:
        return [None] * len(inputs), deferred

    plan = _plan(region)
    if plan is None:
        deferred.fallback_params = _all_leaves([get_gradient_edge(o).node for o, _ in pairs], input_nodes)
        deferred.outputs = [o for o, _ in pairs]
        deferred.output_grads = [g for _, g in pairs]
    handles = []
    for b in plan or []:
        def hook(grads: tuple[Optional[torch.Tensor], ...], b: _Boundary = b) -> None:
            b.grads = grads

        handles.append(b.node.register_prehook(hook))
    try:
        grads = torch.autograd.grad(
            [o for o, _ in in_region],
            list(inputs),
            grad_outputs=[g for _, g in in_region],
            retain_graph=bool(plan) or plan is None,
            allow_unused=True,
        )
    finally:
        for h in handles:
            h.remove()
    deferred.boundaries = [b for b in plan or [] if b.grads is not None]
    return list(grads), deferred


def backward_weight(deferred: DeferredWeightGrad) -> None:
    """Run the weight-grad half, accumulating into the parameters' ``.grad``."""
    # Nodes shared between the calls below may run more than once, so buffers are
    # kept; they are freed when the caller drops the microbatch's outputs.
    try:
        if deferred.fallback_params is not None:
            if deferred.fallback_params:
                torch.autograd.backward(
                    deferred.outputs, deferred.output_grads, inputs=deferred.fallback_params, retain_graph=True
                )
            return
        for b in deferred.boundaries:
            assert b.grads is not None
            idx = [i for i, g in enumerate(b.grads) if g is not None]
            if idx:
                torch.autograd.backward(
                    [GradientEdge(b.node, i) for i in idx], [b.grads[i] for i in idx], inputs=b.params, retain_graph=True
                )
        if deferred.outputs:
            torch.autograd.backward(deferred.outputs, deferred.output_grads, retain_graph=True)
    finally:
        deferred.clear()
