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

Some graphs cannot be re-entered per node exactly (see ``obstacles.py``,
[Note: what stops the I/W split]): a ``torch.compile``'d region is one opaque node
whose compiled backward computes every gradient at once and may donate its buffers
(a second call is an error); a reentrant checkpoint refuses ``autograd.grad``; an
unknown saved-tensor unpack hook (possibly once-only) or an unknown custom
``autograd.Function`` on a node that runs at both I and W. For those, I runs the
whole backward (weight grads accumulate at I, as B would do) and W has nothing
left: exact, without the zero-bubble benefit; ``DeferredWeightGrad.unsplit``
says why, and ``StageRunner`` warns once per stage.

What splits although a node runs twice ([Note: what I keeps for W] in
``keep.py``): plain non-reentrant checkpointing (W runs under one
``GraphExecGroup``, so its region is recomputed once for W and once for I, not
once per boundary node); selective activation checkpointing (I and W share one
group: the region is recomputed once, at I, and I keeps what W reads, freed
after W); hooks wrapped in ``once_only_hooks`` (unpacked once, at I, kept for
W; around a plain checkpoint, the region's inputs they saved are unpacked
once and held for every recomputation); a ``SplitFunction`` (I runs its ``backward_input``, W its
``backward_weight``); a region compiled by ``split_backend`` (``compiled.py``: I runs the first part of its
cut backward, W the rest).

The graph analysis (region, branches, the nodes that run twice) is ``graph.py``; this module runs the engine calls.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils.checkpoint import GraphExecGroup

from pipeline_ext.runtime.split.graph import WeightBranch, all_leaves, analyse, needs_grad, root_edge
from pipeline_ext.runtime.split.keep import KeptForWeight
from pipeline_ext.runtime.split.marks import PHASE, splittable

__all__ = ["DeferredWeightGrad", "UnsplitBackwardWarning", "backward_input", "backward_weight"]


class UnsplitBackwardWarning(UserWarning):
    """A stage's backward could not be split into I and W exactly, so I ran all of it."""


@dataclass
class DeferredWeightGrad:
    """What I leaves for W."""

    branches: list[WeightBranch] = field(default_factory=list)
    # outputs backpropagated whole in W (they do not depend on any input)
    outputs: list[Any] = field(default_factory=list)  # tensors or GradientEdges
    output_grads: list[Optional[torch.Tensor]] = field(default_factory=list)
    # fallback: the whole backward restricted to these leaves
    fallback_params: Optional[list[torch.Tensor]] = None
    #: why I already ran the whole backward (W has nothing left); None when split
    unsplit: Optional[str] = None
    # the graph holds checkpointed regions: W's engine calls share one GraphExecGroup of their own
    recomputes: bool = False
    # the GraphExecGroup I ran under and W runs under (one recomputation of each region, at I), or None
    group: Optional[GraphExecGroup] = None
    #: what I keeps for W ([Note: what I keeps for W]); released by ``clear``
    keep: KeptForWeight = field(default_factory=KeptForWeight)

    def kept_tensors(self) -> list[torch.Tensor]:
        """The tensors kept from I until W beyond the graph's own saved ones (for the memory accounting)."""
        return self.keep.tensors()

    def clear(self) -> None:
        self.branches.clear()
        self.outputs.clear()
        self.output_grads.clear()
        self.fallback_params = None
        self.keep.release()


