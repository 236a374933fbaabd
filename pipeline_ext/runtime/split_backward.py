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

Some graphs cannot be re-entered per node exactly (see ``runtime/split_obstacles.py``,
[Note: what stops the I/W split]): a ``torch.compile``'d region is one opaque node
whose compiled backward computes every gradient at once and may donate its buffers
(a second call is an error); a reentrant checkpoint refuses ``autograd.grad``; an
unknown saved-tensor unpack hook (possibly once-only) or an unknown custom
``autograd.Function`` on a node that runs at both I and W. For those, I runs the
whole backward (weight grads accumulate at I, as B would do) and W has nothing
left: exact, without the zero-bubble benefit; ``DeferredWeightGrad.unsplit``
says why, and ``StageRunner`` warns once per stage.

What splits although a node runs twice ([Note: what I keeps for W] in
``runtime/split_keep.py``): plain non-reentrant checkpointing (W runs under one
``GraphExecGroup``, so its region is recomputed once for W and once for I, not
once per boundary node); selective activation checkpointing (I and W share one
group: the region is recomputed once, at I, and I keeps what W reads, freed
after W); hooks wrapped in ``once_only_hooks`` (unpacked once, at I, kept for
W; around a plain checkpoint, the region's inputs they saved are unpacked
once and held for every recomputation); a ``SplitFunction`` (I runs its ``backward_input``, W its
``backward_weight``).
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils.checkpoint import GraphExecGroup

from pipeline_ext.runtime.compiled_split import DEFER_ATTR
from pipeline_ext.runtime.split_function import INPUT_EDGES_ATTR, input_positions
from pipeline_ext.runtime.split_keep import PHASE_ATTR, KeptForWeight
from pipeline_ext.runtime.split_obstacles import graph_traits, split_aware

__all__ = ["DeferredWeightGrad", "UnsplitBackwardWarning", "backward_input", "backward_weight", "split_obstacle",
           "split_check"]


class UnsplitBackwardWarning(UserWarning):
    """A stage's backward could not be split into I and W exactly, so I ran all of it."""


def _reachability(roots: Sequence[Any], input_nodes: set[Any]) -> dict[Any, bool]:
    """Every node reachable from ``roots``, mapped to whether it leads to one of ``input_nodes``."""
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
    return leads


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
class _WeightBranch:
    node: Any
    params: list[torch.Tensor]
    grads: Optional[tuple[Optional[torch.Tensor], ...]] = None


@dataclass
class DeferredWeightGrad:
    """What I leaves for W."""

    branches: list[_WeightBranch] = field(default_factory=list)
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
        _set_phase(self.keep.split_nodes, None)
        for node in self.keep.split_nodes:
            if hasattr(node, INPUT_EDGES_ATTR):
                delattr(node, INPUT_EDGES_ATTR)
        self.keep.release()


def _engine_order(nodes: Sequence[Any]) -> list[Any]:
    """``nodes`` (in ``_reachability``'s traversal order) sorted as one backward runs them: later forward first.

    [Note: W's order is the same on every rank]
    W re-enters the boundary nodes one engine call each, and a node's backward
    may run collectives: a DTensor op whose gradient arrives ``Partial`` (a
    replicated LayerNorm after a colwise Linear) all-reduces it inside the
    node, on the tensor-parallel group. Every rank of that group runs its own
    W, so the calls must come in the same order on every rank, or the
    all-reduces pair one block's gradient with another block's of the same
    shape: no error, a wrong weight gradient that differs between replicas.
    A ``set`` of nodes iterates by address, which differs between processes,
    so W's order is taken from the graph itself: the sequence numbers the
    forward gave the nodes (the same op sequence on every rank; descending is
    the order a whole backward, B, runs them in, so W's collectives come in
    B's order), ties (nodes made on other threads) broken by the traversal
    order, which depends only on the graph's shape. The engine orders the
    nodes within one call by sequence number too.
    """
    index = {n: i for i, n in enumerate(nodes)}
    return sorted(nodes, key=lambda n: (-n._sequence_nr(), index[n]))


def _weight_branches(region: set[Any], order: Sequence[Any], owner: dict[Any, int]) -> Optional[list[_WeightBranch]]:
    """Branch nodes (where a weight-only subgraph joins) and their weight leaves, or None if weight-only subgraphs overlap.

    ``order``: the region's nodes in the order W re-enters them ([Note: W's order is the same on every rank]).
    ``owner`` is filled with every weight-only node, mapped to the branch that reaches it.
    """
    branches: list[_WeightBranch] = []
    for tag, node in enumerate(order):
        starts = [c for c, _ in node.next_functions if c is not None and c not in region]
        if not starts:
            continue
        leaves = _weight_leaves(starts, owner, tag)
        if leaves is None:
            return None
        if leaves:
            branches.append(_WeightBranch(node, leaves))
    return branches


def _all_leaves(roots: Sequence[Any], stops: set[Any]) -> list[torch.Tensor]:
    """Leaf tensors reachable from ``roots`` without passing through ``stops`` (the stage inputs' nodes:
    a non-leaf input's history belongs to whoever made it)."""
    seen: set[Any] = set(stops)
    leaves: list[torch.Tensor] = []
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.append(variable)
        stack.extend(c for c, _ in node.next_functions if c is not None)
    return leaves


def _edge(root: Any) -> GradientEdge:
    """Where ``root`` (a tensor, or an edge already: a released output, see ``runtime/stage.py``) enters the graph."""
    return root if isinstance(root, GradientEdge) else get_gradient_edge(root)


