"""Custom autograd Functions whose backward comes in an input half and a weight half.

A custom ``torch.autograd.Function`` that takes weights is one opaque node to
the I/W split: a boundary node, run at I and again at W, and its ``backward``
computes every gradient each time (the weight grads at I are thrown away, the
input grads at W too), or does something once-only (accumulates into a
``main_grad``, frees a buffer). So the split treats an unknown one on a
boundary node as an obstacle and falls back to a whole backward at I
(``split_obstacles``).

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

The runtime marks the node before each engine call (``PHASE_ATTR`` on the
node, which is the ``ctx``): at I its ``backward`` runs ``backward_input``,
at W ``backward_weight``. Anywhere else (a plain ``loss.backward()``, B, the
first stage's W, a whole-backward fallback) it runs the whole backward:
``backward_input`` then ``backward_weight`` on the same ``ctx``, so what the
first stashed with ``save_for_weight`` is reused by the second. Both get the
gradients of the outputs, return one entry per ``forward`` input, and may
read ``ctx.saved_tensors`` (each half once). Do not override ``backward``:
a subclass that does is an unknown Function again.

What ``save_for_weight`` stashes is kept from I to W and counted by the
memory accounting ([Note: what I keeps for W] in ``split_keep``).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from pipeline_ext.runtime.split_keep import PHASE_ATTR, STASH_ATTR

__all__ = ["SplitFunction", "is_split_function"]

_SAVED_ATTR = "_pipeline_ext_saved"


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
        setattr(ctx, STASH_ATTR, tensors)

    @staticmethod
    def saved_for_weight(ctx: Any) -> tuple:
        """In ``backward_weight``: what ``backward_input`` saved for it (taken: the ctx no longer holds it)."""
        stash = getattr(ctx, STASH_ATTR, None)
        if stash is None:
            raise RuntimeError(f"{type(ctx).__name__}: backward_weight found nothing saved by backward_input "
                               "(save_for_weight), or read it twice")
        delattr(ctx, STASH_ATTR)
        return stash

    @staticmethod
    def saved(ctx: Any) -> tuple:
        """``ctx.saved_tensors``, unpacked once per engine call: in the whole backward both halves get the same
        tuple (a checkpointed or once-only saved tensor can be unpacked once per backward)."""
        shared = getattr(ctx, _SAVED_ATTR, None)
        return shared if shared is not None else ctx.saved_tensors

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        cls = ctx._forward_cls
        phase = getattr(ctx, PHASE_ATTR, None)
        if phase == "I":
            return cls.backward_input(ctx, *grad_outputs)
        if phase == "W":
            return cls.backward_weight(ctx, *grad_outputs)
        setattr(ctx, _SAVED_ATTR, ctx.saved_tensors)
        try:
            gi = _as_tuple(cls.backward_input(ctx, *grad_outputs))
            gw = _as_tuple(cls.backward_weight(ctx, *grad_outputs))
        finally:
            delattr(ctx, _SAVED_ATTR)
            if hasattr(ctx, STASH_ATTR):
                delattr(ctx, STASH_ATTR)
        if len(gi) != len(gw):
            raise RuntimeError(f"{cls.__name__}: backward_input returned {len(gi)} gradients, backward_weight "
                               f"{len(gw)}; each returns one per forward input")
        for i, (a, b) in enumerate(zip(gi, gw)):
            if a is not None and b is not None:
                raise RuntimeError(f"{cls.__name__}: both halves returned a gradient for forward input {i}; "
                                   "backward_input returns the inputs' and backward_weight the weights'")
        return tuple(a if a is not None else b for a, b in zip(gi, gw))


def _as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def is_split_function(fwd_cls: Any) -> bool:
    """``fwd_cls`` (a node's ``_forward_cls``) is a ``SplitFunction`` whose backward the runtime can steer."""
    return (isinstance(fwd_cls, type) and issubclass(fwd_cls, SplitFunction)
            and fwd_cls.backward is SplitFunction.backward
            and fwd_cls.backward_input is not SplitFunction.backward_input
            and fwd_cls.backward_weight is not SplitFunction.backward_weight)
