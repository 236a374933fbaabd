"""Tensor kernels of the pipeline: microbatch split/merge and message packing.

Why they exist: every pipeline step splits its batch into microbatches, merges
the outputs again, and sends several tensors per microbatch to a peer. Doing
that with ``torch.tensor_split(...)[i].contiguous()`` per piece, ``torch.cat``
and one message per tensor costs one copy (and one kernel launch) per piece or
per tensor. The C++ kernels here move all bytes of one call in ONE pass
(one parallel memcpy region on CPU, one kernel launch on CUDA):

- :func:`split` returns contiguous pieces: views when the layout allows (no copy
  at all), otherwise views into one allocation filled by one copy pass.
- :func:`concat` writes every input into one (preallocated or given) output.
- :func:`pack` / :func:`unpack` turn a list of tensors of any dtypes and shapes
  into one byte buffer plus a :class:`PackLayout`, and back into views of the
  buffer, so several tensors travel to a peer as one message.

Results equal ``torch.tensor_split`` / ``torch.cat`` exactly. :func:`split` and
:func:`concat` are differentiable (their backward is the other op);
:func:`pack` / :func:`unpack` are not (they move bytes for communication, and
the runtime attaches gradients at stage boundaries itself).
"""
from __future__ import annotations

import operator
from typing import List, Optional, Sequence, Tuple

import torch

from pipeline_ext._ext import _C

__all__ = ["split", "concat", "pack", "unpack", "PackLayout", "even_sizes", "PACK_ALIGNMENT"]

#: Where each tensor lives in a :func:`pack` buffer: ``nbytes``, ``dtypes``,
#: ``shapes``, ``offsets``; ``encode()`` / ``PackLayout.decode(words)`` and
#: ``to_tensor()`` / ``PackLayout.from_tensor(t)`` turn it into int64 words that
#: can be sent to a peer; it compares with ``==`` and pickles.
PackLayout = _C.PackLayout

#: Byte alignment of every entry in a packed buffer.
PACK_ALIGNMENT: int = _C.PACK_ALIGNMENT


def even_sizes(n: int, chunks: int) -> List[int]:
    """Sizes of ``chunks`` pieces of ``n`` rows as ``torch.tensor_split`` makes them.

    The first ``n % chunks`` pieces get one extra row: 10 rows into 4 chunks
    gives ``[3, 3, 2, 2]``. More chunks than rows gives trailing zeros, as
    tensor_split does.
    """
    n, chunks = operator.index(n), operator.index(chunks)
    if chunks < 1:
        raise ValueError(f"even_sizes: chunks must be >= 1, got {chunks}")
    if n < 0:
        raise ValueError(f"even_sizes: n must be >= 0, got {n}")
    base, extra = divmod(n, chunks)
    return [base + 1 if i < extra else base for i in range(chunks)]


def _as_sizes(sizes: Sequence[int]) -> List[int]:
    if isinstance(sizes, int) or not isinstance(sizes, (list, tuple, torch.Size)):
        raise TypeError(
            f"split: sizes must be a list or tuple of ints, got {type(sizes).__name__}; "
            "for n near-equal pieces use even_sizes(tensor.shape[dim], n)"
        )
    try:
        return [operator.index(s) for s in sizes]
    except TypeError:
        raise TypeError(f"split: sizes must contain only ints, got {list(sizes)!r}") from None


def _as_tensors(op: str, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{op}: expected a list or tuple of tensors, got {type(tensors).__name__}")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: element {i} is a {type(t).__name__}, not a tensor")
    return list(tensors)


def _needs_grad(op: str, tensors: Sequence[torch.Tensor]) -> bool:
    if not torch.is_grad_enabled():
        return False
    try:
        return any(t.requires_grad for t in tensors)
    except AttributeError:
        _as_tensors(op, tensors)  # raises the clear TypeError
        raise


