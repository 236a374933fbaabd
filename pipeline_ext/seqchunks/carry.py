"""One sequence's keys and values on one stage, piece by piece: what later pieces attend to, and what flows back.

A ``SequenceCarry`` lives for one microbatch on one stage. Piece ``j``'s
attention records its (k, v) per layer: the tensors as they are in ``j``'s
autograd graph, and (unless ``j`` is the last piece) a detached leaf copy of
each, which every later piece's attention joins. A later piece's backward
leaves the gradient it owes piece ``j`` in the leaf's ``.grad``, summed over
all later pieces; piece ``j``'s backward adds those as extra roots
(``extra_roots``), then the piece's entries go (``release``).

The carry reaches the attention through a context variable: the pipeline runs
each piece's forward inside ``with carry.active(piece=p, offset=o):``, and
``current_carry()`` returns it there (and ``None`` everywhere else, so the
same model runs unsplit outside a pipeline).
"""
from __future__ import annotations

import contextvars
from collections.abc import Hashable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["SequenceCarry", "PiecesNotSupportedError", "current_carry", "piece_positions", "check_rope",
           "DEFAULT_HF_NAME"]

#: the ``attn_implementation`` name ``register_hf_attention`` uses unless told another
DEFAULT_HF_NAME = "pipeline_ext_pieces"

_ACTIVE: contextvars.ContextVar[Optional["SequenceCarry"]] = contextvars.ContextVar(
    "pipeline_ext_seqchunks_carry", default=None)

#: rope types whose frequencies depend on the longest position a forward sees: each piece would get its own
_POSITION_DEPENDENT_ROPE = {
    "dynamic": "rescales its frequencies once a forward's longest position passes max_position_embeddings",
    "longrope": "picks its short or long factors by the longest position of the forward",
}


class PiecesNotSupportedError(RuntimeError):
    """The model, or one of its settings, cannot run one sequence as pieces and match the unsplit sequence."""


def current_carry() -> Optional["SequenceCarry"]:
    """The carry whose piece is running its forward in this thread (``carry.active``), else ``None``."""
    return _ACTIVE.get()


@dataclass
class _Entry:
    """One layer's keys and values of one piece."""

    k: torch.Tensor  #: as in the piece's own graph
    v: torch.Tensor
    leaf_k: Optional[torch.Tensor]  #: ``k.detach().requires_grad_()``, joined by later pieces (None: none will)
    leaf_v: Optional[torch.Tensor]
    key_bias: Optional[torch.Tensor]  #: (B, L) additive padding bias of the piece's keys, or None: none padded


