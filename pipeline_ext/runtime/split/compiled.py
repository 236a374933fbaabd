"""A ``torch.compile`` backend whose backward splits into an input-grad and a weight-grad graph.

With the default inductor backend a compiled region is one opaque autograd
node, ``CompiledFunctionBackward``: its compiled backward computes every
gradient at once, so the zero-bubble I/W split cannot run the input-grad half
alone and falls back to a whole backward at I (``obstacles.py``).

``split_backend`` is inductor (``compile_fx``) with two changes:

- the backward graph AOTAutograd hands to inductor is kept as an FX graph
  besides being compiled whole (for B). When ``backward.py`` asks a compiled
  node for its input-grad outputs only, the graph is cut in two: the *first*
  part computes those outputs plus the intermediate values the remaining
  outputs need (for a Linear, the gradient at its output), the *rest* computes
  the weight grads from the saved tensors and those values. Each part is
  dead-code eliminated and compiled by inductor (once per cut, cached); nothing
  is computed twice. The values wait on the autograd node between I and W,
  where the memory accounting counts them ([Note: what I keeps for W]);
- buffers are not donated (W runs the node a second time, with the graph
  retained; [Note: no donated buffers, in both metadata]) and AOTAutograd's
  cache is off for these graphs (a cache hit would bring back an unsplittable
  backward).

The protocol with the split goes by marks on the node
([Note: marks on autograd nodes] in ``marks.py``): before I the split sets
``DEFER`` (the output slots, i.e. ``next_functions`` indices, to leave for W);
the first call computes the others and leaves a ``CutForWeight`` in
``CUT_STASH``; W re-enters the node and the second call computes the deferred
slots from it. A node without
``DEFER`` (B, 1F1B) runs the whole compiled backward. ``obstacles.py`` accepts
a compiled region only if its forward was compiled here (``mark_splittable``).

Use: ``torch.compile(module, backend=pipeline_ext.split_backend)``.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Optional, Sequence

import torch
from torch import fx

from pipeline_ext.runtime.split.marks import CUT_STASH, DEFER, CutForWeight, mark_splittable

__all__ = ["split_backend", "cut_backward"]


# [Note: no donated buffers, in both metadata]
# W re-enters a compiled node (its graph retained), so its compiled backward must not donate the saved
# tensors' buffers, and AOTAutograd must let it run with ``retain_graph=True``. AOTAutograd's check, at
# every backward call while ``torch._functorch.config.donated_buffer`` is on (torch's default; our config
# patch is long gone by then, and the backward may even be compiled lazily, at its first call), reads
# ``bw_donated_idxs`` of the *outer* metadata (``CompiledFunction.metadata``) and refuses anything but
# ``[]``. Inductor reads the metadata on the ``TracingContext``: the same object for plain tensor inputs,
# but with tensor-subclass inputs (DTensor) the *inner* metadata of the desugared graph. Compiled with
# ``donated_buffer=False``, the outer one stayed ``None`` (never computed), and only a lazy compile at a
# call that retains the graph set it to ``[]``: a region whose first backward was a whole B (DualPipeV
# runs B before the first I of a stage) then failed at that I. So the graph is compiled with donated
# buffers on, where AOTAutograd gives the outer and the inner metadata one shared list, and
# ``_inner_compile`` empties that list in place before inductor reads it: both say "donates nothing"
# from the start, whichever backward comes first. Each backward call also empties its node's outer list
# if it is not empty (a torch that stopped sharing the list), so that later calls pass the check.
def split_backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """``torch.compile`` backend: inductor, with a backward that the I/W split can cut (see module doc)."""
    import torch._functorch.config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    # donated buffers on for the partition only: see [Note: no donated buffers, in both metadata]
    with functorch_config.patch(donated_buffer=True, enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, inner_compile=_inner_compile)


def _donate_nothing(meta: Any) -> None:
    """Make ``meta`` say its backward donates no buffer, in place: the list may be shared with the outer
    metadata ([Note: no donated buffers, in both metadata])."""
    idxs = getattr(meta, "bw_donated_idxs", None)
    if isinstance(idxs, list):
        idxs.clear()
    elif meta is not None:
        meta.bw_donated_idxs = []


def _inner_compile(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    from torch._guards import TracingContext
    from torch._inductor.compile_fx import compile_fx_inner

    # before inductor reads it, forward or backward (a lazy backward compile runs outside split_backend's
    # config patch): [Note: no donated buffers, in both metadata]
    context = TracingContext.try_get()
    _donate_nothing(getattr(context, "fw_metadata", None))

    if kwargs.get("is_backward"):
        return SplitBackward(gm, example_inputs, kwargs)
    compiled = compile_fx_inner(gm, example_inputs, **kwargs)
    mark_splittable(compiled)  # reached as CompiledFunction.compiled_fw
    return compiled


class SplitBackward:
    """The compiled backward of one region: whole, or as (first, rest) parts cut per set of deferred outputs."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], kwargs: dict[str, Any]) -> None:
        from torch._guards import CompileContext, TracingContext
        from torch._inductor.compile_fx import compile_fx_inner

        # called with one list of arguments, as AOTAutograd's compiled functions are; an instance
        # attribute, so that the wrappers AOTAutograd puts around us (functools.wraps) copy it
        self._boxed_call = True
        self._graph = copy.deepcopy(gm)  # inductor may rewrite the one it compiles
        self._n_outputs = len(_outputs(self._graph))  # one per next_functions slot of the node
        # parts are compiled lazily, at the first I that asks for them: under the contexts of this compile
        self._tracing = TracingContext.try_get()
        self._compile = CompileContext.try_get()
        self._kwargs = {k: kwargs[k] for k in ("graph_id", "boxed_forward_device_index") if k in kwargs}
        self._whole = compile_fx_inner(gm, example_inputs, **kwargs)
        self._parts: dict[frozenset[int], tuple[Any, Any, int]] = {}

    def __call__(self, args: list[Any]) -> Any:
        node = torch._C._current_autograd_node()
        outer = getattr(getattr(type(node), "_forward_cls", None), "metadata", None)
        if getattr(outer, "bw_donated_idxs", []) != []:  # [Note: no donated buffers, in both metadata]
            outer.bw_donated_idxs = []
        cut: Optional[CutForWeight] = CUT_STASH.take(node)
        if cut is not None:  # W: the deferred outputs, from what I left
            got = _call(cut.rest, list(args) + cut.values)
            args.clear()
            return _scatter(self._n_outputs, sorted(cut.slots), got)
        defer: Optional[frozenset[int]] = DEFER.take(node)
        if not defer or len(node.next_functions) != self._n_outputs:  # (slots must map one to one)
            return _call(self._whole, args)
        first, rest, n_kept = self._cut(defer)
        got = _call(first, args)
        CUT_STASH.set(node, CutForWeight(defer, rest, list(got[n_kept:])))
        kept = [i for i in range(self._n_outputs) if i not in defer]
        return _scatter(self._n_outputs, kept, got[:n_kept])

    def _cut(self, defer: frozenset[int]) -> tuple[Any, Any, int]:
        if defer not in self._parts:
            first, rest, n_kept = cut_backward(self._graph, defer)
            self._parts[defer] = (self._compile_part(first), self._compile_part(rest), n_kept)
        return self._parts[defer]

    def _compile_part(self, gm: fx.GraphModule) -> Any:
        from torch._guards import compile_context, tracing
        from torch._inductor.compile_fx import compile_fx_inner

        example = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
        with tracing(self._tracing), compile_context(self._compile):
            return compile_fx_inner(gm, example, is_backward=True, **self._kwargs)


