"""Split a step's inputs into microbatches and merge the microbatch outputs back.

A pipeline step receives the whole batch as arbitrary ``(args, kwargs)`` pytrees.
Every schedule works on microbatches, so this module is the one place that
decides how a pytree is cut (which tensors, along which dim, how uneven batches
are shared out) and how per-microbatch outputs are glued back together.

Unlike ``torch.distributed.pipelining``, a batch that does not divide evenly is
allowed: rows are shared out like ``torch.tensor_split`` does (10 rows into 4
microbatches gives 3, 3, 2, 2), and ``microbatch_weights`` tells the loss code
each microbatch's share of the rows so that gradients still equal those of the
whole batch. Asking for more microbatches than rows is an error.

Within one step, microbatch k of every input, keyword argument and target
holds the same rows of the batch, whatever kind of tensor each one is: a
DTensor is cut by its global rows like a plain tensor, a ``Shard(0)`` one
included (``ops.split``; [Note: splitting a DTensor into microbatches] in
``runtime/dtensor_wire.py``), and outputs merge back in the batch's order.

Specs may be ours or torch's (``torch.distributed.pipelining.microbatch``'s
``TensorChunkSpec``, ``_Replicate``, and for merging ``_CustomReducer``), and
torch's helper ``split_args_kwargs_into_chunks`` has its signature here, so
torch code keeps working with one import changed.

The byte moving is done by the C++ kernels in ``pipeline_ext.runtime.ops``.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch.utils import _pytree as pytree

from pipeline_ext.runtime import ops

__all__ = [
    "TensorChunkSpec",
    "Replicate",
    "REPLICATE",
    "Reduce",
    "split_args_kwargs",
    "split_args_kwargs_into_chunks",
    "merge_chunks",
    "microbatch_sizes",
    "target_sizes",
    "microbatch_weights",
    "loss_weights",
    "split_target",
    "split_step_inputs",
    "split_step_target",
    "given_microbatches",
    "given_targets",
    "split_rank_kwargs",
    "given_rank_kwargs",
    "to_device",
]


@dataclass(frozen=True)
class TensorChunkSpec:
    """Split this tensor along ``dim`` (the default for every tensor is dim 0)."""

    dim: int = 0

    @property
    def split_dim(self) -> int:  # torch's name
        return self.dim

    @staticmethod
    def from_tuple(chunk_dims: tuple[int, ...]) -> tuple["TensorChunkSpec", ...]:
        """One spec per positional argument, as torch's ``TensorChunkSpec.from_tuple``."""
        return tuple(TensorChunkSpec(d) for d in chunk_dims)

    @staticmethod
    def from_dict(chunk_dims: dict[str, int]) -> dict[str, "TensorChunkSpec"]:
        """One spec per keyword argument, as torch's ``TensorChunkSpec.from_dict``."""
        return {k: TensorChunkSpec(d) for k, d in chunk_dims.items()}


@dataclass(frozen=True)
class Replicate:
    """Give every microbatch the whole value (e.g. a mask shared by all rows)."""


REPLICATE = Replicate()


@dataclass(frozen=True)
class Reduce:
    """Merge microbatch outputs with ``reduce_fn`` from ``init_value`` (torch's ``_CustomReducer``)."""

    init_value: Any
    reduce_fn: Callable[[Any, Any], Any]


_Spec = Any  # TensorChunkSpec | Replicate | Reduce | int | None (or torch's classes), or a pytree of those
_LEAF_HELP = "TensorChunkSpec, Replicate, an int dim or None (or torch's TensorChunkSpec, _Replicate, _CustomReducer)"


def _torch_leaf(spec: Any) -> Any:
    """torch.distributed.pipelining's spec objects as ours (duck-typed: nothing of torch's is imported)."""
    if spec is None or isinstance(spec, (bool, int, TensorChunkSpec, Replicate, Reduce)):
        return spec
    if isinstance(spec, type) and spec.__name__ == "_Replicate" or type(spec).__name__ == "_Replicate":
        return REPLICATE
    if isinstance(getattr(spec, "split_dim", None), int):
        return TensorChunkSpec(spec.split_dim)
    if hasattr(spec, "init_value") and callable(getattr(spec, "reduce_fn", None)):
        return Reduce(spec.init_value, spec.reduce_fn)
    return spec


