"""DTensor activations between stages: the local shard travels, with its layout as a small int64 tensor.

[Note: DTensors between stages]
A stage of a tensor-parallel model may return DTensors (``RowwiseParallel(
use_local_output=False)``, sequence parallel's ``Shard(1)``). The core moves
bytes at a data pointer, which a DTensor (a wrapper) does not have; what has
bytes is its local shard. So a stage's outputs go out in *wire form*:

- each DTensor output becomes ``output.to_local().contiguous()``, taken inside
  the autograd graph, so the gradient that comes back (a plain tensor, the
  local shard of the gradient in the output's own placements) enters the
  graph through ``to_local``'s backward, which wraps it as the DTensor
  gradient exactly as torch's ``PipelineStage`` rebuilds it;
- one int64 tensor is appended to the message: a magic word, then per
  DTensor output its position, mesh (dim names, shape),
  placements, global shape and stride (``META_ENTRY`` words each, a fixed
  size, so the message's layout depends only on how many outputs are
  DTensors, and a new placement is read anew from every message).

The receiving stage (``from_wire``) drops the layout tensor and rebuilds each
DTensor with ``DTensor.from_local(local, mesh, placements, shape=, stride=,
run_check=False)`` on a mesh of its own (``MeshFinder``: the stage module's
DTensor parameters and their sub-meshes, ``PipelineStage(mesh=)``, or
torch's ``get_mesh=`` callback), after checking that the mesh's dim names and
shape are the sender's; a mismatch raises a TypeError naming the stage, the
input and both sides. The local shard it received is the leaf that collects
the gradient: ``from_local``'s backward redistributes the DTensor gradient
to the forward placements (a Partial gradient is reduced over its mesh dim
there, on every rank of the mesh in the same order, as part of the same
backward) and hands back its local shard, which is what the sender's
``to_local`` expects. Plain tensors are untouched: only a stage that returned
a DTensor pays for any of this (``as_output_tuple`` sees it on the path that
already handles tensors the core cannot read).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

__all__ = ["MAGIC", "META_ENTRY", "to_wire", "is_wire", "from_wire", "MeshFinder", "dtensor_type", "scalar_grad",
           "is_async_collective", "settled", "waited"]

#: first word of a layout tensor (an int64 no activation carries by chance in that place, size and dtype)
MAGIC = 0x5044_5445_4E53_4F52  # "PDTENSOR"
_MESH_DIMS, _DIMS, _NAME_WORDS = 4, 8, 8
# position, mesh ndim, mesh shape, (reserved), placements, ndim, shape, stride, dim names
META_ENTRY = 1 + 1 + _MESH_DIMS * 3 + 1 + _DIMS * 2 + _NAME_WORDS
_REDUCE_OPS = ("sum", "avg", "max", "min", "product")


def dtensor_type() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


def is_async_collective(t: torch.Tensor) -> bool:
    """A functional collective's result not yet waited on (``AsyncCollectiveTensor``): plain once waited."""
    return type(t).__name__ == "AsyncCollectiveTensor" and type(t).__module__.startswith("torch.distributed")


def settled(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy when it is an ``AsyncCollectiveTensor``: the clone waits for the collective and is a plain
    tensor in the autograd graph (``waited`` is for gradients, outside it)."""
    return t.clone() if is_async_collective(t) else t


def waited(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t``, or its plain tensor once waited on when it is an ``AsyncCollectiveTensor`` (outside autograd)."""
    return t.wait() if t is not None and is_async_collective(t) else t


def _encode_placement(p: Any, what: str) -> int:
    from torch.distributed.tensor import Partial, Replicate, Shard

    if type(p) is Replicate:
        return 0
    if type(p) is Shard:
        return 1 + p.dim
    if type(p) is Partial and p.reduce_op in _REDUCE_OPS:
        return -1 - _REDUCE_OPS.index(p.reduce_op)
    raise TypeError(f"{what} is a DTensor with placement {p!r}; between stages only Replicate, Shard(dim) and "
                    f"Partial({'/'.join(_REDUCE_OPS)}) travel: redistribute it before returning it")


def _decode_placement(code: int) -> Any:
    from torch.distributed.tensor import Partial, Replicate, Shard

    if code == 0:
        return Replicate()
    if code > 0:
        return Shard(code - 1)
    return Partial(_REDUCE_OPS[-1 - code])


def _text_words(text: str) -> list[int]:
    raw = text.encode()[: 8 * _NAME_WORDS].ljust(8 * _NAME_WORDS, b"\0")
    return [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, len(raw), 8)]


