"""Custom autograd Functions whose backward comes in an input half and a weight half.

A custom ``torch.autograd.Function`` that takes weights is one opaque node to
the I/W split: a boundary node, run at I and again at W, and its ``backward``
computes every gradient each time (the weight grads at I are thrown away, the
input grads at W too), or does something once-only (accumulates into a
``main_grad``, frees a buffer). So the split treats an unknown one on a
boundary node as an obstacle and falls back to a whole backward at I
(``obstacles.py``).

A ``SplitFunction`` says what its halves are::

    class Attention(pipeline_ext.SplitFunction):
        @staticmethod
        def forward(ctx, x, w_qkv, w_o): ...

        @staticmethod
        def backward_input(ctx, grad_out):      # grads of the inputs, None for the weights
            ...
            SplitFunction.save_for_weight(ctx, dqkv, attn_out)   # what W will need, computed once
            return dx, None, None

        @staticmethod
        def backward_weight(ctx, grad_out):     # grads of the weights, None for the inputs
            x, _, _ = SplitFunction.saved(ctx)
            dqkv, attn_out = SplitFunction.saved_for_weight(ctx)
            return None, x.T @ dqkv, attn_out.T @ grad_out

The runtime marks the node before each engine call (``marks.PHASE`` on the
node, which is the ``ctx``): at I its ``backward`` runs ``backward_input``,
at W ``backward_weight``. Anywhere else (a plain ``loss.backward()``, B, the
first stage's W, a whole-backward fallback) it runs the whole backward:
``backward_input`` then ``backward_weight`` on the same ``ctx``, so what the
first stashed with ``save_for_weight`` is reused by the second. Both get the
gradients of the outputs, return one entry per ``forward`` input, and may
read ``ctx.saved_tensors`` (each half once). Do not override ``backward``:
a subclass that does is an unknown Function again.

What ``save_for_weight`` stashes is kept from I to W and counted by the
memory accounting ([Note: what I keeps for W] in ``keep.py``).

The halves are cut by where each forward input leads, not by its name: I
owes a gradient to every input that leads to a stage input (the runtime
marks those, ``marks.INPUT_EDGES``), W's gradients reach the parameters only.
An argument passed as a "weight" that is an activation (a gate computed from
the stage input) gets its gradient from ``backward_weight`` in the whole
backward, which at W would reach no stage input. So where ``backward_input``
leaves such an input without a gradient, or gives one to an input that leads
to no stage input, I runs ``backward_weight`` too, passes on what leads to
the stage inputs and hands W the rest (exact; that node's weight math then
runs at I, and a warning says which input to move into ``backward_input``).
"""
from __future__ import annotations

import threading
import warnings
from typing import Any, Optional

import torch

from pipeline_ext.runtime.split.marks import INPUT_EDGES, PHASE, SHARED_SAVED, WEIGHT_STASH

__all__ = ["SplitFunction", "is_split_function", "input_positions", "RERUNNABLE_BACKWARD"]

#: A custom ``autograd.Function`` class attribute: set to True, it says the Function takes no weights and its
#: ``backward`` only reads its saved tensors (no side effect), so the split may run it at I and again at W
#: (``obstacles.py``). A plain string, so a package below the runtime can declare it without importing it.
RERUNNABLE_BACKWARD = "pipeline_ext_rerunnable_backward"

#: ``SHARED_SAVED`` while I runs: ``saved`` unpacks at its first read and shares the tuple with a second half
_UNPACK_ON_FIRST_READ = object()

_warned: set[type] = set()
_warned_lock = threading.Lock()


class _WeightGrads(tuple):
    """What I computed for W when it had to run ``backward_weight`` itself (kept in the W stash, so the memory
    accounting counts it and ``KeptForWeight.release`` drops it)."""


class SplitFunction(torch.autograd.Function):
    """A ``torch.autograd.Function`` with ``backward_input`` and ``backward_weight`` instead of ``backward``."""

    @staticmethod
    def backward_input(ctx: Any, *grad_outputs: Any) -> Any:
        raise NotImplementedError("a SplitFunction defines backward_input(ctx, *grad_outputs)")

    @staticmethod
    def backward_weight(ctx: Any, *grad_outputs: Any) -> Any:
        raise NotImplementedError("a SplitFunction defines backward_weight(ctx, *grad_outputs)")

    @staticmethod
    def save_for_weight(ctx: Any, *tensors: Optional[torch.Tensor]) -> None:
        """From ``backward_input``: tensors ``backward_weight`` will need (kept until then, then freed)."""
        WEIGHT_STASH.set(ctx, tensors)

    @staticmethod
    def saved_for_weight(ctx: Any) -> tuple:
        """In ``backward_weight``: what ``backward_input`` saved for it (taken: the ctx no longer holds it)."""
        stash = WEIGHT_STASH.take(ctx)
        if stash is None:
            raise RuntimeError(f"{type(ctx).__name__}: backward_weight found nothing saved by backward_input "
                               "(save_for_weight), or read it twice")
        return stash

    @staticmethod
    def saved(ctx: Any) -> tuple:
        """``ctx.saved_tensors``, unpacked once per engine call: in the whole backward both halves get the same
        tuple (a checkpointed or once-only saved tensor can be unpacked once per backward)."""
        shared = SHARED_SAVED.get(ctx)
        if shared is _UNPACK_ON_FIRST_READ:
            shared = ctx.saved_tensors
            SHARED_SAVED.set(ctx, shared)
        return shared if shared is not None else ctx.saved_tensors

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        cls = ctx._forward_cls
        phase = PHASE.get(ctx)
        if phase == "I":
            return _input_half(cls, ctx, grad_outputs)
        if phase == "W":
            stash = WEIGHT_STASH.get(ctx)
            if isinstance(stash, _WeightGrads):  # I ran backward_weight already
                WEIGHT_STASH.clear(ctx)
                return tuple(stash)
            gw = cls.backward_weight(ctx, *grad_outputs)
            owed = INPUT_EDGES.get(ctx, frozenset())
            for i, g in enumerate(_as_tuple(gw)):
                if g is not None and i in owed:  # I gave it one (else it would have run backward_weight itself)
                    raise RuntimeError(_both(cls, i))
            return gw
        SHARED_SAVED.set(ctx, ctx.saved_tensors)
        try:
            return _whole(cls, ctx, grad_outputs)
        finally:
            SHARED_SAVED.clear(ctx)
            WEIGHT_STASH.clear(ctx)