def _leaf_spec(spec: Any) -> TensorChunkSpec | Replicate | Reduce:
    """Normalise one spec leaf: an int means a dim, None means the default (dim 0)."""
    spec = _torch_leaf(spec)
    if spec is None:
        return TensorChunkSpec(0)
    if isinstance(spec, bool):
        raise TypeError(f"chunk spec leaf must be {_LEAF_HELP}, got {spec!r}")
    if isinstance(spec, int):
        return TensorChunkSpec(spec)
    if isinstance(spec, (TensorChunkSpec, Replicate, Reduce)):
        return spec
    raise TypeError(f"chunk spec leaf must be {_LEAF_HELP}, got {spec!r}")


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (int, TensorChunkSpec, Replicate, Reduce)) or _torch_leaf(x) is not x


def _flat_specs(values: Any, spec: _Spec, what: str) -> list[TensorChunkSpec | Replicate | Reduce]:
    """One spec per leaf of ``values``; a single spec leaf applies to the whole subtree."""
    n_leaves = len(pytree.tree_leaves(values))
    if _is_spec_leaf(spec):
        return [_leaf_spec(spec)] * n_leaves
    spec_leaves, spec_tree = pytree.tree_flatten(spec, is_leaf=_is_spec_leaf)
    _, value_tree = pytree.tree_flatten(values)
    if spec_tree != value_tree:
        raise ValueError(
            f"chunk spec for {what} does not match its structure: spec is {spec_tree}, {what} is {value_tree}"
        )
    return [_leaf_spec(s) for s in spec_leaves]


class _LeafName:
    """A leaf's name as the caller wrote it (``args[1]``, ``kwargs['mask']``, ``target['labels']``).

    Worked out (a pytree walk with paths) only when an error prints it: the
    names are built per leaf per step, the text almost never.
    """

    __slots__ = ("what", "values", "i")

    def __init__(self, what: str, values: Any, i: int) -> None:
        self.what, self.values, self.i = what, values, i

    def __str__(self) -> str:
        path = pytree.tree_flatten_with_path(self.values)[0][self.i][0]
        if self.what == "target":  # the target is split as the one positional argument (target,)
            path = path[1:]
        return self.what + pytree.keystr(path)


def _rows(t: torch.Tensor, spec: TensorChunkSpec, where: Any) -> int:
    if t.dim() == 0:
        raise ValueError(f"cannot split 0-d tensor {where} into microbatches; mark it Replicate()")
    dim = spec.dim if spec.dim >= 0 else spec.dim + t.dim()
    try:
        shape = t.shape
    except RuntimeError as exc:  # a strided nested tensor has no shape
        ops.raise_named(exc, _unsplittable(t, where, exc))
    if not 0 <= dim < t.dim():
        raise ValueError(f"chunk dim {spec.dim} is out of range for {where} with shape {tuple(shape)}")
    return shape[dim]


def _unsplittable(t: torch.Tensor, where: Any, exc: Exception) -> Optional[Exception]:
    """After splitting ``t`` (``where``) failed with ``exc``: the error naming it when the core cannot read it, or
    ``exc`` with its name when it is a DTensor (which splits: [Note: splitting a DTensor into microbatches]);
    else None."""
    if ops._is_dtensor(t):
        return _said(exc, f"cannot split {where} (a DTensor with placements {tuple(t.placements)}) into "
                          f"microbatches: {exc}")
    return ops.explain_unmovable(f"cannot split {where} into microbatches", [t], lambda i: "it")


def _said(exc: Exception, text: str) -> Exception:
    """``exc``'s message as ``text`` (which names what failed), as a TypeError, ValueError or RuntimeError (an
    exception class of torch's may not take a lone message)."""
    return next((cls(text) for cls in (TypeError, ValueError) if isinstance(exc, cls)), None) or RuntimeError(text)


def _split_leaf(x: Any, spec: TensorChunkSpec | Replicate | Reduce, n: int, where: Any) -> list[Any]:
    if isinstance(spec, Reduce):
        raise TypeError(f"{where}: a reducer is a merge spec (output_merge_spec), not a way to split inputs")
    if not isinstance(x, torch.Tensor) or isinstance(spec, Replicate):
        return [x] * n
    rows = _rows(x, spec, where)
    if rows == 0:
        raise ValueError(f"{where} has 0 rows along dim {spec.dim} (shape {tuple(x.shape)}): every microbatch "
                         "needs at least one row")
    if n > rows:
        raise ValueError(
            f"cannot split {where} with {rows} rows along dim {spec.dim} into {n} microbatches: "
            f"n_microbatches must not exceed the batch size"
        )
    try:
        return list(ops.split(x, ops.even_sizes(rows, n), dim=spec.dim))
    except Exception as exc:
        ops.raise_named(exc, _unsplittable(x, where, exc))