class _Split(torch.autograd.Function):
    """split whose backward concatenates the pieces' gradients."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, sizes: List[int], dim: int):  # type: ignore[override]
        ctx.sizes, ctx.dim = sizes, dim
        return tuple(_C.split(tensor, sizes, dim))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        # Gradients of unused pieces arrive as zeros (materialize_grads default).
        return _C.concat(list(grads), ctx.dim, None), None, None


class _Concat(torch.autograd.Function):
    """concat whose backward splits the output gradient back into the inputs."""

    @staticmethod
    def forward(ctx, dim: int, *tensors: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.dim = dim
        ctx.sizes = [t.shape[dim] for t in tensors]
        return _C.concat(list(tensors), dim, None)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return (None, *_C.split(grad, ctx.sizes, ctx.dim))


def split(tensor: torch.Tensor, sizes: Sequence[int], dim: int = 0) -> List[torch.Tensor]:
    """Split ``tensor`` along ``dim`` into contiguous pieces of the given ``sizes``.

    ``sizes`` must sum to ``tensor.shape[dim]`` (use :func:`even_sizes` for
    tensor_split's uneven distribution). The pieces are views of ``tensor``
    when they are contiguous as views (contiguous input and every dimension
    before ``dim`` of size 1, e.g. splitting a batch on dim 0); otherwise they
    are views into ONE new allocation written by one copy pass. Differentiable.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"split: expected a tensor, got {type(tensor).__name__}")
    sizes = _as_sizes(sizes)
    if tensor.requires_grad and torch.is_grad_enabled():
        return list(_Split.apply(tensor, sizes, dim))
    return _C.split(tensor, sizes, dim)


def concat(tensors: Sequence[torch.Tensor], dim: int = 0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Concatenate ``tensors`` along ``dim`` in one copy pass (like ``torch.cat``).

    All tensors need the same dtype, device and shape except along ``dim``
    (no type promotion: a silent upcast would hide a pipeline bug). ``out``, if
    given, must already have the result's shape, dtype and device and is
    written in place (its storage is kept). Differentiable when ``out`` is None.
    """
    if isinstance(tensors, torch.Tensor):  # pybind11 would iterate its rows
        _as_tensors("concat", tensors)
    if _needs_grad("concat", tensors):
        if out is not None:
            raise RuntimeError(
                "concat: out= is not differentiable, but an input requires grad; "
                "drop out= or run under torch.no_grad()"
            )
        if tensors and tensors[0].dim() > 0:
            return _Concat.apply(dim, *tensors)
    try:
        return _C.concat(tensors, dim, out)
    except TypeError:
        _as_tensors("concat", tensors)  # a clear message instead of pybind11's
        raise


def pack(tensors: Sequence[torch.Tensor], out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, PackLayout]:
    """Copy ``tensors`` into one 1-D uint8 buffer; return ``(buffer, layout)``.

    Any dtype and shape (0-d and empty included), contiguous or not; all on one
    device (the buffer's). Each entry starts on a ``PACK_ALIGNMENT``-byte
    boundary. Send ``buffer`` and ``layout.to_tensor()`` and rebuild the
    tensors on the other side with :func:`unpack`. ``out`` (a contiguous 1-D
    uint8 tensor of at least ``layout.nbytes`` bytes) lets a sender reuse one
    buffer across steps instead of allocating one per message; the returned
    buffer is then ``out`` itself. Not differentiable.
    """
    if isinstance(tensors, torch.Tensor):
        _as_tensors("pack", tensors)
    try:
        return _C.pack(tensors, out)
    except TypeError:
        _as_tensors("pack", tensors)
        raise


def unpack(buffer: torch.Tensor, layout: PackLayout) -> List[torch.Tensor]:
    """Tensors described by ``layout`` as views sharing ``buffer``'s storage (no copy).

    Writing to a returned tensor writes the buffer. The layout is validated
    against the buffer first (size, offsets, alignment). Not differentiable.
    """
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"unpack: buffer must be a tensor, got {type(buffer).__name__}")
    if not isinstance(layout, PackLayout):
        raise TypeError(f"unpack: layout must be a PackLayout, got {type(layout).__name__}")
    return _C.unpack(buffer, layout)
