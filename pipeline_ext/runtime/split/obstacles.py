"""What in an autograd graph stops the I/W split from re-entering it node by node.

[Note: what stops the I/W split]
``backward.py`` runs a stage's backward in two engine calls: I, then W
re-entering the *boundary* nodes (input-region nodes with a weight-only
subgraph below them) with the gradient recorded at I. A boundary node runs in
both calls (its input edges at I, its weight edges at W); every other node
runs in one (input-only nodes at I, weight-only ones at W). ``twice`` below
is the set of nodes that run in both: the boundary nodes, the nodes shared
between W's calls, or, when weight-only subgraphs overlap and W is one whole
backward over the parameters, the whole input region. The split is exact if
every node of ``twice`` gives the same answer when run again with
``retain_graph=True`` and reads its saved values again. What breaks that:

- a ``torch.compile``'d region (anywhere): one opaque ``CompiledFunctionBackward``
  node whose compiled backward computes every gradient at once, and with
  donated buffers a second call is an error (``split_backend`` keeps the split);
- a reentrant checkpoint (``use_reentrant=True``, anywhere): its backward
  refuses to run under ``autograd.grad`` or ``inputs=``;
- on a node of ``twice``, a saved tensor under a ``saved_tensors_hooks``
  unpack hook we do not know: it may be once-only (offload and delete).
  Hooks wrapped in ``once_only_hooks`` are known: I unpacks once and keeps
  the value for W ([Note: what I keeps for W] in ``keep.py``);
  ``save_on_cpu``'s can be unpacked any number of times;
- on a node of ``twice``, a custom ``autograd.Function`` we do not know: its
  ``backward`` computes every gradient each time, or does something once
  only (accumulates into a ``main_grad``). A ``SplitFunction`` (its backward
  in ``backward_input`` and ``backward_weight`` halves) is known, and so is
  a Function that declares ``RERUNNABLE_BACKWARD`` (a class attribute
  ``pipeline_ext_rerunnable_backward = True``: it takes no weights, and its
  backward only reads its saved tensors, so running it again gives the same
  gradients; ``pipeline_ext.seqchunks``' attention does);
- the inputs of a checkpointed region recomputed in more than one engine call
  (read by a node that runs at W: see below), saved under an unpack hook we do
  not know. The region's inputs are saved under the hooks around the
  ``checkpoint`` call, on the checkpoint frame (no graph node holds them), and
  each recomputation unpacks them again. Wrapped in ``once_only_hooks`` they
  are unpacked once and held until W ([Note: what I keeps for W]).

Checkpointed regions (non-reentrant) split. Plain ones: each engine call
recomputes the region, and W's calls share one ``GraphExecGroup`` so W
recomputes it once (twice where W also backpropagates outputs that do not
depend on any input). With a ``context_fn`` (selective activation
checkpointing, whose cache hands each saved value out once): I and W share
one group, the region is recomputed once, at I, and I keeps what W reads
([Note: what I keeps for W]).

The checks read ``SavedTensor.unpack_hook``, ``SavedTensor.data`` (the packed
object) and the checkpoint frame the hook closes over, without unpacking
anything (unpacking would trigger a recomputation). Anything we cannot
classify counts as an obstacle: the fallback is exact.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Collection, Iterable, Iterator, Optional

import torch
from torch.utils import checkpoint as _ckpt

from pipeline_ext.runtime.split.function import RERUNNABLE_BACKWARD, SplitFunction, is_split_function
from pipeline_ext.runtime.split.keep import OnceOnlyPacked
from pipeline_ext.runtime.split.marks import splittable

__all__ = ["GraphTraits", "graph_traits", "checkpoint_frame", "frame_inputs", "sac_storage_tensors"]

_SAVED_NAMES: dict[type, tuple[str, ...]] = {}
_REENTRANT_SAFE_HOOKS = {"save_on_cpu.__init__.<locals>.unpack_from_cpu"}


@dataclass(frozen=True)
class GraphTraits:
    """``obstacle``: why the split would not be exact (None: it is); ``recomputes``: the graph holds
    checkpointed (recomputed) regions; ``shared``: one of them has a ``context_fn``, so I and W must share
    one ``GraphExecGroup`` (one recomputation); ``frames``: the checkpoint frames; ``holders``, ``boxes``,
    ``split_nodes``: what I must keep for W on the nodes that run twice (checkpoint holders, ``once_only_hooks``
    boxes, ``SplitFunction`` nodes); ``held``: the ``once_only_hooks`` boxes of checkpointed regions' inputs
    that more than one recomputation reads."""

    obstacle: Optional[str]
    recomputes: bool
    shared: bool = False
    frames: list = field(default_factory=list)
    holders: list = field(default_factory=list)
    boxes: list = field(default_factory=list)
    split_nodes: list = field(default_factory=list)
    held: list = field(default_factory=list)


def graph_traits(nodes: Iterable[Any], twice: Collection[Any] = (),
                 region: Optional[Collection[Any]] = None) -> GraphTraits:
    """Classify every node of a backward graph (all of them: the weight-only parts count too).

    ``twice``: the nodes that run in both I and W (see the Note); ``region``: the nodes I runs (the input
    region): a node outside it, or in ``twice``, runs at W. None: any node may run at W.
    """
    frames: dict[int, Any] = {}
    at_w: dict[int, bool] = {}  # per frame: a node that runs at W reads its values (W recomputes it)
    holders: list = []
    boxes: list = []
    split_nodes: list = []
    for node in nodes:
        again = node in twice
        opaque = _opaque(node, again)
        if opaque is not None:
            return GraphTraits(opaque, bool(frames))
        if again and is_split_function(getattr(type(node), "_forward_cls", None)):
            split_nodes.append(node)
        for saved in _saved_tensors(node):
            hook = saved.unpack_hook
            if hook is None:
                continue
            frame = checkpoint_frame(hook)
            if frame is not None:
                frames.setdefault(id(frame), frame)
                at_w[id(frame)] = at_w.get(id(frame), False) or again or region is None or node not in region
                if again:
                    holders.append(saved.data)
                continue
            if getattr(hook, "__qualname__", "") in _REENTRANT_SAFE_HOOKS:
                continue
            data = saved.data
            if isinstance(data, OnceOnlyPacked):
                if again:
                    boxes.append(data)
                continue
            if again:
                return GraphTraits(
                    f"it holds tensors saved under a saved_tensors_hooks unpack hook we cannot unpack twice safely "
                    f"({_name(hook)}) on {type(node).__name__}, which runs at I and at W; "
                    "pipeline_ext.once_only_hooks(pack, unpack) keeps the split",
                    bool(frames))
    _outer_frames(frames, at_w)
    shared = any(_selective(f) for f in frames.values())
    if shared:
        unknown = _unknown_checkpoint_internals(frames.values(), holders)
        if unknown is not None:
            return GraphTraits(unknown, True)
    held: list = []
    if not shared:  # (under the shared group every region is recomputed once)
        why = _recomputed_inputs([f for f in frames.values() if at_w[id(f)]], held)
        if why is not None:
            return GraphTraits(why, True)
    return GraphTraits(None, bool(frames), shared, list(frames.values()), holders, boxes, split_nodes, held)


def _selective(frame: Any) -> bool:
    """A checkpoint with a ``context_fn`` (selective activation checkpointing)."""
    return not isinstance(_closure_value(frame.recompute_fn, "recompute_context"), contextlib.nullcontext)


def _frame_saved_inputs(frame: Any) -> Optional[list[Any]]:
    """The SavedTensors of a checkpoint frame's inputs (each recomputation unpacks them); None: unreadable."""
    args = getattr(frame, "saved_args", None)
    if not isinstance(args, list):
        return None
    return [a for a in args if isinstance(a, torch._C._autograd.SavedTensor)]