def split_args_kwargs(
    args: Sequence[Any],
    kwargs: dict[str, Any] | None,
    n_microbatches: int,
    chunk_spec: tuple[_Spec, _Spec] | None = None,
    args_name: str = "args",
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
    """Split ``(args, kwargs)`` into ``n_microbatches`` pieces (errors call ``args`` ``args_name``).

    Tensors are split along dim 0 unless ``chunk_spec`` (a pair ``(args_spec,
    kwargs_spec)``, each a pytree of ``TensorChunkSpec`` / ``Replicate`` / int
    dims, or one leaf for a whole subtree) says otherwise; non-tensors are
    replicated. Returns ``(args_chunks, kwargs_chunks)``, two lists of length
    ``n_microbatches``, like torch's ``split_args_kwargs_into_chunks``. The
    caller's objects are not modified.
    """
    if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ValueError(f"n_microbatches must be a positive int, got {n_microbatches!r}")
    args = tuple(args)
    kwargs = dict(kwargs or {})
    args_spec, kwargs_spec = chunk_spec if chunk_spec is not None else (None, None)
    if args_spec is None and kwargs_spec is None and not kwargs and args and all(
            isinstance(a, torch.Tensor) for a in args):
        # the common step: a few tensors split along dim 0 (no pytree walk: it cost more than the split)
        pieces = [_split_leaf(x, _leaf_spec(None), n_microbatches, _LeafName(args_name, args, i))
                  for i, x in enumerate(args)]
        return list(zip(*pieces)), [{} for _ in range(n_microbatches)]
    per_part = []
    for what, values, spec in ((args_name, args, args_spec), ("kwargs", kwargs, kwargs_spec)):
        leaves, tree = pytree.tree_flatten(values)
        specs = _flat_specs(values, spec, what)
        pieces = [_split_leaf(x, s, n_microbatches, _LeafName(what, values, i))
                  for i, (x, s) in enumerate(zip(leaves, specs))]
        per_part.append(_rebuild(values, leaves, pieces, tree, n_microbatches))
    return per_part[0], per_part[1]


def _rebuild(values: Any, leaves: list[Any], pieces: list[list[Any]], tree: Any, n: int) -> list[Any]:
    """Microbatch ``k`` of ``values`` from each leaf's ``pieces[i][k]``.

    A flat tuple of arguments or dict of keyword arguments (every entry is
    itself a leaf: the common case) is rebuilt directly: ``tree_unflatten``
    per microbatch cost most of a step's split at 32 microbatches.
    """
    if not values and type(values) in (tuple, dict):
        return [type(values)() for _ in range(n)]
    if type(values) is tuple and len(leaves) == len(values) and all(a is b for a, b in zip(leaves, values)):
        return list(zip(*pieces))
    if (type(values) is dict and len(leaves) == len(values)
            and all(a is b for a, b in zip(leaves, values.values()))):  # pytree flattens a dict in insertion order
        keys = list(values)
        return [dict(zip(keys, chunk)) for chunk in zip(*pieces)]
    return [pytree.tree_unflatten([p[k] for p in pieces], tree) for k in range(n)]


def split_args_kwargs_into_chunks(
    args: Sequence[Any],
    kwargs: dict[str, Any] | None,
    chunks: int,
    args_chunk_spec: _Spec = None,
    kwargs_chunk_spec: _Spec = None,
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
    """torch's signature for :func:`split_args_kwargs` (uneven batches allowed here)."""
    return split_args_kwargs(args, kwargs, chunks, (args_chunk_spec, kwargs_chunk_spec))


def microbatch_sizes(
    args: Sequence[Any],
    kwargs: dict[str, Any] | None,
    n_microbatches: int,
    chunk_spec: tuple[_Spec, _Spec] | None = None,
    args_name: str = "args",
) -> list[int]:
    """Rows per microbatch: the distribution ``split_args_kwargs`` uses, computed without touching any data.

    Errors call the positional arguments ``args_name`` (``target_sizes``: "target").

    The rows are those of the first tensor that is split (the batch). Each
    tensor is split on its own, as torch's ``split_args_kwargs_into_chunks``
    does: one whose rows differ from the batch's (a keyword argument with one
    row per microbatch beside a 64-row batch) is cut into ``n_microbatches``
    parts of its own rows, and its part ``k`` goes with microbatch ``k``. That
    is accepted with a ``UserWarning`` naming the inputs (rows that differ by
    mistake would be paired silently; a tensor that is not per-row is marked
    ``Replicate()`` in the chunk spec). Refused: a split tensor with fewer rows
    than microbatches (some microbatch would get none; torch would cut every
    input into fewer parts than the schedule runs).
    """
    found = _split_rows(args, kwargs, chunk_spec, args_name)
    if not found:
        raise ValueError("no tensor to split into microbatches: pass at least one tensor input")
    (first, rows), *rest = found
    for where, r in found:
        if r == 0:
            raise ValueError(f"{where} has 0 rows: every microbatch needs at least one row")
        if n_microbatches > r:
            raise ValueError(
                f"cannot split {where} with {r} rows into {n_microbatches} microbatches: "
                f"n_microbatches must not exceed the batch size"
                + (f" (each input is split on its own; {first}, the batch, has {rows} rows)" if r != rows else "")
            )
    differ = [(where, r) for where, r in rest if r != rows]
    if differ:
        cut = "; ".join(f"{where}: {r} rows into {_parts(r, n_microbatches)}" for where, r in [(first, rows)] + differ)
        warnings.warn(
            f"pipeline_ext: the inputs split into microbatches have different numbers of rows, so each is cut "
            f"into {n_microbatches} parts on its own, as torch does, and part k of each goes to microbatch k "
            f"({cut}); loss weights follow {first}, the batch. Mark an input that is not per-row Replicate() "
            "in the chunk spec", UserWarning, stacklevel=3)
    return ops.even_sizes(rows, n_microbatches)


def _split_rows(args: Sequence[Any], kwargs: dict[str, Any] | None, chunk_spec: tuple[_Spec, _Spec] | None,
                args_name: str) -> list[tuple[_LeafName, int]]:
    """Each tensor the chunk spec splits, named, with its rows along its split dim, in argument order."""
    args_spec, kwargs_spec = chunk_spec if chunk_spec is not None else (None, None)
    found: list[tuple[_LeafName, int]] = []  # (which leaf, its rows)
    for what, values, spec in ((args_name, tuple(args), args_spec), ("kwargs", dict(kwargs or {}), kwargs_spec)):
        leaves = pytree.tree_leaves(values)
        for i, (x, s) in enumerate(zip(leaves, _flat_specs(values, spec, what))):
            if isinstance(x, torch.Tensor) and isinstance(s, TensorChunkSpec):
                name = _LeafName(what, values, i)
                found.append((name, _rows(x, s, name)))
    return found


def _parts(rows: int, n: int) -> str:
    """How ``rows`` split into ``n`` parts, in words: "8 parts of 1 row", "2 of 4 and 1 of 3 rows"."""
    sizes = ops.even_sizes(rows, n)
    counts = [(size, sizes.count(size)) for size in dict.fromkeys(sizes)]
    return " and ".join(f"{c} of {size}" for size, c in counts) + (" row" if sizes == [1] * n else " rows")


def target_sizes(target: Any, n_microbatches: int) -> list[int]:
    """Rows per microbatch of the loss target (a tensor or pytree), as ``microbatch_sizes`` counts a batch's."""
    return microbatch_sizes((target,), {}, n_microbatches, args_name="target")


def microbatch_weights(sizes: Sequence[int]) -> list[float]:
    """Each microbatch's share of the batch's rows.

    Weighting microbatch ``i``'s mean-reduced loss by ``sizes[i] / sum(sizes)``
    makes the summed gradient equal the gradient of the whole batch's mean loss,
    even when the microbatches are uneven.
    """
    total = sum(sizes)
    return [s / total for s in sizes]


def loss_weights(loss_fn: Any, sizes: Sequence[int], targets: Sequence[Any],
                 scale_grads: bool = True) -> list[Union[float, torch.Tensor]]:
    """Weight of each microbatch's loss in backward (used by the schedules and ``Pipe``).

    ``scale_grads=False``: 1 each (a plain sum, as torch). A loss over
    sequence pieces weighs its units itself (``piece_weights``: each
    microbatch's weight shared out over its pieces). Else the loss
    function's own ``microbatch_weights(targets)`` when it has one and the
    targets are here (the last stage), else each microbatch's share of rows.
    Weights given as a tensor come back as 0-d tensors (never read on the host).
    """
    pieces = getattr(loss_fn, "piece_weights", None)  # sequence pieces (pipelining/seq_pieces.py)
    if pieces is not None and targets:
        return pieces(sizes, list(targets), scale_grads)
    if not scale_grads:
        return [1.0] * len(sizes)
    own = getattr(loss_fn, "microbatch_weights", None)
    if own is not None and targets:
        given = own(list(targets))
        # A tensor of weights stays one (0-d tensors, on its device): reading it into floats would make
        # the host wait for the GPU at every step, before the first forward could be queued.
        weights = list(given.unbind(0)) if isinstance(given, torch.Tensor) else [float(w) for w in given]
        if len(weights) != len(sizes):
            raise ValueError(f"{type(loss_fn).__name__}.microbatch_weights returned {len(weights)} weights "
                             f"for {len(sizes)} microbatches")
        return weights
    return microbatch_weights(sizes)


def _merge_leaf(values: list[Any], spec: TensorChunkSpec | Replicate | Reduce, name: Callable[[], str]) -> Any:
    """One output's microbatch values merged; ``name()`` (worked out on failure only) says which output."""
    if isinstance(spec, Reduce):
        return functools.reduce(spec.reduce_fn, values, spec.init_value)
    first = values[0]
    if isinstance(first, torch.Tensor):
        if isinstance(spec, Replicate):
            return first
        try:
            if first.dim() == 0:
                return torch.stack(values)
            return ops.concat(values, dim=spec.dim)
        except Exception as exc:
            ops.raise_named(exc, _merge_error(values, name(), exc))
    if all(v == first for v in values[1:]):
        return first
    return list(values)


def _microbatch_list(ks: list[int]) -> str:
    return ("microbatch " if len(ks) == 1 else "microbatches ") + ", ".join(map(str, ks))


def _merge_error(values: list[Any], name: str, exc: Exception) -> Exception:
    """Why merging ``name`` over the microbatches failed, naming the output, the microbatches and what differs."""
    what = f"cannot merge {name} over the microbatches"
    if not all(isinstance(v, torch.Tensor) for v in values):
        kinds = {}
        for k, v in enumerate(values):
            kinds.setdefault(type(v).__name__, []).append(k)
        return TypeError(f"{what}: it is a tensor in some microbatches only ("
                         + "; ".join(f"{t} in {_microbatch_list(ks)}" for t, ks in kinds.items()) + ")")
    if all(ops._is_dtensor(v) for v in values):  # DTensors merge ([Note: splitting a DTensor into microbatches])
        return _said(exc, f"{what}: {exc}")
    unmovable = ops.explain_unmovable(what, values, lambda k: f"its value in microbatch {k}")
    if unmovable is not None:
        return unmovable
    for attr, fix in (("dtype", "cast it to one dtype (e.g. .float())"), ("device", "move it to one device")):
        seen: dict[Any, list[int]] = {}
        for k, v in enumerate(values):
            seen.setdefault(getattr(v, attr), []).append(k)
        if len(seen) > 1:
            return TypeError(f"{what}: its {attr} varies per microbatch ("
                             + "; ".join(f"{d} in {_microbatch_list(ks)}" for d, ks in seen.items())
                             + f"); a stage must return the same {attr} for every microbatch: {fix}")
    if isinstance(exc, (TypeError, ValueError, RuntimeError, IndexError)):
        shapes = ", ".join(f"{tuple(v.shape)}" for v in values)
        return type(exc)(f"{what} (shapes per microbatch: {shapes}): {exc}")
    return exc


def merge_chunks(chunks: Sequence[Any], spec: _Spec = None) -> Any:
    """Glue per-microbatch outputs (same pytree structure each) back into one.

    Tensors are concatenated along dim 0 (or the spec's dim), 0-d tensors are
    stacked into a vector with one entry per microbatch, and non-tensor leaves
    come back as one value if every microbatch agrees, else as a list.
    """
    if len(chunks) == 0:
        raise ValueError("merge_chunks needs at least one chunk")
    if all(isinstance(c, torch.Tensor) for c in chunks):  # one tensor per microbatch: no pytree walk
        return _merge_leaf(list(chunks), _flat_specs(chunks[0], spec, "outputs")[0], lambda: "the output")
    flat = [pytree.tree_flatten(c) for c in chunks]
    tree = flat[0][1]
    for i, (_, t) in enumerate(flat[1:], start=1):
        if t != tree:
            raise ValueError(f"microbatch {i} output structure {t} differs from microbatch 0's {tree}")
    specs = _flat_specs(chunks[0], spec, "outputs")

    def name(j: int) -> Callable[[], str]:
        return lambda: "output" + pytree.keystr(pytree.tree_flatten_with_path(chunks[0])[0][j][0])

    merged = [_merge_leaf([f[0][j] for f in flat], specs[j], name(j)) for j in range(len(specs))]
    return pytree.tree_unflatten(merged, tree)


def to_device(tree: Any, device: torch.device) -> Any:
    """The pytree with its tensors on ``device`` (tensors already there are passed through)."""
    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) and x.device != device else x, tree)


