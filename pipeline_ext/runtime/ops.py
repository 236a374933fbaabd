"""Tensor kernels of the pipeline: microbatch split/merge and message packing.

Why they exist: every pipeline step splits its batch into microbatches, merges
the outputs again, and sends several tensors per microbatch to a peer. Doing
that with ``torch.tensor_split(...)[i].contiguous()`` per piece, ``torch.cat``
and one message per tensor costs one copy (and one kernel launch) per piece or
per tensor. The C++ kernels here move all bytes of one call in ONE pass
(one parallel memcpy region on CPU, one kernel launch on CUDA):

- :func:`split` returns contiguous pieces: views when the layout allows (no copy
  at all), otherwise fresh tensors filled by one copy pass.
- :func:`concat` writes every input into one (preallocated or given) output.
- :func:`pack` / :func:`unpack` turn a list of tensors of any dtypes and shapes
  into one byte buffer plus a :class:`PackLayout`, and back into views of the
  buffer, so several tensors travel to a peer as one message.

Results equal ``torch.tensor_split`` / ``torch.cat`` exactly. :func:`split` and
:func:`concat` are differentiable (their backward is the other op);
:func:`pack` / :func:`unpack` are not (they move bytes for communication, and
the runtime attaches gradients at stage boundaries itself).

The kernels are torch custom ops, ``torch.ops.pipeline_ext.*`` (schemas and
CPU/CUDA kernels in C++, ``csrc/ops.cpp``; fake kernels and autograd formulas
registered below), so ``torch.compile``, FakeTensor and ``torch.export`` see
through these functions: ``split_copy`` (split's copying case), ``concat``,
``concat_out``, ``pack``, ``pack_out`` and ``unpack`` (composite: views of the
buffer). An op with a kernel of its own may not return views of its inputs (nor
outputs sharing memory), so split's zero-copy case is ``torch.split_with_sizes``,
outside the ops. This
module is their one Python face.
"""
from __future__ import annotations

import math
import operator
import sys
from typing import Callable, List, NoReturn, Optional, Sequence, Tuple

import torch

from pipeline_ext.runtime import dtensor_wire
from pipeline_ext.runtime._ext import _C

#: The custom ops (registered when ``_C`` loads): split_copy, concat, concat_out,
#: pack, pack_out, unpack.
_ops = torch.ops.pipeline_ext

__all__ = ["split", "concat", "pack", "unpack", "PackLayout", "even_sizes", "PACK_ALIGNMENT", "movable",
           "unmovable_reason", "check_movable", "explain_unmovable", "raise_named"]

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


# ---------------------------------------------------------------- what the core can read
# [Note: tensors the core can read]
# The C++ core reads a tensor's bytes at its data pointer with its strides:
# pack, every channel's send, the kernels' copy passes. That holds for a plain
# dense (strided) CPU/CUDA tensor, and for subclasses that only override
# __torch_function__ (nn.Parameter). It does not for a subclass that dispatches
# in Python (DTensor, FakeTensor, a __torch_dispatch__ wrapper, a jagged
# NestedTensor: a wrapper whose own data pointer may be null), nor for sparse,
# nested, quantized or meta tensors. The C++ side refuses them where it reads
# memory (csrc/kernels/copy.h, check_readable: a TypeError, never a crash);
# this is the Python side of the same rule, which can name the argument, the
# Python type and what to do. ``movable`` is the per-message test (a few flag
# reads); the rest runs only for a tensor that fails it, or after a failure.

_STRIDED = torch.strided


def movable(t: torch.Tensor) -> bool:
    """True for a plain dense tensor the core reads directly; False means: ask ``unmovable_reason``."""
    return type(t) is torch.Tensor and t.layout is _STRIDED and not (t.is_quantized or t.is_nested or t.is_meta)


def _is_a(t: torch.Tensor, module: str, name: str) -> bool:
    """isinstance(t, module.name) without importing ``module`` (a tensor of that class means it is imported)."""
    cls = getattr(sys.modules.get(module), name, None)
    return cls is not None and isinstance(t, cls)