def _whole(cls: Any, ctx: Any, grad_outputs: tuple) -> tuple:
    """Both halves, merged (the caller shares one unpack of the saved tensors between them)."""
    gi = _as_tuple(cls.backward_input(ctx, *grad_outputs))
    return tuple(_merged(cls, gi, _as_tuple(cls.backward_weight(ctx, *grad_outputs))))


def _merged(cls: Any, gi: tuple, gw: tuple) -> list:
    """One gradient per forward input from the halves' ``gi`` and ``gw``; an input given one by both is refused."""
    if len(gi) != len(gw):
        raise RuntimeError(f"{cls.__name__}: backward_input returned {len(gi)} gradients, backward_weight "
                           f"{len(gw)}; each returns one per forward input")
    for i, (a, b) in enumerate(zip(gi, gw)):
        if a is not None and b is not None:
            raise RuntimeError(_both(cls, i))
    return [a if a is not None else b for a, b in zip(gi, gw)]


def _both(cls: Any, i: int) -> str:
    return (f"{cls.__name__}: both halves returned a gradient for forward input {i}; backward_input returns the "
            "gradients of the inputs that lead to the stage input (activations), backward_weight the others'")


def _input_half(cls: Any, ctx: Any, grad_outputs: tuple) -> Any:
    """I: ``backward_input``; where its gradients do not match the inputs I owes (``INPUT_EDGES``), both
    halves, passing on what leads to the stage inputs and keeping the rest for W (see the module docstring)."""
    owed = INPUT_EDGES.get(ctx)
    SHARED_SAVED.set(ctx, _UNPACK_ON_FIRST_READ)  # one unpack for both halves, should I run both
    try:
        gi = _as_tuple(cls.backward_input(ctx, *grad_outputs))
        if owed is None:
            return gi
        edges = ctx.needs_input_grad  # per forward input: a tensor with an edge
        missing = [i for i in owed if i < len(gi) and gi[i] is None]
        extra = [i for i, g in enumerate(gi) if g is not None and i not in owed and i < len(edges) and edges[i]]
        if not missing and not extra:
            return gi
        merged = _merged(cls, gi, _as_tuple(cls.backward_weight(ctx, *grad_outputs)))
    finally:
        SHARED_SAVED.clear(ctx)
    WEIGHT_STASH.clear(ctx)  # what backward_input stashed and backward_weight did not take
    moved = [i for i in missing if merged[i] is not None]
    if moved or extra:
        _warn_once(cls, moved, extra)
    WEIGHT_STASH.set(ctx, _WeightGrads(None if i in owed else g for i, g in enumerate(merged)))
    return tuple(g if i in owed else None for i, g in enumerate(merged))


def _warn_once(cls: Any, moved: list[int], extra: list[int]) -> None:
    with _warned_lock:
        if cls in _warned:
            return
        _warned.add(cls)
    said = []
    if moved:
        said.append(f"backward_weight returned the gradient of forward input(s) {moved}, which lead to the stage "
                    "input (activations, not weights): return it from backward_input")
    if extra:
        said.append(f"backward_input returned a gradient for forward input(s) {extra}, which lead to no stage "
                    "input (weights): return it from backward_weight")
    warnings.warn(
        f"{cls.__module__}.{cls.__qualname__}: {'; '.join(said)}. I ran both halves of this Function so that "
        "every gradient goes where the whole backward sends it (exact, but its weight math now runs at I, "
        "not in W). Warned once per Function.",
        stacklevel=2,
    )


def _as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def input_positions(node: Any, region: Any) -> frozenset[int]:
    """The forward-input positions (what the halves index their gradients by) of ``node``'s edges into ``region``.

    ``next_functions`` leaves out the inputs that are not tensors; its edges that are not None are, in order,
    the inputs that need grad (``needs_input_grad``).
    """
    wanted = [i for i, needs in enumerate(node.needs_input_grad) if needs]
    edges = [c for c, _ in node.next_functions if c is not None]
    if len(wanted) != len(edges):
        raise RuntimeError(f"{type(node).__name__}: {len(edges)} gradient edges for {len(wanted)} inputs that need "
                           "grad; this torch lays out a custom Function's node otherwise than the I/W split reads")
    return frozenset(i for i, c in zip(wanted, edges) if c in region)


def is_split_function(fwd_cls: Any) -> bool:
    """``fwd_cls`` (a node's ``_forward_cls``) is a ``SplitFunction`` whose backward the runtime can steer."""
    return (isinstance(fwd_cls, type) and issubclass(fwd_cls, SplitFunction)
            and fwd_cls.backward is SplitFunction.backward
            and fwd_cls.backward_input is not SplitFunction.backward_input
            and fwd_cls.backward_weight is not SplitFunction.backward_weight)