def split_target(target: Any, n_microbatches: int) -> list[Any]:
    """The loss target (a tensor or pytree) cut into microbatches like a single positional input."""
    return [c[0] for c in split_args_kwargs((target,), {}, n_microbatches, args_name="target")[0]]


def split_step_inputs(
    args: Sequence[Any], kwargs: dict[str, Any] | None, n_microbatches: int, device: torch.device,
    chunk_spec: tuple[_Spec, _Spec] | None = None,
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]], list[int]]:
    """A step's batch on ``device``, cut into microbatches: ``(args_chunks, kwargs_chunks, rows)``.

    The one place both front doors (``Pipe`` and ``PipelineSchedule``) turn a
    batch into microbatches, so they check and split it the same way.
    """
    sizes = microbatch_sizes(args, kwargs, n_microbatches, chunk_spec)
    args, kwargs = to_device((tuple(args), dict(kwargs or {})), device)
    args_chunks, kwargs_chunks = split_args_kwargs(args, kwargs, n_microbatches, chunk_spec)
    return args_chunks, kwargs_chunks, sizes


def split_step_target(target: Any, n_microbatches: int, device: torch.device,
                      sizes: Sequence[int] | None = None) -> list[Any]:
    """The loss target on ``device`` cut into microbatches; checked against the batch's ``sizes`` when given."""
    target = to_device(target, device)
    if sizes is not None:
        rows = target_sizes(target, n_microbatches)
        if rows != list(sizes):
            raise ValueError(f"target splits into microbatches of {rows} rows but the inputs into {list(sizes)}")
    return split_target(target, n_microbatches)