def _words_text(words: Sequence[int]) -> str:
    return b"".join(int(w).to_bytes(8, "little", signed=True) for w in words).rstrip(b"\0").decode()


def _names(mesh: Any) -> tuple[str, ...]:
    return tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else ()


def _describe(names: Sequence[str], shape: Sequence[int]) -> str:
    return f"mesh {tuple(names)} of shape {tuple(shape)}"


#: layouts already encoded (sender) and decoded (receiver), so a steady step only pays torch's own
#: to_local/from_local: the encoded int64 tensors are only ever read (the channel copies what it sends, the
#: next stage on this rank decodes it), so one is reused for every message of that layout
_ENCODED: dict[tuple, tuple] = {}
_DECODED: dict[tuple, tuple] = {}
_CACHED = 256


def _remember(cache: dict, key: Any, value: Any) -> Any:
    if len(cache) >= _CACHED:
        cache.pop(next(iter(cache)))
    cache[key] = value
    return value


def to_wire(items: Sequence[torch.Tensor], stage: int, microbatch: Optional[int]) -> tuple[torch.Tensor, ...]:
    """A stage's outputs with each DTensor as its local shard (in the graph), then one layout tensor."""
    DTensor = dtensor_type()
    out: list[torch.Tensor] = []
    key: list[Any] = []
    for i, t in enumerate(items):
        if isinstance(t, DTensor):
            key.append((i, id(t.device_mesh), tuple(t.placements), tuple(t.shape), t.stride()))
            out.append(settled(t.to_local()).contiguous())
        else:
            out.append(t)
    device = next((t.device for t in out if isinstance(t, torch.Tensor)), torch.device("cpu"))
    cache_key = (tuple(key), device)
    hit = _ENCODED.get(cache_key)
    if hit is None:  # the entry holds the meshes, so their ids in the key stay theirs while it lives
        meshes = [t.device_mesh for t in items if isinstance(t, DTensor)]
        hit = _remember(_ENCODED, cache_key, (meshes, torch.tensor(_encode(items, stage, microbatch),
                                                                   dtype=torch.int64, device=device)))
    out.append(hit[1])
    return tuple(out)


def _encode(items: Sequence[torch.Tensor], stage: int, microbatch: Optional[int]) -> list[int]:
    DTensor = dtensor_type()
    words: list[int] = [MAGIC]
    mb = "" if microbatch is None else f", microbatch {microbatch}"
    for i, t in enumerate(items):
        if not isinstance(t, DTensor):
            continue
        what = f"stage {stage}'s output at position {i}{mb}"
        mesh = t.device_mesh
        if mesh.ndim > _MESH_DIMS or t.dim() > _DIMS:
            raise TypeError(f"{what} is a DTensor on a {mesh.ndim}-D mesh with {t.dim()} dims; between stages "
                            f"at most {_MESH_DIMS} mesh dims and {_DIMS} tensor dims travel")
        names = ",".join(_names(mesh))
        if len(names.encode()) > 8 * _NAME_WORDS:
            raise TypeError(f"{what}: the mesh dim names {_names(mesh)} are longer than {8 * _NAME_WORDS} bytes")
        pad = lambda xs, n: list(xs) + [0] * (n - len(xs))  # noqa: E731
        words += [i, mesh.ndim, *pad(mesh.shape, _MESH_DIMS), *pad((), _MESH_DIMS),
                  *pad([_encode_placement(p, what) for p in t.placements], _MESH_DIMS),
                  t.dim(), *pad(t.shape, _DIMS), *pad(t.stride(), _DIMS), *_text_words(names)]
    return words


def is_wire(args: Sequence[Any]) -> bool:
    """Whether a received message is in wire form (its last tensor the layout of its DTensors)."""
    last = args[-1] if args else None
    return (type(last) is torch.Tensor and last.dtype is torch.int64 and last.dim() == 1
            and last.numel() % META_ENTRY == 1 and int(last[0]) == MAGIC)