def unmovable_reason(t: torch.Tensor) -> Optional[str]:
    """What ``t`` is and what to do instead, when the core cannot read its memory (see the note above); else None."""
    if movable(t):
        return None
    if _is_a(t, "torch.distributed.tensor", "DTensor"):
        return ("a DTensor: the core moves plain tensors. A PipelineStage passes DTensor outputs between stages "
                "(their local shards, rebuilt on the next stage's mesh) and split/concat cut DTensors; anywhere "
                "else (the Pipe, a channel) return .to_local() (this rank's shard) or .full_tensor() (the whole "
                "tensor) and rebuild the DTensor in the next stage (DTensor.from_local)")
    if _is_a(t, "torch._subclasses.fake_tensor", "FakeTensor"):
        return "a FakeTensor, which has no data: run the pipeline on real tensors (outside FakeTensorMode)"
    if t.is_nested:
        return (f"a nested tensor (layout {t.layout}): pipeline_ext moves dense tensors; pass a padded one "
                "(.to_padded_tensor(0)) or its values and offsets as plain tensors")
    if torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python):
        return (f"a {type(t).__module__}.{type(t).__qualname__}, a tensor subclass that dispatches in Python "
                "(__torch_dispatch__), whose memory is not its data: pass a plain torch.Tensor (unwrap it)")
    if t.layout is not _STRIDED:
        return f"a {t.layout} tensor: pipeline_ext moves dense tensors; pass .to_dense()"
    if t.is_quantized:
        return f"a quantized tensor ({t.dtype}): pipeline_ext moves plain tensors; pass .dequantize()"
    if t.is_meta:
        return "a meta tensor, which has no data: run the pipeline on real tensors"
    if t.device.type not in ("cpu", "cuda"):
        return f"a tensor on {t.device}: pipeline_ext's core moves CPU and CUDA tensors"
    return None  # a subclass that only overrides __torch_function__ (nn.Parameter): its memory is its data


def check_movable(t: torch.Tensor, what: str) -> None:
    """TypeError naming ``what`` (e.g. "stage 0's output 1, microbatch 2") unless the core can read ``t``."""
    reason = unmovable_reason(t)
    if reason is not None:
        raise TypeError(f"{what} is {reason}")


def explain_unmovable(op: str, tensors: Sequence[object],
                      name: Callable[[int], str] = lambda i: f"tensor {i}") -> Optional[TypeError]:
    """After ``op`` failed on ``tensors``: the TypeError naming the first one the core cannot read, if any.

    Failure paths call it (``raise err from exc``), so a call that succeeds
    pays nothing: the dispatcher already handles subclasses and layouts it can
    (FakeTensor, __torch_dispatch__ wrappers run the ops through their own
    dispatch), and refuses the others with messages that name no argument.
    """
    for i, t in enumerate(tensors):
        if isinstance(t, torch.Tensor):
            reason = unmovable_reason(t)
            if reason is not None:
                return TypeError(f"{op}: {name(i)} is {reason}")
    return None


def raise_named(exc: BaseException, err: Optional[BaseException]) -> NoReturn:
    """Raise ``err`` (caused by ``exc``) where it names what failed (``explain_unmovable``); else ``exc`` as it was.

    What every failure path that names an argument ends with, inside its ``except`` clause.
    """
    if err is None or err is exc:
        raise exc
    raise err from exc


def _unmovable_in(op: str, tensors: object, out: Optional[torch.Tensor]) -> Optional[TypeError]:
    """``explain_unmovable`` for an op's tensor list (whatever the caller passed) and its ``out``."""
    items = list(tensors) if isinstance(tensors, (list, tuple)) else []
    return explain_unmovable(op, [*items, out], lambda i: "out" if i == len(items) else f"tensor {i}")


def _as_sizes(sizes: Sequence[int], symbolic: bool = False) -> List[int]:
    """``sizes`` as a list of ints; ``symbolic`` also keeps SymInts (sizes traced
    by torch.compile with dynamic shapes)."""
    if isinstance(sizes, int) or not isinstance(sizes, (list, tuple, torch.Size)):
        raise TypeError(
            f"split: sizes must be a list or tuple of ints, got {type(sizes).__name__}; "
            "for n near-equal pieces use even_sizes(tensor.shape[dim], n)"
        )
    try:
        if symbolic:
            return [s if isinstance(s, torch.SymInt) else operator.index(s) for s in sizes]
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