def _given_list(values: Any, n: Optional[int], what: str) -> list:
    """A per-microbatch list the caller passed: a list or tuple of ``n`` entries (any ``n`` when None)."""
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{what} must be a list with one entry per microbatch, got {type(values).__name__}")
    if n is not None and len(values) != n:
        raise ValueError(f"{what} has {len(values)} entries but the schedule runs n_microbatches={n}")
    if not values:
        raise ValueError(f"{what} is empty: pass at least one microbatch")
    return list(values)


def given_microbatches(
    arg_mbs: Any, kwarg_mbs: Any, n_microbatches: Optional[int], device: torch.device,
    chunk_spec: tuple[_Spec, _Spec] | None = None,
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]], list[int]]:
    """Microbatches the caller already cut (``step_microbatches``), on ``device``: ``(args, kwargs, rows)``.

    ``arg_mbs``: one tuple of positional arguments per microbatch (a lone
    tensor stands for a 1-tuple), any shapes; ``kwarg_mbs``: one dict per
    microbatch, or None. Each microbatch's rows are counted as ``step()``
    counts a batch's (along the chunk spec's dims, every split input alike):
    they weigh its loss when the loss function has no weights of its own.
    The caller's lists and tensors are not modified.
    """
    if arg_mbs is None and kwarg_mbs is None:
        raise ValueError("the rank holding stage 0 must pass the microbatches (arg_mbs and/or kwarg_mbs)")
    n = n_microbatches
    if arg_mbs is not None:
        arg_mbs = _given_list(arg_mbs, n, "arg_mbs")
        n = len(arg_mbs)
    if kwarg_mbs is not None:
        kwarg_mbs = _given_list(kwarg_mbs, n, "kwarg_mbs")
        n = len(kwarg_mbs)
    for k, kw in enumerate(kwarg_mbs or ()):
        if kw is not None and not isinstance(kw, dict):
            raise TypeError(f"kwarg_mbs[{k}] must be a dict of keyword arguments, got {type(kw).__name__}")
    args_chunks = [(a,) if isinstance(a, torch.Tensor) else tuple(a) for a in arg_mbs] if arg_mbs is not None \
        else [()] * n
    kwargs_chunks = [dict(k or {}) for k in kwarg_mbs] if kwarg_mbs is not None else [{} for _ in range(n)]
    sizes = []
    for k, (args, kwargs) in enumerate(zip(args_chunks, kwargs_chunks)):
        try:
            sizes.append(microbatch_sizes(args, kwargs, 1, chunk_spec)[0])
        except ValueError as exc:
            raise ValueError(f"microbatch {k}: {exc}") from None
    args_chunks, kwargs_chunks = to_device((args_chunks, kwargs_chunks), device)
    return [tuple(a) for a in args_chunks], kwargs_chunks, sizes


