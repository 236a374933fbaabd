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
  DTensor output its position, mesh (dim names, shape), the sender's
  coordinate on that mesh and its global rank, placements, global shape and
  stride (``META_ENTRY`` words each, a fixed size, so the message's layout
  depends only on how many outputs are DTensors, and a new placement is read
  anew from every message).

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

[Note: a pipeline pairs the same place of the mesh]
``from_local`` takes the shard it is given as the one of the receiver's own
place on its mesh: tp rank 1 takes what arrives as shard 1. Names and shape
alone do not say that the sender held shard 1: pp groups built by hand can
pair different tp coordinates (pp groups (0, 3) and (1, 2) on the (pp=2,
tp=2) mesh [[0, 1], [2, 3]]: tp rank 0 of stage 0 feeds tp rank 1 of stage
1), and a ``Shard(1)`` activation is then rebuilt as the other shard, wrong
with no error. So the layout carries the sender's coordinate on the
DTensor's mesh and its global rank, and the receiver (``_decode``, once per
layout) requires the same coordinate as its own on every mesh dim, except a
pipeline dim the mesh itself holds: when the receiver's mesh has the sender
at the coordinate it sent and the two differ on exactly one dim, that dim is
the one the pipeline runs along (a DTensor on a mesh with the pp dim in it).
Anything else is refused by name: the stage, the input, both ranks and both
coordinates. Plain activations carry no mesh, so a crossed pairing of
``use_local_output=True`` blocks is not seen here.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

__all__ = ["MAGIC", "META_ENTRY", "to_wire", "is_wire", "from_wire", "MeshFinder", "dtensor_type", "scalar_grad",
           "is_async_collective", "settled", "waited"]

#: first word of a layout tensor (an int64 no activation carries by chance in that place, size and dtype)
MAGIC = 0x5044_5445_4E53_4F52  # "PDTENSOR"
_MESH_DIMS, _DIMS, _NAME_WORDS = 4, 8, 8
# position, mesh ndim, mesh shape, the sender's coordinate on the mesh, placements, ndim, shape, stride, dim names,
# the sender's global rank
META_ENTRY = 1 + 1 + _MESH_DIMS * 3 + 1 + _DIMS * 2 + _NAME_WORDS + 1
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
        coordinate = mesh.get_coordinate()  # None off the mesh (no shard of its own): -1 on every dim
        words += [i, mesh.ndim, *pad(mesh.shape, _MESH_DIMS),
                  *pad(coordinate if coordinate is not None else [-1] * mesh.ndim, _MESH_DIMS),
                  *pad([_encode_placement(p, what) for p in t.placements], _MESH_DIMS),
                  t.dim(), *pad(t.shape, _DIMS), *pad(t.stride(), _DIMS), *_text_words(names), _global_rank()]
    return words


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else -1


def _place(names: Sequence[str], coordinate: Optional[Sequence[int]]) -> str:
    """A coordinate on a mesh in words: ``(tp=1)``, ``(dp=0, tp=1)`` (``nowhere`` off the mesh)."""
    if coordinate is None or any(c < 0 for c in coordinate):
        return "nowhere"
    names = list(names) if names else [f"dim{d}" for d in range(len(coordinate))]
    return "(" + ", ".join(f"{n}={c}" for n, c in zip(names, coordinate)) + ")"