def _views_suffice(tensor: torch.Tensor, sizes: List[int], dim: int) -> bool:
    """Whether every piece of a valid split is contiguous as a view of ``tensor``.

    That is a contiguous tensor whose dimensions before ``dim`` are all 1 (or
    a split into at most one non-empty piece). Invalid arguments give False:
    the custom op then rejects them with its error naming the problem. The
    eager path decides in C++ (``split_gives_views``); this mirror is for
    traced calls, where shapes may be symbolic.
    """
    ndim = tensor.dim()
    if ndim == 0 or not sizes or not -ndim <= dim < ndim:
        return False
    d = dim % ndim
    if any(s < 0 for s in sizes) or sum(sizes) != tensor.shape[d] or not tensor.is_contiguous():
        return False
    return math.prod(tensor.shape[:d]) == 1 or sum(1 for s in sizes if s > 0) <= 1 or tensor.numel() == 0


# Each function below enters its op one of two ways: in eager mode through
# _C's entry points (a few microseconds cheaper per call, see csrc/ops.h), and
# under torch.compile / export through torch.ops.pipeline_ext.*, which dynamo
# can trace (it cannot trace pybind11). Both reach the ops through the
# dispatcher: the same kernels, autograd formulas and fake kernels.

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _is_dtensor(t: object) -> bool:
    """A DTensor (checked off the plain path only: torch.distributed.tensor is imported on first use)."""
    return type(t).__name__ == "DTensor" and isinstance(t, dtensor_wire.dtensor_type())


def split(tensor: torch.Tensor, sizes: Sequence[int], dim: int = 0) -> List[torch.Tensor]:
    """Split ``tensor`` along ``dim`` into contiguous pieces of the given ``sizes``.

    ``sizes`` must sum to ``tensor.shape[dim]`` (use :func:`even_sizes` for
    tensor_split's uneven distribution). The pieces are views of ``tensor``
    when they are contiguous as views (contiguous input and every dimension
    before ``dim`` of size 1, e.g. splitting a batch on dim 0: that is
    ``torch.split_with_sizes``); otherwise they are fresh tensors written by
    ONE copy pass (the custom op ``torch.ops.pipeline_ext.split_copy``).
    Differentiable.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"split: expected a tensor, got {type(tensor).__name__}")
    # Tensor subclasses (FakeTensor, FunctionalTensor: AOTAutograd tracing a
    # backward) may have symbolic shapes, which call_split cannot read.
    try:
        if type(tensor) in _PLAIN and not torch.compiler.is_compiling():
            return _C.call_split(tensor, _as_sizes(sizes), dim)
        if _is_dtensor(tensor):  # its local shard is split ([Note: splitting a DTensor into microbatches])
            return dtensor_wire.split_dtensor(tensor, _as_sizes(sizes), dim, split)
        sizes = _as_sizes(sizes, symbolic=True)
        if _views_suffice(tensor, sizes, dim):
            return list(torch.split_with_sizes(tensor, sizes, dim))
        return _ops.split_copy.default(tensor, sizes, dim)
    except Exception as exc:
        if _is_dtensor(tensor):  # split_dtensor's own error says why: a DTensor is not "unmovable" here
            raise
        raise_named(exc, explain_unmovable("split", [tensor], lambda i: "the tensor"))


def concat(tensors: Sequence[torch.Tensor], dim: int = 0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Concatenate ``tensors`` along ``dim`` in one copy pass (like ``torch.cat``).

    All tensors need the same dtype, device and shape except along ``dim``
    (no type promotion: a silent upcast would hide a pipeline bug). ``out``, if
    given, must already have the result's shape, dtype and device and is
    written in place (its storage is kept). Differentiable when ``out`` is None.
    """
    if isinstance(tensors, torch.Tensor):  # pybind11 would iterate its rows
        _as_tensors("concat", tensors)
    if out is not None and _needs_grad("concat", tensors):
        raise RuntimeError(
            "concat: out= is not differentiable, but an input requires grad; "
            "drop out= or run under torch.no_grad()"
        )
    if out is None and isinstance(tensors, (list, tuple)) and tensors and _is_dtensor(tensors[0]):
        return dtensor_wire.concat_dtensors(tensors, dim, concat)
    try:
        if not torch.compiler.is_compiling():  # FakeTensors etc. are fine: call_concat reads no shape
            try:
                return _C.call_concat(tensors, dim, out)
            except TypeError:
                _as_tensors("concat", tensors)  # a clear message instead of pybind11's
                raise
        tensors = _as_tensors("concat", tensors)
        if not tensors:  # with no tensor the dispatcher could not pick a kernel to say so
            raise ValueError("concat: expected a non-empty list of tensors")
        if out is None:
            return _ops.concat.default(tensors, dim)
        _ops.concat_out.default(tensors, dim, out)
        return out
    except Exception as exc:
        raise_named(exc, _unmovable_in("concat", tensors, out))