class MeshFinder:
    """The receiving stage's meshes a DTensor input is rebuilt on (see the module's note).

    Looked up by the sender's mesh dim names and shape: a mesh given with
    ``PipelineStage(mesh=)``, then the meshes of the stage module's DTensor
    parameters and buffers and their sub-meshes by name, then ``get_mesh``
    (torch's callback: ``get_mesh(dim_names, layout)``).
    """

    def __init__(self, module: Optional[torch.nn.Module], mesh: Any = None,
                 get_mesh: Optional[Callable[..., Any]] = None) -> None:
        self.module, self.mesh, self.get_mesh = module, mesh, get_mesh
        self._found: dict[tuple, Any] = {}
        self._candidates: Optional[list[Any]] = None

    def candidates(self) -> list[Any]:
        if self._candidates is None:
            DTensor = dtensor_type()
            seen: dict[int, Any] = {}
            if self.mesh is not None:
                seen[id(self.mesh)] = self.mesh
            if self.module is not None:
                for t in (*self.module.parameters(), *self.module.buffers()):
                    if isinstance(t, DTensor):
                        seen.setdefault(id(t.device_mesh), t.device_mesh)
            self._candidates = list(seen.values())
        return self._candidates

    def find(self, names: tuple[str, ...], shape: tuple[int, ...]) -> Any:
        key = (names, shape)
        mesh = self._found.get(key)
        if mesh is not None:
            return mesh
        for cand in self.candidates():
            sub = cand
            if _names(cand) != names:
                if not names or not set(names) <= set(_names(cand)):
                    continue
                try:
                    sub = cand[names if len(names) > 1 else names[0]]
                except (KeyError, RuntimeError, ValueError):
                    continue
            if tuple(sub.shape) == shape:
                self._found[key] = sub
                return sub
        if self.get_mesh is not None:
            mesh = self.get_mesh(names, None)  # torch's (dim_names, layout); the layout is not sent
            if mesh is not None:
                if (_names(mesh), tuple(mesh.shape)) != key:
                    raise TypeError(f"get_mesh({names}, ...) returned {_describe(_names(mesh), mesh.shape)}, "
                                    f"not the sender's {_describe(names, shape)}")
                self._found[key] = mesh
                return mesh
        return None

    def known(self) -> str:
        said = [_describe(_names(m), m.shape) for m in self.candidates()]
        return ", ".join(said) if said else "none (no DTensor parameter, no mesh= given)"


def from_wire(args: Sequence[Any], meshes: MeshFinder, stage: int, microbatch: Optional[int]) -> tuple[Any, ...]:
    """The message without its layout tensor, each DTensor rebuilt (from the received local shard)."""
    DTensor = dtensor_type()
    words = tuple(args[-1].tolist())
    out = list(args[:-1])
    hit = _DECODED.get((words, id(meshes)))
    if hit is None:  # the entry holds the finder, so its id in the key stays its own while it lives
        hit = _remember(_DECODED, (words, id(meshes)), (meshes, _decode(words, meshes, stage, microbatch)))
    for pos, mesh, placements, shape, stride in hit[1]:
        out[pos] = DTensor.from_local(out[pos], mesh, placements, run_check=False, shape=shape, stride=stride)
    return tuple(out)


def _decode(words: Sequence[int], meshes: MeshFinder, stage: int, microbatch: Optional[int]) -> list:
    """Per DTensor of a message: its position, the receiver's mesh, placements, global shape and stride."""
    decoded = []
    for k in range(1, len(words), META_ENTRY):
        e = words[k:k + META_ENTRY]
        pos, mdim = e[0], e[1]
        o = 2
        mshape = tuple(e[o:o + mdim]); o += _MESH_DIMS  # noqa: E702
        o += _MESH_DIMS  # reserved
        placements = [_decode_placement(c) for c in e[o:o + mdim]]; o += _MESH_DIMS  # noqa: E702
        ndim = e[o]; o += 1  # noqa: E702
        shape = tuple(e[o:o + ndim]); o += _DIMS  # noqa: E702
        stride = tuple(e[o:o + ndim]); o += _DIMS  # noqa: E702
        text = _words_text(e[o:o + _NAME_WORDS])
        names = tuple(text.split(",")) if text else ()
        mb = "" if microbatch is None else f", microbatch {microbatch}"
        where = f"stage {stage}'s input {pos}{mb}"
        mesh = meshes.find(names, mshape)
        if mesh is None:
            raise TypeError(
                f"{where} is a DTensor from stage {stage - 1} on {_describe(names, mshape)} with placements "
                f"{tuple(placements)}, but stage {stage} has no such mesh (its meshes: {meshes.known()}); give the "
                "stage the mesh (PipelineStage(..., mesh=) or get_mesh=) or make both stages' meshes agree"
            )
        decoded.append((pos, mesh, tuple(placements), torch.Size(shape), stride))
    return decoded