def _outer_frames(frames: dict[int, Any], at_w: dict[int, bool]) -> None:
    """Add the frames whose holders keep other frames' inputs (a checkpoint inside a checkpoint: recomputing
    the inner region unpacks them, which recomputes the outer one), recomputed wherever the inner one is."""
    changed = True
    while changed:
        changed = False
        for frame in list(frames.values()):
            for saved in _frame_saved_inputs(frame) or ():
                outer = checkpoint_frame(saved.unpack_hook) if saved.unpack_hook is not None else None
                if outer is None:
                    continue
                if id(outer) not in frames:
                    frames[id(outer)], at_w[id(outer)], changed = outer, at_w[id(frame)], True
                elif at_w[id(frame)] and not at_w[id(outer)]:
                    at_w[id(outer)], changed = True, True


def _recomputed_inputs(frames: Iterable[Any], held: list) -> Optional[str]:
    """The inputs of regions that I and W (or two of W's calls) each recompute: the ``once_only_hooks`` boxes
    among them go to ``held`` (unpacked once, then read from the box); why the split would not be exact, if an
    unknown hook saved one (None: it is)."""
    for frame in frames:
        saved_inputs = _frame_saved_inputs(frame)
        if saved_inputs is None:
            return (f"it holds a torch.utils.checkpoint region, and this torch ({torch.__version__}) keeps a "
                    "checkpoint's inputs in another form than the split reads (saved_args), so it cannot tell "
                    "whether recomputing the region at I and again at W may unpack them twice")
        for saved in saved_inputs:
            hook = saved.unpack_hook
            if hook is None or checkpoint_frame(hook) is not None:
                continue
            if getattr(hook, "__qualname__", "") in _REENTRANT_SAFE_HOOKS:
                continue
            data = saved.data
            if isinstance(data, OnceOnlyPacked):
                held.append(data)
                continue
            return (f"it holds a torch.utils.checkpoint region whose inputs were saved under a saved_tensors_hooks "
                    f"unpack hook we cannot unpack twice safely ({_name(hook)}), and I and W each recompute the "
                    "region, unpacking its inputs each time; pipeline_ext.once_only_hooks(pack, unpack) keeps the "
                    "split")
    return None