def pack(tensors: Sequence[torch.Tensor], out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, PackLayout]:
    """Copy ``tensors`` into one 1-D uint8 buffer; return ``(buffer, layout)``.

    Any dtype and shape (0-d and empty included), contiguous or not; all on one
    device (the buffer's). Each entry starts on a ``PACK_ALIGNMENT``-byte
    boundary (the gaps are zeroed). Send ``buffer`` and ``layout.to_tensor()``
    and rebuild the tensors on the other side with :func:`unpack`. ``out`` (a
    contiguous 1-D uint8 tensor of at least ``layout.nbytes`` bytes) lets a
    sender reuse one buffer across steps instead of allocating one per
    message; the returned buffer is then ``out`` itself. Not differentiable.
    The layout (a C++ object) cannot be traced: inside torch.compile this is a
    graph break; ``torch.ops.pipeline_ext.pack`` itself traces.
    """
    if isinstance(tensors, torch.Tensor):  # pybind11 would iterate its rows
        _as_tensors("pack", tensors)
    try:
        return _C.call_pack(tensors, out)
    except Exception as exc:
        if isinstance(exc, TypeError):
            _as_tensors("pack", tensors)  # a clear message instead of pybind11's
        raise_named(exc, _unmovable_in("pack", tensors, out))


def unpack(buffer: torch.Tensor, layout: PackLayout) -> List[torch.Tensor]:
    """Tensors described by ``layout`` as views sharing ``buffer``'s storage (no copy).

    Writing to a returned tensor writes the buffer. The layout is validated
    against the buffer first (size, offsets, alignment). Not differentiable.
    Traced code can call ``torch.ops.pipeline_ext.unpack(buffer, layout.encode())``.
    """
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"unpack: buffer must be a tensor, got {type(buffer).__name__}")
    if not isinstance(layout, PackLayout):
        raise TypeError(f"unpack: layout must be a PackLayout, got {type(layout).__name__}")
    return _C.call_unpack(buffer, layout)


# ---------------------------------------------------------------- fake kernels
# What each op returns, computed from metadata only (FakeTensor, torch.compile,
# export). tests/runtime/test_custom_ops.py checks them against the real kernels.