def _call(compiled: Any, args: list[Any]) -> list[Any]:
    if getattr(compiled, "_boxed_call", False):
        return list(compiled(args))
    return list(compiled(*args))


def _scatter(n: int, slots: Sequence[int], values: Sequence[Any]) -> list[Any]:
    out: list[Any] = [None] * n
    for i, v in zip(slots, values):
        out[i] = v
    return out


def _outputs(graph: fx.GraphModule) -> list[Any]:
    (out,) = [n for n in graph.graph.nodes if n.op == "output"]
    return list(out.args[0])


def _ancestors(values: Sequence[Any]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [v for v in values if isinstance(v, fx.Node)]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def cut_backward(gm: fx.GraphModule, defer: frozenset[int]) -> tuple[fx.GraphModule, fx.GraphModule, int]:
    """Cut a backward graph into ``first`` (the outputs not in ``defer``, then the values ``rest`` needs)
    and ``rest`` (the ``defer`` outputs, sorted by index, from the original arguments and those values).

    Every computation runs in exactly one part: ``rest`` gets only the nodes the
    kept outputs do not need; what both need is computed in ``first`` and handed on.
    """
    outputs = _outputs(gm)
    kept = [v for i, v in enumerate(outputs) if i not in defer]
    later = [outputs[i] for i in sorted(defer)]
    in_first = _ancestors(kept)
    in_rest = _ancestors(later) - in_first
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # computed in first, used in rest (or a deferred output itself): handed on
    handed = [
        n for n in gm.graph.nodes
        if n in in_first and n.op != "placeholder"
        and (any(u in in_rest for u in n.users) or any(n is v for v in later))
    ]

    def build(nodes: set[fx.Node], extra_inputs: list[fx.Node], results: list[Any]) -> fx.GraphModule:
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for p in placeholders + extra_inputs:
            env[p] = graph.placeholder(p.name if p.op == "placeholder" else f"handed_{p.name}")
            env[p].meta = dict(p.meta)
        for n in gm.graph.nodes:
            if n in nodes and n.op != "placeholder" and n not in env:
                env[n] = graph.node_copy(n, lambda a: env[a])
        graph.output(tuple(env[v] if isinstance(v, fx.Node) else v for v in results))
        part = fx.GraphModule(gm, graph)
        part.graph.eliminate_dead_code()
        part.recompile()
        return part

    first = build(in_first, [], kept + handed)
    rest = build(in_rest, handed, later)
    return first, rest, len(kept)