def given_targets(target_mbs: Any, n_microbatches: Optional[int], device: torch.device) -> tuple[list[Any], list[int]]:
    """The caller's target per microbatch on ``device``, and each one's rows (its tensors' dim 0)."""
    targets = _given_list(target_mbs, n_microbatches, "target_mbs")
    sizes = []
    for k, t in enumerate(targets):
        try:
            sizes.append(target_sizes(t, 1)[0])
        except ValueError as exc:
            raise ValueError(f"target_mbs[{k}]: {exc}") from None
    return to_device(targets, device), sizes


def split_rank_kwargs(
    kwargs: dict[str, Any] | None, n_microbatches: int, device: torch.device,
    chunk_spec: tuple[_Spec, _Spec] | None = None,
) -> tuple[list[dict[str, Any]], Optional[list[int]]]:
    """The keyword arguments of a rank without stage 0, on ``device``, cut into microbatches: ``(chunks, rows)``.

    Cut as stage 0's rank cuts its batch (``split_step_inputs``: the chunk
    spec's kwargs part, uneven rows shared out, rows that differ between
    inputs warned about), because torch hands each rank's own keyword
    arguments to its stages ([Note: keyword arguments per rank] in
    ``runtime/executor.py``). ``rows`` per microbatch are those of the first
    tensor split, for the ranks to check against the batch's; None when
    nothing is split (plain values, or every tensor ``Replicate()``).
    """
    kwargs = dict(kwargs or {})
    sizes = (microbatch_sizes((), kwargs, n_microbatches, chunk_spec)
             if _split_rows((), kwargs, chunk_spec, "args") else None)
    kwargs = to_device(kwargs, device)
    _, chunks = split_args_kwargs((), kwargs, n_microbatches, chunk_spec)
    return chunks, sizes