def backward_input(
    outputs: Sequence[Any],
    grad_outputs: Sequence[Optional[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
) -> tuple[list[Optional[torch.Tensor]], DeferredWeightGrad]:
    """Compute the grads of ``inputs`` only; return them and what W needs.

    ``outputs`` (tensors, or the ``GradientEdge`` of outputs the caller let go
    of) with their ``grad_outputs`` (None for a scalar loss); outputs that do
    not require grad are ignored. ``inputs`` are the stage inputs that
    require grad. An input that gets no gradient comes back as None.

    If the graph cannot be split exactly (``obstacles.py``), the whole
    backward runs here, weight grads included, and the returned
    ``DeferredWeightGrad`` has ``unsplit`` set and nothing left for W.
    """
    deferred = DeferredWeightGrad()
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if needs_grad(o)]
    input_nodes = {get_gradient_edge(t).node for t in inputs}
    if not input_nodes:  # nothing to do at I: W backpropagates everything in one engine call
        deferred.outputs, deferred.output_grads = [o for o, _ in pairs], [g for _, g in pairs]
        return [None] * len(inputs), deferred
    region, branches, traits = analyse(pairs, input_nodes)
    if traits.obstacle is not None:
        return _backward_whole(pairs, inputs, traits.obstacle)
    in_region = [(o, g) for o, g in pairs if root_edge(o).node in region]
    for o, g in pairs:
        if root_edge(o).node not in region:
            deferred.outputs.append(o)
            deferred.output_grads.append(g)
    group = GraphExecGroup() if traits.shared else None
    deferred.group = group
    deferred.recomputes = traits.recomputes and group is None
    # split_backend regions on the boundary compute only their input grads at I, the rest at W
    compiled = [b.node for b in branches or [] if splittable(b.node)]
    deferred.keep = KeptForWeight(group, traits.frames, traits.holders, traits.boxes, traits.split_nodes,
                                  traits.held, compiled)
    if not in_region:
        return [None] * len(inputs), deferred

    if branches is None:
        deferred.fallback_params = all_leaves([root_edge(o).node for o, _ in pairs], input_nodes)
        deferred.outputs = [o for o, _ in pairs]
        deferred.output_grads = [g for _, g in pairs]
    handles = []
    for b in branches or []:
        def hook(grads: tuple[Optional[torch.Tensor], ...], b: WeightBranch = b) -> None:
            b.grads = grads

        handles.append(b.node.register_prehook(hook))
    deferred.keep.arm(region)  # what each node that runs twice owes I, and keeps for W
    PHASE.set_all(deferred.keep.split_nodes, "I")
    try:
        with group if group is not None else contextlib.nullcontext():
            grads = torch.autograd.grad(
                [o for o, _ in in_region],
                list(inputs),
                grad_outputs=[g for _, g in in_region],
                retain_graph=bool(branches) or branches is None,
                allow_unused=True,
            )
    except BaseException:
        deferred.clear()
        raise
    finally:
        for h in handles:
            h.remove()
        PHASE.set_all(deferred.keep.split_nodes, None)
    deferred.branches = [b for b in branches or [] if b.grads is not None]
    return list(grads), deferred


def _backward_whole(
    pairs: Sequence[tuple[Any, Optional[torch.Tensor]]], inputs: Sequence[torch.Tensor], why: str
) -> tuple[list[Optional[torch.Tensor]], DeferredWeightGrad]:
    """I as a full backward (what B does): weight grads accumulate now, W gets nothing.

    Leaf inputs collect their grads in ``.grad`` through a plain ``backward``
    (what a reentrant checkpoint needs); their previous ``.grad`` is put back.
    A non-leaf input would let a plain backward run on into whatever graph made
    it, so then the backward is restricted to the inputs and the graph's leaves.
    """
    roots, grads = [o for o, _ in pairs], [g for _, g in pairs]
    before = [t.grad if t.is_leaf else None for t in inputs]
    try:
        for t in inputs:
            if t.is_leaf:
                t.grad = None
        if all(t.is_leaf for t in inputs):
            torch.autograd.backward(roots, grads)
            got = [t.grad for t in inputs]
        else:
            leaves = all_leaves([root_edge(o).node for o in roots], {get_gradient_edge(t).node for t in inputs})
            got = _grads_of(roots, grads, list(inputs), leaves)
    finally:
        for t, g in zip(inputs, before):
            if t.is_leaf:
                t.grad = g
    return got, DeferredWeightGrad(unsplit=why)


def _grads_of(
    roots: list[Any], grads: list[Optional[torch.Tensor]], inputs: list[torch.Tensor], leaves: list[torch.Tensor]
) -> list[Optional[torch.Tensor]]:
    """Full backward restricted to ``inputs`` + ``leaves``: leaves accumulate, inputs' grads are returned."""
    captured: dict[int, torch.Tensor] = {}
    handles = [t.register_hook(lambda g, i=i: captured.__setitem__(i, g)) for i, t in enumerate(inputs)]
    try:
        torch.autograd.backward(roots, grads, inputs=inputs + leaves)
    finally:
        for h in handles:
            h.remove()
    return [captured.get(i) for i in range(len(inputs))]


# one engine call of W: roots, their grads, the leaves to reach (None: all)
_Call = tuple[list[Any], list[Optional[torch.Tensor]], Optional[list[torch.Tensor]]]


def backward_weight(deferred: DeferredWeightGrad) -> None:
    """Run the weight-grad half, accumulating into the parameters' ``.grad``."""
    # (roots, their grads, the leaves to reach or None for all) per engine call, in groups
    # whose calls touch disjoint nodes: the branches' weight-only subgraphs never overlap
    # (overlapping ones take the one-call fallback); the outputs that do not depend on any
    # input may share nodes with them, so they get a group of their own.
    groups: list[list[_Call]] = []
    if deferred.fallback_params is not None:
        if deferred.fallback_params:
            groups.append([(list(deferred.outputs), list(deferred.output_grads), deferred.fallback_params)])
    else:
        edges: list[_Call] = []
        for b in deferred.branches:
            assert b.grads is not None
            idx = [i for i, g in enumerate(b.grads) if g is not None]
            if idx:
                edges.append(([GradientEdge(b.node, i) for i in idx], [b.grads[i] for i in idx], b.params))
        groups.append(edges)
        if deferred.outputs:
            groups.append([(list(deferred.outputs), list(deferred.output_grads), None)])
    n_calls = sum(len(g) for g in groups)
    done = 0
    # in the one-call fallback the SplitFunctions must give their input grads too (they lead to parameters)
    PHASE.set_all(deferred.keep.split_nodes, "W" if deferred.fallback_params is None else None)
    try:
        for group in groups:
            with _exec_group(deferred.recomputes and len(group) > 1, deferred.group):
                for roots, grads, leaves in group:
                    done += 1
                    # Nodes shared between calls may run more than once, so every call but the
                    # last keeps the buffers (the caller frees them by dropping the outputs). The
                    # last call frees them, which also lets a compiled region with donated buffers
                    # run in a one-call W (a first stage's).
                    kw = {"inputs": leaves} if leaves is not None else {}
                    torch.autograd.backward(roots, grads, retain_graph=done < n_calls, **kw)
    finally:
        PHASE.set_all(deferred.keep.split_nodes, None)
        deferred.clear()


def _exec_group(wanted: bool, shared: Optional[GraphExecGroup] = None) -> contextlib.AbstractContextManager[Any]:
    """One ``GraphExecGroup`` around W's engine calls, so checkpointed regions recompute once for all of them.

    ``shared``: the group I ran under (a selective checkpoint: the region was
    recomputed at I and I kept what W reads); W runs under it too. Otherwise a
    new one when ``wanted``. The calls touch disjoint nodes (boundary subgraphs
    never overlap; overlapping ones take the one-call fallback), which is what a
    group requires; where they do not (the outputs' call), I kept the values
    for the second read. Groups cannot nest: inside a caller's group each call
    recomputes on its own (exact, slower).
    """
    if shared is not None:
        return shared
    if not wanted or torch._C._get_graph_exec_group() is not None:
        return contextlib.nullcontext()
    return GraphExecGroup()