#: what keeping a selective checkpoint's recomputed values from I to W reads of torch's checkpoint objects
#: (keep.py); a torch whose objects differ gets the whole backward at I, not a guess
_FRAME_ATTRS = ("recomputed", "recomp_counter", "is_recomputed", "weak_holders")


def _unknown_checkpoint_internals(frames: Iterable[Any], holders: Iterable[Any]) -> Optional[str]:
    missing = sorted({a for f in frames for a in _FRAME_ATTRS if not isinstance(getattr(f, a, None), (dict, list))}
                     | {"handles" for h in holders if not isinstance(getattr(h, "handles", None), dict)})
    if not missing:
        return None
    return (f"it holds a selective activation checkpoint, and this torch ({torch.__version__}) keeps its checkpoint "
            f"state in another form than the split reads ({', '.join(missing)}), so I and W cannot share one "
            "recomputation")


def _opaque(node: Any, again: bool) -> Optional[str]:
    fwd = getattr(type(node), "_forward_cls", None)  # set on the nodes of Python autograd.Functions
    if fwd is None or splittable(node):
        return None
    if fwd.__name__ == "CompiledFunction" or type(node).__name__ == "CompiledFunctionBackward":
        return (
            "it contains a torch.compile'd region (one opaque CompiledFunctionBackward node; "
            "torch.compile(..., backend=pipeline_ext.split_backend) keeps the split)"
        )
    if issubclass(fwd, _ckpt.CheckpointFunction):
        return "it contains a reentrant torch.utils.checkpoint (use_reentrant=True), which refuses autograd.grad"
    if again and not is_split_function(fwd) and getattr(fwd, RERUNNABLE_BACKWARD, False) is not True:
        return (f"it contains a custom autograd.Function ({fwd.__module__}.{fwd.__qualname__}) whose backward would "
                f"run at I and again at W (it takes weights, or a weight used twice in the stage makes W re-run the "
                f"input region), computing every gradient each time (or doing something once only); "
                f"{_split_function_hint(fwd)}")
    return None