def _check_place(mesh: Any, names: tuple[str, ...], shape: tuple[int, ...], sender: tuple[int, ...],
                 sender_rank: int, where: str, stage: int) -> None:
    """Refuse a DTensor from a sender at another place of the mesh than this rank ([Note: a pipeline pairs the
    same place of the mesh]): from_local would take its shard as this rank's."""
    mine = mesh.get_coordinate()
    mine = tuple(mine) if mine is not None else None
    if mine == sender:
        return
    if mine is not None and min(sender, default=0) >= 0:
        differ = [d for d in range(len(sender)) if sender[d] != mine[d]]
        if len(differ) == 1 and int(mesh.mesh[sender]) == sender_rank:
            return  # the receiver's own mesh holds the sender, one dim apart: the pipeline runs along that dim
    rank = _global_rank()
    raise TypeError(
        f"{where} is a DTensor from stage {stage - 1} on rank {sender_rank} at {_place(names, sender)} of "
        f"{_describe(names, shape)}, but stage {stage} on rank {rank} sits at {_place(names, mine)} of its "
        f"{_describe(_names(mesh), mesh.shape)}: from_local would take rank {sender_rank}'s shard as rank {rank}'s. "
        "The ranks of one pipeline must sit at the same place of every other mesh dim (the same tp rank): build "
        "the pp groups from the mesh (mesh['pp'], pe.pipeline_mesh) rather than by hand"
    )


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
        coordinate = tuple(e[o:o + mdim]); o += _MESH_DIMS  # noqa: E702
        placements = [_decode_placement(c) for c in e[o:o + mdim]]; o += _MESH_DIMS  # noqa: E702
        ndim = e[o]; o += 1  # noqa: E702
        shape = tuple(e[o:o + ndim]); o += _DIMS  # noqa: E702
        stride = tuple(e[o:o + ndim]); o += _DIMS  # noqa: E702
        text = _words_text(e[o:o + _NAME_WORDS]); o += _NAME_WORDS  # noqa: E702
        names = tuple(text.split(",")) if text else ()
        sender_rank = e[o]
        mb = "" if microbatch is None else f", microbatch {microbatch}"
        where = f"stage {stage}'s input {pos}{mb}"
        mesh = meshes.find(names, mshape)
        if mesh is None:
            raise TypeError(
                f"{where} is a DTensor from stage {stage - 1} on {_describe(names, mshape)} with placements "
                f"{tuple(placements)}, but stage {stage} has no such mesh (its meshes: {meshes.known()}); give the "
                "stage the mesh (PipelineStage(..., mesh=) or get_mesh=) or make both stages' meshes agree"
            )
        _check_place(mesh, names, mshape, coordinate, sender_rank, where, stage)
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
# Within one step, microbatch k of every input, keyword argument and target holds the same global rows (those
# ``torch.tensor_split`` gives a plain tensor: ``ops.even_sizes``), and the outputs merge back in the global
# order, whatever kind each tensor is: a Shard(0) DTensor input beside a plain target must pair row i with row i.
# So a DTensor is cut by its global rows. Where the split dim is not sharded (Replicate, Shard(other dim),
# Partial) the local dim is the global one: the local shard is cut like a plain tensor and each piece wrapped
# with the same mesh and placements, no communication. Where it is sharded (a batch Shard(0) over tp), cutting
# each rank's shard (microbatch k = piece k of every rank) would give microbatch k other global rows than a plain
# tensor's microbatch k, and a microbatch of the global rows cannot be made of local pieces either: torch takes
# a DTensor's local shards to be the chunks of its global rows (its collectives pad and cut by that rule), while
# microbatch k's rows sit on one rank or straddle two. So the DTensor is gathered over the mesh dims that shard
# the split dim (``redistribute`` to Replicate there: one all-gather), cut by global rows, and each piece put
# back in the original placements (``redistribute`` from Replicate to Shard: a local chunk, no communication).
# Microbatch k is then torch's DTensor of exactly the plain split's rows, for any rows over any number of ranks.
# Merging does the reverse: each microbatch's output gathered (one all-gather each), glued in microbatch order
# and chunked again. Everything stays in the autograd graph (``redistribute``'s backward). The cost is paid only
# by a DTensor sharded along its split dim: the whole tensor on every rank of its mesh for the split. Every rank
# of the mesh splits and merges the same step's tensors in the same order (they run the same step), as the
# model's own collectives already need.

def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))


def _sharding_of(t: Any, dim: int) -> list[int]:
    """The mesh dims that shard tensor dim ``dim`` of DTensor ``t``."""
    return [i for i, p in enumerate(t.placements) if p.is_shard() and p.dim % t.dim() == dim]


def _gathered(t: Any, dim: int) -> Optional[tuple]:
    """``t``'s placements with every mesh dim that shards tensor dim ``dim`` replicated; None when none does."""
    from torch.distributed.tensor import Replicate

    sharded = _sharding_of(t, dim)
    if not sharded:
        return None
    return tuple(Replicate() if i in sharded else p for i, p in enumerate(t.placements))


def _wrap(local: torch.Tensor, mesh: Any, placements: Sequence[Any], shape: Sequence[int]) -> Any:
    return dtensor_type().from_local(local, mesh, tuple(placements), run_check=False, shape=torch.Size(shape),
                                     stride=_contiguous_stride(shape))


def split_dtensor(t: Any, sizes: Sequence[int], dim: int, split_local: Callable[..., Any]) -> list[Any]:
    """``t`` (a DTensor) in pieces of ``sizes`` global rows along ``dim``, each a DTensor in ``t``'s placements
    ([Note: splitting a DTensor into microbatches])."""
    dim = dim % t.dim()
    mesh, placements = t.device_mesh, tuple(t.placements)
    if sum(sizes) != t.shape[dim]:
        raise ValueError(f"split: sizes {list(sizes)} sum to {sum(sizes)}, but the DTensor has {t.shape[dim]} rows "
                         f"along dim {dim} (shape {tuple(t.shape)})")
    gathered = _gathered(t, dim)
    whole = t if gathered is None else t.redistribute(mesh, gathered)
    pieces = split_local(settled(whole.to_local()), list(sizes), dim)
    out = []
    for piece, rows in zip(pieces, sizes):
        shape = list(t.shape)
        shape[dim] = rows
        if gathered is None:
            out.append(_wrap(piece, mesh, placements, shape))
        else:
            out.append(_wrap(piece, mesh, gathered, shape).redistribute(mesh, placements))
    return out


def concat_dtensors(tensors: Sequence[Any], dim: int, concat_local: Callable[..., Any]) -> Any:
    """DTensors of one mesh and placements glued along ``dim`` in their global rows (see the note)."""
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
    mesh, placements = first.device_mesh, tuple(first.placements)
    gathered = _gathered(first, dim)
    wholes = tensors if gathered is None else [t.redistribute(mesh, gathered) for t in tensors]
    shape = list(first.shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    merged = _wrap(concat_local([settled(t.to_local()) for t in wholes], dim), mesh, gathered or placements, shape)
    return merged if gathered is None else merged.redistribute(mesh, placements)
