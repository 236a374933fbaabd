"""What in an autograd graph stops the I/W split from re-entering it node by node.

[Note: what stops the I/W split]
``split_backward`` runs a stage's backward in two engine calls (I, then W
re-entering the *boundary* nodes with the gradient recorded at I). That is
exact only if every node can be run again, with ``retain_graph=True``, and
gives the same answer. These graphs break that assumption:

- a ``torch.compile``'d region: one opaque ``CompiledFunctionBackward`` node.
  Its compiled backward computes every gradient at once (re-entering it
  recomputes all of it), and with donated buffers a second call is an error;
- a reentrant checkpoint (``use_reentrant=True``): its backward refuses to run
  under ``autograd.grad`` or ``inputs=``;
- selective activation checkpointing (``context_fn``, e.g.
  ``create_selective_checkpoint_contexts``): the saved values are handed out
  once; a second recomputation (W's) is an error;
- a saved tensor with an unpack hook we do not know (a user's
  ``saved_tensors_hooks``): it may be once-only (offload and delete).

Plain non-reentrant checkpointing *can* be split: each engine call recomputes
the region, and W's calls share one ``GraphExecGroup`` so W recomputes it once.
``save_on_cpu`` hooks can be unpacked any number of times.

The checks read ``SavedTensor.unpack_hook`` and the checkpoint frame it closes
over, without unpacking anything (unpacking would trigger a recomputation).
Anything we cannot classify counts as an obstacle: the fallback is exact.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch
from torch.utils import checkpoint as _ckpt

__all__ = ["GraphTraits", "graph_traits", "split_aware", "SPLITTABLE_MARK"]

#: attribute of a compiled forward (``CompiledFunction.compiled_fw``) whose backward
#: can be cut into I and W graphs (``runtime/compiled_split.py``)
SPLITTABLE_MARK = "_pipeline_ext_splittable"

_SAVED_NAMES: dict[type, tuple[str, ...]] = {}
_REENTRANT_SAFE_HOOKS = {"save_on_cpu.__init__.<locals>.unpack_from_cpu"}


@dataclass(frozen=True)
class GraphTraits:
    """``obstacle``: why the split would not be exact (None: it is); ``recomputes``:
    the graph holds checkpointed (recomputed) regions, so W's engine calls should
    share one ``GraphExecGroup``."""

    obstacle: Optional[str]
    recomputes: bool


def graph_traits(nodes: Iterable[Any]) -> GraphTraits:
    """Classify every node of a backward graph (all of them: the weight-only parts count too)."""
    recomputes = False
    for node in nodes:
        opaque = _opaque(node)
        if opaque is not None:
            return GraphTraits(opaque, recomputes)
        for saved in _saved_tensors(node):
            kind = _hook_kind(saved)
            if kind == "checkpoint":
                recomputes = True
            elif kind is not None:
                return GraphTraits(kind, recomputes)
    return GraphTraits(None, recomputes)


def split_aware(node: Any) -> bool:
    """A region compiled by ``compiled_split.split_backend``: its backward can be cut into I and W."""
    fwd = getattr(type(node), "_forward_cls", None)
    return getattr(getattr(fwd, "compiled_fw", None), SPLITTABLE_MARK, False) is True


def _opaque(node: Any) -> Optional[str]:
    fwd = getattr(type(node), "_forward_cls", None)  # set on the nodes of Python autograd.Functions
    if fwd is None or split_aware(node):
        return None
    if fwd.__name__ == "CompiledFunction" or type(node).__name__ == "CompiledFunctionBackward":
        return (
            "it contains a torch.compile'd region (one opaque CompiledFunctionBackward node; "
            "torch.compile(..., backend=pipeline_ext.split_backend) keeps the split)"
        )
    if issubclass(fwd, _ckpt.CheckpointFunction):
        return "it contains a reentrant torch.utils.checkpoint (use_reentrant=True), which refuses autograd.grad"
    return None


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


def _hook_kind(saved: Any) -> Optional[str]:
    """None: no hook or one safe to unpack again; "checkpoint": plain checkpoint; else an obstacle."""
    hook = saved.unpack_hook
    if hook is None:
        return None
    frame = _checkpoint_frame(hook)
    if frame is not None:
        context = _closure_value(frame.recompute_fn, "recompute_context")
        if isinstance(context, contextlib.nullcontext):
            return "checkpoint"
        return (
            "it contains a checkpoint with a context_fn (selective activation checkpointing), "
            "whose saved values can be used by one backward only"
        )
    if getattr(hook, "__qualname__", "") in _REENTRANT_SAFE_HOOKS:
        return None
    return f"it holds tensors saved under a saved_tensors_hooks unpack hook we cannot re-enter safely ({_name(hook)})"


def _checkpoint_frame(hook: Any) -> Optional[Any]:
    """The ``_CheckpointFrame`` a non-reentrant checkpoint's unpack hook closes over (maybe via its error wrapper)."""
    for value in _closure(hook):
        if isinstance(value, _ckpt._CheckpointFrame):
            return value
    for value in _closure(hook):
        if callable(value) and getattr(value, "__qualname__", "").startswith("_checkpoint_hook"):
            return _checkpoint_frame(value)
    return None


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