def _split_function_hint(fwd: type) -> str:
    """What keeps the split for ``fwd``, a custom Function the runtime cannot steer."""
    if issubclass(fwd, SplitFunction):
        missing = [n for n in ("backward_input", "backward_weight") if getattr(fwd, n) is getattr(SplitFunction, n)]
        if missing:
            return (f"it is a pipeline_ext.SplitFunction without {' and '.join(missing)}: define "
                    f"{' and '.join(f'{n}(ctx, *grad_outputs)' for n in missing)} (backward_input returns the "
                    "gradients of the inputs that lead to the stage input, backward_weight the others')")
        return ("it is a pipeline_ext.SplitFunction that overrides backward: remove its backward (the runtime runs "
                "backward_input at I, backward_weight at W, and both elsewhere)")
    if hasattr(fwd, "backward_input") or hasattr(fwd, "backward_weight"):
        return ("it defines backward_input/backward_weight but derives from torch.autograd.Function, not "
                "pipeline_ext.SplitFunction, so its backward cannot tell the halves apart: derive it from "
                "pipeline_ext.SplitFunction and drop its backward")
    return "declare its halves as a pipeline_ext.SplitFunction (backward_input, backward_weight) to keep the split"


def _saved_tensors(node: Any) -> Iterator[Any]:
    """The node's SavedTensor objects, without unpacking them."""
    names = _SAVED_NAMES.get(type(node))
    if names is None:
        names = _SAVED_NAMES[type(node)] = tuple(a for a in dir(node) if a.startswith("_raw_saved_"))
    for name in names:
        try:
            value = getattr(node, name)
        except RuntimeError:  # already freed: nothing left to re-enter
            continue
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, torch._C._autograd.SavedTensor):
                yield item


def checkpoint_frame(hook: Any) -> Optional[Any]:
    """The ``_CheckpointFrame`` a non-reentrant checkpoint's unpack hook closes over (maybe via its error wrapper)."""
    for value in _closure(hook):
        if isinstance(value, _ckpt._CheckpointFrame):
            return value
    for value in _closure(hook):
        if callable(value) and getattr(value, "__qualname__", "").startswith("_checkpoint_hook"):
            return checkpoint_frame(value)
    return None


def sac_storage_tensors(frame: Any) -> list[torch.Tensor]:
    """The values a selective checkpoint's policy saved that its recomputation has not taken yet (memory accounting)."""
    storage = getattr(_closure_value(frame.recompute_fn, "recompute_context"), "storage", None)
    if not isinstance(storage, dict):
        return []
    out: list[torch.Tensor] = []
    for per_op in list(storage.values()):
        stack = list(per_op.values()) if isinstance(per_op, dict) else []
        while stack:
            entry = stack.pop()
            if isinstance(entry, (list, tuple)):
                stack.extend(entry)
            elif isinstance(getattr(entry, "val", None), torch.Tensor):
                out.append(entry.val)
    return out


def frame_inputs(frame: Any) -> list[torch.Tensor]:
    """The inputs a checkpoint frame keeps to recompute from (hooked ones left out: they are not unpacked)."""
    out = []
    for arg in frame.saved_args:
        if isinstance(arg, torch._C._autograd.SavedTensor) and arg.unpack_hook is None:
            data = arg.data
            if isinstance(data, torch.Tensor):
                out.append(data)
    return out


def _closure(fn: Any) -> list[Any]:
    cells = getattr(fn, "__closure__", None) or ()
    out = []
    for cell in cells:
        try:
            out.append(cell.cell_contents)
        except ValueError:  # empty cell
            pass
    return out


def _closure_value(fn: Any, name: str) -> Any:
    code = getattr(fn, "__code__", None)
    if code is None or name not in code.co_freevars:
        return None
    try:
        return fn.__closure__[code.co_freevars.index(name)].cell_contents
    except ValueError:
        return None


def _name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