def _wrap_dim(op: str, dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise IndexError(f"{op}: dim {dim} is out of range for a tensor with {ndim} dimensions")
    return dim % ndim


def _with_size(shape: Sequence[int], dim: int, size: int) -> List[int]:
    return [*shape[:dim], size, *shape[dim + 1:]]


@torch.library.register_fake("pipeline_ext::split_copy")
def _split_copy_fake(tensor: torch.Tensor, sizes: List[int], dim: int) -> List[torch.Tensor]:
    torch._check_value(tensor.dim() > 0, lambda: "split: cannot split a 0-d tensor")
    d = _wrap_dim("split", dim, tensor.dim())
    torch._check_value(len(sizes) > 0, lambda: "split: sizes is empty")
    for s in sizes:
        torch._check_value(s >= 0, lambda: f"split: sizes {sizes} has a negative size")
    torch._check_value(sum(sizes) == tensor.shape[d], lambda: f"split: sizes {sizes} do not sum to the size of dim {d}")
    return [tensor.new_empty(_with_size(tensor.shape, d, s)) for s in sizes]


def _concat_shape(tensors: Sequence[torch.Tensor], dim: int) -> List[int]:
    torch._check_value(len(tensors) > 0, lambda: "concat: expected a non-empty list of tensors")
    ref = tensors[0]
    torch._check_value(ref.dim() > 0, lambda: "concat: zero-dimensional tensors cannot be concatenated")
    d = _wrap_dim("concat", dim, ref.dim())
    for i, t in enumerate(tensors):
        torch._check_type(t.dtype == ref.dtype, lambda: f"concat: tensor {i} has dtype {t.dtype}, not {ref.dtype}")
        torch._check_value(t.dim() == ref.dim(), lambda: f"concat: tensor {i} has {t.dim()} dimensions")
        for k in range(ref.dim()):
            if k != d:
                torch._check_value(t.shape[k] == ref.shape[k], lambda: f"concat: tensor {i} differs in dim {k}")
    return _with_size(ref.shape, d, sum(t.shape[d] for t in tensors))


@torch.library.register_fake("pipeline_ext::concat")
def _concat_fake(tensors: List[torch.Tensor], dim: int) -> torch.Tensor:
    return tensors[0].new_empty(_concat_shape(tensors, dim))


@torch.library.register_fake("pipeline_ext::concat_out")
def _concat_out_fake(tensors: List[torch.Tensor], dim: int, out: torch.Tensor) -> None:
    torch._check_value(list(out.shape) == _concat_shape(tensors, dim), lambda: "concat: out has the wrong shape")


def _packed_nbytes(tensors: Sequence[torch.Tensor]) -> int:
    """``PackLayout.nbytes`` of ``tensors``: each non-empty one at the next aligned offset."""
    nbytes = 0
    for t in tensors:
        if t.numel() != 0:
            nbytes = -(-nbytes // PACK_ALIGNMENT) * PACK_ALIGNMENT + t.numel() * t.element_size()
    return nbytes


@torch.library.register_fake("pipeline_ext::pack")
def _pack_fake(tensors: List[torch.Tensor]) -> torch.Tensor:
    return torch.empty(_packed_nbytes(tensors), dtype=torch.uint8, device=tensors[0].device)


@torch.library.register_fake("pipeline_ext::pack_out")
def _pack_out_fake(tensors: List[torch.Tensor], out: torch.Tensor) -> None:
    torch._check_value(out.numel() >= _packed_nbytes(tensors), lambda: "pack: out is smaller than the layout")


# ---------------------------------------------------------------- autograd
# split_copy and concat are each other's backward. The backward calls the
# public functions, which are differentiable themselves (double backward).


def _split_copy_setup(ctx, inputs, output) -> None:
    tensor, _, dim = inputs
    ctx.dim = dim
    ctx.shapes = [o.shape for o in output]
    ctx.dtype, ctx.device = tensor.dtype, tensor.device


def _split_copy_backward(ctx, grads):
    # A piece nothing used may arrive as None: its gradient is zero.
    grads = [g if g is not None else torch.zeros(s, dtype=ctx.dtype, device=ctx.device)
             for g, s in zip(grads, ctx.shapes)]
    return concat(grads, ctx.dim), None, None


def _concat_setup(ctx, inputs, output) -> None:
    tensors, dim = inputs
    ctx.dim = dim % tensors[0].dim()
    ctx.sizes = [t.shape[ctx.dim] for t in tensors]


def _concat_backward(ctx, grad: torch.Tensor):
    return split(grad, ctx.sizes, ctx.dim), None


torch.library.register_autograd("pipeline_ext::split_copy", _split_copy_backward, setup_context=_split_copy_setup)
torch.library.register_autograd("pipeline_ext::concat", _concat_backward, setup_context=_concat_setup)
