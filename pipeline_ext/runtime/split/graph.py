"""The graph a stage's backward splits into I and W: its input region, its weight branches, what runs twice.

The autograd graph below a stage's outputs splits into the *input region*
(nodes on a path to a stage input, which I runs) and weight-only subgraphs
hanging off it (which W runs). A *boundary* node is an input-region node with
edges into a weight-only subgraph (a Linear's ``AddmmBackward``); its weight
edges and the leaves below them are one *weight branch*, which W re-enters
the node for. ``analyse`` finds the region and the branches, in the order W
re-enters them ([Note: W's order is the same on every rank]), and asks
``obstacles.py`` whether the nodes that run twice allow the split. Reading
only: nothing here runs an engine call or unpacks a saved tensor.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from pipeline_ext.runtime.split.obstacles import GraphTraits, graph_traits

__all__ = ["WeightBranch", "analyse", "all_leaves", "root_edge", "needs_grad"]


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
class WeightBranch:
    """A boundary node, the leaves of its weight-only subgraph, and the gradient I recorded arriving there."""

    node: Any
    params: list[torch.Tensor]
    grads: Optional[tuple[Optional[torch.Tensor], ...]] = None


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


def _weight_branches(region: set[Any], order: Sequence[Any], owner: dict[Any, int]) -> Optional[list[WeightBranch]]:
    """Branch nodes (where a weight-only subgraph joins) and their weight leaves, or None if weight-only subgraphs overlap.

    ``order``: the region's nodes in the order W re-enters them ([Note: W's order is the same on every rank]).
    ``owner`` is filled with every weight-only node, mapped to the branch that reaches it.
    """
    branches: list[WeightBranch] = []
    for tag, node in enumerate(order):
        starts = [c for c, _ in node.next_functions if c is not None and c not in region]
        if not starts:
            continue
        leaves = _weight_leaves(starts, owner, tag)
        if leaves is None:
            return None
        if leaves:
            branches.append(WeightBranch(node, leaves))
    return branches


def all_leaves(roots: Sequence[Any], stops: set[Any]) -> list[torch.Tensor]:
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


def root_edge(root: Any) -> GradientEdge:
    """Where ``root`` (a tensor, or an edge already: a released output, see ``runtime/stage.py``) enters the graph."""
    return root if isinstance(root, GradientEdge) else get_gradient_edge(root)


def needs_grad(root: Any) -> bool:
    return isinstance(root, GradientEdge) or root.requires_grad


def analyse(pairs: Sequence[tuple[Any, Any]], input_nodes: set[Any]) -> tuple[set[Any], Optional[list[WeightBranch]], GraphTraits]:
    """The input region, the weight branches (None: they overlap) and the graph's traits for the split."""
    leads = _reachability([root_edge(o).node for o, _ in pairs], input_nodes)
    order = _engine_order([n for n, ok in leads.items() if ok])
    region = set(order)
    owner: dict[Any, int] = {}
    branches = _weight_branches(region, order, owner) if any(root_edge(o).node in region for o, _ in pairs) else []
    outside = [o for o, _ in pairs if root_edge(o).node not in region]
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


def _run_twice(region: set[Any], branches: Optional[list[WeightBranch]], owner: dict[Any, int],
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
        stack = [root_edge(o).node for o in outputs]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if node in owner:
                twice.add(node)
            stack.extend(c for c, _ in node.next_functions if c is not None)
    return twice