def given_rank_kwargs(
    kwarg_mbs: Any, n_microbatches: Optional[int], device: torch.device,
    chunk_spec: tuple[_Spec, _Spec] | None = None,
) -> tuple[list[dict[str, Any]], Optional[list[int]]]:
    """A rank's own ``kwarg_mbs`` (one dict per microbatch, cut by the caller), on ``device``: ``(chunks, rows)``.

    The keyword half of ``given_microbatches``, for a rank without stage 0
    (see ``split_rank_kwargs``). ``rows``: each microbatch's, counted as
    ``given_microbatches`` counts them; None when some microbatch splits no
    tensor (nothing to compare).
    """
    kwarg_mbs = _given_list(kwarg_mbs, n_microbatches, "kwarg_mbs")
    for k, kw in enumerate(kwarg_mbs):
        if kw is not None and not isinstance(kw, dict):
            raise TypeError(f"kwarg_mbs[{k}] must be a dict of keyword arguments, got {type(kw).__name__}")
    chunks = [dict(kw or {}) for kw in kwarg_mbs]
    sizes: Optional[list[int]] = []
    for k, kw in enumerate(chunks):
        try:
            if not _split_rows((), kw, chunk_spec, "args"):
                sizes = None
            elif sizes is not None:
                sizes.append(microbatch_sizes((), kw, 1, chunk_spec)[0])
        except ValueError as exc:
            raise ValueError(f"microbatch {k}: {exc}") from None
    return to_device(chunks, device), sizes