class SequenceCarry:
    """Keys and values of one sequence (one microbatch) on one stage, per attention layer, per piece.

    Life cycle, on every stage, for each microbatch cut into ``pieces`` pieces:

    * forward, pieces ``0 .. pieces-1`` in order:
      ``with carry.active(piece=p, offset=o): out_p = stage(x_p)``, then
      ``carry.check_carried(p, model)``;
    * backward, pieces ``pieces-1 .. 0`` in order: ``roots = carry.extra_roots(p)``,
      ``torch.autograd.backward([out_p, *(t for t, _ in roots)], [dout_p, *(g for _, g in roots)])``,
      then ``carry.release(p)``.

    ``offset`` is the piece's first position in the sequence; left out, it is
    the sum of the earlier pieces' lengths as their attention recorded them.
    ``total_length``, when given, is checked against the pieces' lengths.
    """

    def __init__(self, pieces: int, total_length: Optional[int] = None) -> None:
        if pieces < 1:
            raise ValueError(f"pieces must be at least 1, got {pieces}")
        self.pieces = pieces
        self.total_length = total_length
        self.piece: Optional[int] = None  #: the piece whose forward runs (or ran last)
        self.offset = 0  #: its first position in the sequence
        self._entries: dict[int, dict[Hashable, _Entry]] = {}
        self._lengths: dict[int, int] = {}  # piece -> length, as its attention recorded it
        self._forwarded = -1  # the last piece whose forward began
        self._recomputing: Optional[int] = None  # the piece whose backward recomputes its forward (checkpointing)
        self._offsets: dict[int, int] = {}  # piece -> its first position, as its forward ran

    def __repr__(self) -> str:
        return (f"SequenceCarry(pieces={self.pieces}, total_length={self.total_length}, piece={self.piece}, "
                f"offset={self.offset}, held={self.held_pieces})")

    @property
    def held_pieces(self) -> tuple[int, ...]:
        """The pieces whose keys and values are held (forward ran, not yet released)."""
        return tuple(sorted(self._entries))

    @property
    def recorded_layers(self) -> tuple[Hashable, ...]:
        """The layer ids whose attention has called the carry in the running piece, in call order."""
        return tuple(self._entries.get(self.piece, {})) if self.piece is not None else ()

    @contextmanager
    def active(self, piece: int, offset: Optional[int] = None) -> Iterator["SequenceCarry"]:
        """Runs piece ``piece``'s forward with this carry current (``current_carry()``)."""
        if piece != self._forwarded + 1:
            raise RuntimeError(f"pieces run their forwards in order: piece {piece} after piece {self._forwarded}")
        if not 0 <= piece < self.pieces:
            raise ValueError(f"piece {piece} of a sequence of {self.pieces} pieces")
        if offset is None:
            unknown = [j for j in range(piece) if j not in self._lengths]
            if unknown:
                raise ValueError(f"piece {piece}'s offset: pieces {unknown} recorded no length (no attention ran); "
                                 f"pass offset=")
            offset = sum(self._lengths[j] for j in range(piece))
        if self.total_length is not None and not 0 <= offset < self.total_length:
            raise ValueError(f"piece {piece} starts at {offset}, outside a sequence of {self.total_length}")
        self.piece, self.offset, self._forwarded = piece, offset, piece
        self._offsets[piece] = offset
        self._entries[piece] = {}
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    @contextmanager
    def recomputing(self, piece: int) -> Iterator["SequenceCarry"]:
        """Runs piece ``piece``'s backward with this carry current, for a forward that checkpointing recomputes.

        A recomputed attention joins the same earlier keys and values as the
        forward did (the leaves, still held: backwards run in reverse piece
        order) and records nothing: the piece's own entries stay those of its
        forward, whose graph the extra roots belong to.
        """
        if piece not in self._entries:
            raise RuntimeError(f"recomputing piece {piece}, whose keys and values are not held "
                               f"(held: {self.held_pieces})")
        token = _ACTIVE.set(self)
        was = self.piece, self.offset
        self._recomputing, self.piece, self.offset = piece, piece, self._offsets[piece]
        try:
            yield self
        finally:
            self._recomputing = None
            self.piece, self.offset = was
            _ACTIVE.reset(token)

    def joined_leaves(self, piece: int) -> list[torch.Tensor]:
        """The leaves ``piece``'s forward joined (earlier pieces' keys and values, every layer): the inputs of its
        graph, besides its activations, whose gradients its backward owes the earlier pieces."""
        return [leaf for j in range(piece) for e in self._entries.get(j, {}).values()
                for leaf in (e.leaf_k, e.leaf_v) if leaf is not None]

    def leaf_gradients(self) -> list[torch.Tensor]:
        """The gradients held on the held pieces' leaves (what later pieces owe them so far)."""
        return [leaf.grad for entries in self._entries.values() for e in entries.values()
                for leaf in (e.leaf_k, e.leaf_v) if leaf is not None and leaf.grad is not None]

    def join(self, layer: Hashable, k: torch.Tensor, v: torch.Tensor, key_bias: Optional[torch.Tensor]
             ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[Optional[torch.Tensor]]]:
        """Records the running piece's (k, v) of ``layer``; returns the keys, values and key biases of pieces 0..now.

        Earlier pieces come as their detached leaves (or as they are, where
        they need no gradient), the running piece as given. Under
        ``recomputing`` nothing is recorded.
        """
        if _ACTIVE.get() is not self:
            raise RuntimeError("the carry's attention ran outside `with carry.active(piece=...)`")
        if self._recomputing is not None:
            piece = self._recomputing
            if layer not in self._entries[piece]:
                raise RuntimeError(f"a recomputation of piece {piece} ran attention layer {layer!r}, which its "
                                   "forward did not run")
            earlier = [self._entries[j][layer] for j in range(piece)]
            return ([e.leaf_k if e.leaf_k is not None else e.k for e in earlier] + [k],
                    [e.leaf_v if e.leaf_v is not None else e.v for e in earlier] + [v],
                    [e.key_bias for e in earlier] + [key_bias])
        piece = self.piece
        entries = self._entries[piece]
        if layer in entries:
            raise RuntimeError(f"attention layer {layer!r} called the carry twice in piece {piece}: "
                               f"each attention layer of a stage needs its own layer id")
        length = k.shape[-2]
        if self._lengths.setdefault(piece, length) != length:
            raise ValueError(f"piece {piece}: layer {layer!r} has {length} keys, an earlier layer "
                             f"{self._lengths[piece]}")
        missing = [j for j in range(piece) if layer not in self._entries.get(j, {})]
        if missing:
            raise RuntimeError(f"attention layer {layer!r} did not call the carry in pieces {missing} "
                               f"(or they were released before piece {piece}'s forward)")
        earlier = [self._entries[j][layer] for j in range(piece)]
        seen = sum(e.k.shape[-2] for e in earlier)
        if seen != self.offset:
            raise ValueError(f"piece {piece} starts at offset {self.offset}, but layer {layer!r} holds {seen} "
                             f"earlier keys: pass each piece's offset as the sum of the earlier pieces' lengths")
        end = self.offset + length
        if self.total_length is not None and (end > self.total_length or
                                              (piece == self.pieces - 1 and end != self.total_length)):
            raise ValueError(f"the pieces cover positions 0..{end} of a sequence of {self.total_length}")
        later = piece < self.pieces - 1  # the last piece's keys are joined by no one
        entries[layer] = _Entry(k, v, _leaf(k) if later else None, _leaf(v) if later else None, key_bias)
        ks = [e.leaf_k if e.leaf_k is not None else e.k for e in earlier] + [k]
        vs = [e.leaf_v if e.leaf_v is not None else e.v for e in earlier] + [v]
        return ks, vs, [e.key_bias for e in earlier] + [key_bias]

    def _check_backward_order(self, piece: int, what: str) -> None:
        if self._forwarded != self.pieces - 1:
            raise RuntimeError(f"{what}({piece}) before every piece ran its forward "
                               f"(the last was {self._forwarded} of {self.pieces})")
        if not self._entries or piece != max(self._entries):
            raise RuntimeError(f"{what}({piece}): pieces run their backwards in reverse order and each is released "
                               f"after its backward; held now: {self.held_pieces}")

    def extra_roots(self, piece: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(tensor in ``piece``'s graph, gradient) pairs its backward adds to ``[output]`` and ``[grad_output]``.

        The gradients the later pieces' backwards left in the leaves of
        ``piece``'s keys and values, for every layer that has one.
        """
        self._check_backward_order(piece, "extra_roots")
        roots = []
        for e in self._entries[piece].values():
            for tensor, leaf in ((e.k, e.leaf_k), (e.v, e.leaf_v)):
                if leaf is not None and leaf.grad is not None:
                    roots.append((tensor, leaf.grad))
        return roots

    def release(self, piece: int) -> None:
        """Frees ``piece``'s keys, values and leaves: call it after the piece's backward."""
        self._check_backward_order(piece, "release")
        del self._entries[piece]

    def check_carried(self, piece: Optional[int] = None, model: Any = None) -> None:
        """Raises ``PiecesNotSupportedError`` if ``piece``'s forward ran attention that did not use the carry.

        Call it after a piece's forward on a stage that holds attention
        layers: with more than one piece, no layer calling the carry means the
        model's attention attends within the piece only. ``model`` (optional)
        names its attention implementation in the message.
        """
        piece = self.piece if piece is None else piece
        if self.pieces == 1 or piece is None:
            return
        layers = set(self._entries.get(piece, {}))
        if not layers:
            raise PiecesNotSupportedError(_not_carried_message(piece, self.pieces, model))
        first = set(self._entries.get(0, layers))
        if layers != first:
            raise PiecesNotSupportedError(
                f"piece {piece}'s attention called the carry from layers {sorted(map(repr, layers))}, piece 0's from "
                f"{sorted(map(repr, first))}: every attention layer must call it in every piece")


def _not_carried_message(piece: int, pieces: int, model: Any = None) -> str:
    """Says what is missing when piece ``piece`` of ``pieces`` ran a forward whose attention ignored the carry."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    where = f" (this model's attn_implementation is {impl!r})" if impl is not None else ""
    return (f"the model's attention does not carry sequence pieces{where}: piece {piece} of {pieces} ran a forward "
            f"in which no attention layer called the carry, so each piece would attend within itself only. Call "
            f"pipeline_ext.seqchunks.chunked_causal_attention in the model's attention, or, for a Hugging Face "
            f"model, call pipeline_ext.seqchunks.register_hf_attention() and set "
            f"attn_implementation={DEFAULT_HF_NAME!r} (model.set_attn_implementation or the config)")


def _leaf(t: torch.Tensor) -> Optional[torch.Tensor]:
    return t.detach().requires_grad_() if t.requires_grad else None


def piece_positions(carry: Optional[SequenceCarry], length: int, device: Any = None) -> torch.Tensor:
    """The running piece's positions, ``arange(offset, offset + length)`` (``arange(length)`` without a carry).

    Use these for rotary embeddings (an HF model's ``position_ids``): a first
    stage that builds ``arange(length)`` itself gives every piece after the
    first the positions of the sequence's start.
    """
    offset = 0 if carry is None else carry.offset
    if carry is not None and carry.total_length is not None and offset + length > carry.total_length:
        raise ValueError(f"positions {offset}..{offset + length} past a sequence of {carry.total_length}")
    return torch.arange(offset, offset + length, device=device)


def check_rope(config: Any) -> None:
    """Refuses rope scaling whose frequencies depend on the longest position a forward sees.

    ``config``: a Hugging Face config (``rope_parameters``, or the older
    ``rope_scaling``), a dict of one, or a rope dict itself. With pieces, each
    piece's forward sees a different longest position, so each would rotate
    by different frequencies than the unsplit sequence.
    """
    for params in _rope_dicts(config):
        kind = params.get("rope_type", params.get("type"))
        if kind in _POSITION_DEPENDENT_ROPE:
            raise PiecesNotSupportedError(
                f"rope type {kind!r} {_POSITION_DEPENDENT_ROPE[kind]}: with sequence pieces each piece would use "
                f"other frequencies than the whole sequence. Use a rope type with fixed frequencies (default, "
                f"linear, yarn, llama3) or run the sequence unsplit")


def _rope_dicts(config: Any) -> list[Mapping]:
    if isinstance(config, Mapping) and ("rope_type" in config or "type" in config):
        return [config]
    found = []
    for attr in ("rope_parameters", "rope_scaling"):
        value = config.get(attr) if isinstance(config, Mapping) else getattr(config, attr, None)
        if isinstance(value, Mapping):
            if "rope_type" in value or "type" in value:
                found.append(value)
            else:  # per layer type: {"full_attention": {...}, "sliding_attention": {...}}
                found.extend(v for v in value.values() if isinstance(v, Mapping))
    return found