def _needs_grad(root: Any) -> bool:
    return isinstance(root, GradientEdge) or root.requires_grad


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

    If the graph cannot be split exactly (``split_obstacles``), the whole
    backward runs here, weight grads included, and the returned
    ``DeferredWeightGrad`` has ``unsplit`` set and nothing left for W.
    """
    deferred = DeferredWeightGrad()
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if _needs_grad(o)]
    input_nodes = {get_gradient_edge(t).node for t in inputs}
    if not input_nodes:  # nothing to do at I: W backpropagates everything in one engine call
        deferred.outputs, deferred.output_grads = [o for o, _ in pairs], [g for _, g in pairs]
        return [None] * len(inputs), deferred
    region, branches, traits = _analyse(pairs, input_nodes)
    if traits.obstacle is not None:
        return _backward_whole(pairs, inputs, traits.obstacle)
    in_region = [(o, g) for o, g in pairs if _edge(o).node in region]
    for o, g in pairs:
        if _edge(o).node not in region:
            deferred.outputs.append(o)
            deferred.output_grads.append(g)
    group = GraphExecGroup() if traits.shared else None
    deferred.group = group
    deferred.recomputes = traits.recomputes and group is None
    deferred.keep = KeptForWeight(group, traits.frames, traits.holders, traits.boxes, traits.split_nodes,
                                  traits.held)
    if not in_region:
        return [None] * len(inputs), deferred

    if branches is None:
        deferred.fallback_params = _all_leaves([_edge(o).node for o, _ in pairs], input_nodes)
        deferred.outputs = [o for o, _ in pairs]
        deferred.output_grads = [g for _, g in pairs]
    for b in branches or []:
        if split_aware(b.node):  # a compiled region that computes only its input grads now, the rest at W
            setattr(b.node, DEFER_ATTR, frozenset(
                i for i, (c, _) in enumerate(b.node.next_functions) if c is not None and c not in region))
    handles = []
    for b in branches or []:
        def hook(grads: tuple[Optional[torch.Tensor], ...], b: _WeightBranch = b) -> None:
            b.grads = grads

        handles.append(b.node.register_prehook(hook))
    deferred.keep.arm()
    for node in deferred.keep.split_nodes:  # which of its inputs' gradients I owes (split_function)
        setattr(node, INPUT_EDGES_ATTR, input_positions(node, region))
    _set_phase(deferred.keep.split_nodes, "I")
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
        _set_phase(deferred.keep.split_nodes, None)
    deferred.branches = [b for b in branches or [] if b.grads is not None]
    return list(grads), deferred


def _analyse(pairs: Sequence[tuple[Any, Any]], input_nodes: set[Any]) -> tuple[set[Any], Any, Any]:
    """The input region, the weight branches (None: they overlap) and the graph's traits for the split."""
    leads = _reachability([_edge(o).node for o, _ in pairs], input_nodes)
    order = _engine_order([n for n, ok in leads.items() if ok])
    region = set(order)
    owner: dict[Any, int] = {}
    branches = _weight_branches(region, order, owner) if any(_edge(o).node in region for o, _ in pairs) else []
    outside = [o for o, _ in pairs if _edge(o).node not in region]
    traits = graph_traits(leads, _run_twice(region, branches, owner, outside), region)
    if traits.obstacle is None and torch._C._get_graph_exec_group() is not None:
        # in the caller's group every engine call shares one recomputation, and each value of it is handed out once
        if traits.shared:
            traits = dataclasses.replace(traits, obstacle=(
                "it contains a checkpoint with a context_fn (selective activation checkpointing) and the backward "
                "runs inside the caller's GraphExecGroup: the split needs a group of its own, shared by I and W"))
        elif traits.holders:
            traits = dataclasses.replace(traits, obstacle=(
                "it contains a torch.utils.checkpoint region whose recomputed values a node that runs at I and at W "
                "reads, and the backward runs inside the caller's GraphExecGroup, where I and W share one "
                "recomputation that hands each value out once"))
    return region, branches, traits


def split_obstacle(outputs: Sequence[Any], inputs: Sequence[torch.Tensor]) -> Optional[str]:
    """Why ``backward_input`` would run the whole backward of this graph at I (None: it would split).

    Reads the graph only: no engine call, no unpacking, no gradient touched.
    """
    roots = [o for o in outputs if _needs_grad(o)]
    input_nodes = {get_gradient_edge(t).node for t in inputs if t.requires_grad}
    if not input_nodes or not roots:
        return None
    return _analyse([(o, None) for o in roots], input_nodes)[2].obstacle


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


def _run_twice(region: set[Any], branches: Optional[list[_WeightBranch]], owner: dict[Any, int],
               outputs: Sequence[Any]) -> set[Any]:
    """The nodes that run both at I and at W ([Note: what stops the I/W split]).

    The boundary nodes; with overlapping weight-only subgraphs (W is one backward
    over the parameters) the whole input region; and the weight-only nodes that
    W's call for the outputs independent of the inputs reaches too.
    """
    if branches is None:
        return set(region)
    twice = {b.node for b in branches}
    if outputs and owner:
        seen: set[Any] = set()
        stack = [_edge(o).node for o in outputs]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if node in owner:
                twice.add(node)
            stack.extend(c for c, _ in node.next_functions if c is not None)
    return twice


def _set_phase(nodes: Sequence[Any], phase: Optional[str]) -> None:
    """Which half the ``SplitFunction`` nodes run in the next engine call ("I", "W"; None: the whole backward)."""
    for node in nodes:
        if phase is not None:
            setattr(node, PHASE_ATTR, phase)
        elif hasattr(node, PHASE_ATTR):
            delattr(node, PHASE_ATTR)


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
            leaves = _all_leaves([_edge(o).node for o in roots], {get_gradient_edge(t).node for t in inputs})
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
    _set_phase(deferred.keep.split_nodes, "W" if deferred.fallback_params is None else None)
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