def scalar_grad(loss: Any, weight: Any) -> Any:
    """The loss weight as the gradient of a DTensor loss (the last stage's loss_fn on DTensor outputs): a
    DTensor in the loss's placements, a Partial one taken as Replicate (``from_local``'s rule for grads)."""
    from torch.distributed.tensor import Replicate

    local = loss.to_local()
    w = weight.detach().to(local.device, local.dtype) if isinstance(weight, torch.Tensor) else weight
    grad = torch.empty_like(local).fill_(w) if not isinstance(w, torch.Tensor) else w.expand_as(local).clone()
    placements = [Replicate() if p.is_partial() else p for p in loss.placements]
    return dtensor_type().from_local(grad, loss.device_mesh, placements, run_check=False, shape=loss.shape,
                                     stride=loss.stride())


# -- microbatch split and merge of DTensors ---------------------------------------------------------------
# [Note: splitting a DTensor into microbatches]
# A DTensor is split by splitting its local shard along the same dim and wrapping each piece with the same
# mesh and placements (``to_local`` and ``from_local`` keep it in the graph). Where the dim is not sharded
# (Replicate, Shard(other dim), Partial) the local dim is the global one: microbatch k holds the same rows
# as the plain split. Where it is sharded on one mesh dim (a batch sharded over ranks, Shard(0)), each rank
# cuts its own rows into equal pieces: microbatch k is then piece k of every rank (a permutation of the
# plain split's rows, the same set over the step), and merging concatenates the local pieces again, which
# undoes it exactly. That needs every rank's shard to hold the same number of rows, divisible by each
# microbatch's share: anything else is refused by name.

def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))


def _sharding_of(t: Any, dim: int) -> list[int]:
    """The mesh dims that shard tensor dim ``dim`` of DTensor ``t``."""
    return [i for i, p in enumerate(t.placements) if p.is_shard() and p.dim % t.dim() == dim]


def split_dtensor(t: Any, sizes: Sequence[int], dim: int, split_local: Callable[..., Any]) -> list[Any]:
    """``t`` (a DTensor) in pieces of ``sizes`` rows along ``dim`` (global), each a DTensor like it."""
    DTensor = dtensor_type()
    dim = dim % t.dim()
    mesh, placements = t.device_mesh, tuple(t.placements)
    sharded = _sharding_of(t, dim)
    local = settled(t.to_local())
    if not sharded:
        local_sizes = list(sizes)
    else:
        if len(sharded) > 1:
            raise TypeError(f"split: a DTensor sharded along the split dim {dim} over {len(sharded)} mesh dims "
                            f"({placements}) cannot be cut into microbatches; redistribute it first")
        shards = mesh.size(sharded[0])
        if t.shape[dim] % shards or local.shape[dim] * shards != t.shape[dim] or any(s % shards for s in sizes):
            raise TypeError(
                f"split: a DTensor of shape {tuple(t.shape)} sharded along the split dim {dim} ({placements}) over "
                f"{shards} ranks is cut into microbatches on every rank alike, which needs each rank's "
                f"{t.shape[dim] // shards if t.shape[dim] % shards == 0 else 'uneven'} rows and each microbatch's "
                f"{list(sizes)} divisible by {shards}; pick n_microbatches so, or replicate it along dim {dim}")
        local_sizes = [s // shards for s in sizes]
    pieces = split_local(local, local_sizes, dim)
    out = []
    for piece, rows in zip(pieces, sizes):
        shape = list(t.shape)
        shape[dim] = rows
        out.append(DTensor.from_local(piece, mesh, placements, run_check=False, shape=torch.Size(shape),
                                      stride=_contiguous_stride(shape)))
    return out


def concat_dtensors(tensors: Sequence[Any], dim: int, concat_local: Callable[..., Any]) -> Any:
    """DTensors of one mesh and placements glued along ``dim``: their local shards concatenated (see the note)."""
    DTensor = dtensor_type()
    first = tensors[0]
    for k, t in enumerate(tensors):
        if not isinstance(t, DTensor):
            raise TypeError(f"concat: tensor {k} is a {type(t).__name__} where tensor 0 is a DTensor; a stage must "
                            "return the same kind of tensor for every microbatch")
        if t.device_mesh != first.device_mesh or tuple(t.placements) != tuple(first.placements):
            raise TypeError(f"concat: tensor {k} is a DTensor with placements {tuple(t.placements)} on "
                            f"{_describe(_names(t.device_mesh), t.device_mesh.shape)}, tensor 0 has "
                            f"{tuple(first.placements)} on {_describe(_names(first.device_mesh), first.device_mesh.shape)}")
    dim = dim % first.dim()
    locals_ = [settled(t.to_local()) for t in tensors]
    shape = list(first.shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    return DTensor.from_local(concat_local(locals_, dim), first.device_mesh, tuple(first.placements),
                              run_check=False, shape=torch.Size(shape), stride=_contiguous_stride(shape))
