"""One stage's sequence pieces (Seq1F1B): the carries of keys and values between a sequence's pieces.

A schedule over sequence pieces (``schedules/pieces.py``) hands the runner
units: unit ``j * K + k`` is piece k of sequence (microbatch) j. Causal
attention in piece k reads the keys and values of pieces 0..k-1 of the same
sequence on the same stage, so the stage keeps one ``SequenceCarry`` per
sequence in flight (``pipeline_ext.seqchunks``): each piece's forward runs
with it active at the piece's offset; each piece's backward adds the
gradients later pieces left on its keys and values as extra roots, and owes
the earlier pieces the gradients of the leaves it joined (a B accumulates
them as it does any leaf's; an I, which computes input gradients only, is
given them as inputs and adds them to the leaves' ``.grad``); after its
backward the piece's entries go, and after piece 0's the carry.

A recomputed forward (activation checkpointing inside the model) runs in
backward: the carry is made current again for it (``recomputing``), so the
recomputed attention joins the same earlier keys and values.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import nn

from pipeline_ext.seqchunks import PiecesNotSupportedError, SequenceCarry
from pipeline_ext.seqchunks.carry import DEFAULT_HF_NAME
from pipeline_ext.seqchunks.hf import hf_attention_not_carrying

__all__ = ["StagePieces"]


def _has_attention(module: nn.Module) -> bool:
    """Whether the stage holds attention layers (by class: torch's and Hugging Face's are named so)."""
    return any(isinstance(m, nn.MultiheadAttention) or "Attention" in type(m).__name__ for m in module.modules())


class StagePieces:
    """The carries of one stage, by sequence; ``pieces`` = K, ``seq_dim``: the inputs' sequence dimension."""

    def __init__(self, module: nn.Module, stage_index: int, pieces: int, seq_dim: int) -> None:
        self.pieces, self.seq_dim, self.stage_index = pieces, seq_dim, stage_index
        self.module = module
        self.has_attention = _has_attention(module)
        impl = hf_attention_not_carrying(module) if self.has_attention else None
        if impl is not None:  # refused when the schedule is built, on every rank, not at a step's first forward
            raise PiecesNotSupportedError(
                f"stage {stage_index}: the model's attention does not carry sequence pieces (its attn_implementation "
                f"is {impl!r}), so each piece would attend within itself only: call "
                "pipeline_ext.seqchunks.register_hf_attention() and set attn_implementation to the name it returns "
                f"({DEFAULT_HF_NAME!r}; model.set_attn_implementation or the config)")
        self._carries: dict[int, SequenceCarry] = {}
        self._next_offset: dict[int, int] = {}

    def reset(self) -> None:
        self._carries.clear()
        self._next_offset.clear()

    def _length(self, args: Sequence[Any], unit: int) -> int:
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() > self.seq_dim:
                return a.shape[self.seq_dim]
        raise ValueError(f"stage {self.stage_index}, unit {unit}: no input tensor has a sequence dimension "
                         f"{self.seq_dim} to cut into pieces")

    @contextlib.contextmanager
    def forward(self, unit: int, args: Sequence[Any]) -> Iterator[Optional[SequenceCarry]]:
        """Runs piece ``unit % K``'s forward with its sequence's carry active; checks the model used it."""
        seq, piece = divmod(unit, self.pieces)
        if piece == 0:
            self._carries[seq] = SequenceCarry(self.pieces)
            self._next_offset[seq] = 0
        carry = self._carries.get(seq)
        if carry is None:
            raise RuntimeError(f"stage {self.stage_index}: piece {piece} of sequence {seq} ran before its piece 0")
        offset = self._next_offset[seq]
        self._next_offset[seq] = offset + self._length(args, unit)
        with carry.active(piece=piece, offset=offset):
            yield carry
        if self.has_attention:
            carry.check_carried(piece, self.module)
        if not torch.is_grad_enabled() and piece == self.pieces - 1:  # no backward will release them
            self.drop(seq)

    def held(self) -> list[int]:
        """The sequences whose carries are held: a piece's forward ran, their piece 0's backward has not."""
        return sorted(self._carries)

    def drop(self, seq: int) -> None:
        self._carries.pop(seq, None)
        self._next_offset.pop(seq, None)

    def leaves(self, unit: int) -> list[torch.Tensor]:
        """The earlier pieces' leaves piece ``unit``'s forward joined (inputs of its graph that need gradients)."""
        seq, piece = divmod(unit, self.pieces)
        return self._carries[seq].joined_leaves(piece)

    def roots(self, unit: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(tensor, gradient) pairs piece ``unit``'s backward adds: what later pieces owe its keys and values."""
        seq, piece = divmod(unit, self.pieces)
        return self._carries[seq].extra_roots(piece)

    def recomputing(self, unit: int) -> contextlib.AbstractContextManager:
        """Around a backward of ``unit``: a forward recomputed there joins the same earlier keys and values."""
        seq, piece = divmod(unit, self.pieces)
        carry = self._carries.get(seq)
        if carry is None or piece not in carry.held_pieces:
            return contextlib.nullcontext()
        return carry.recomputing(piece)

    def done(self, unit: int) -> None:
        """After piece ``unit``'s backward (B or I): its keys and values go; after piece 0's, the carry."""
        seq, piece = divmod(unit, self.pieces)
        self._carries[seq].release(piece)
        if piece == 0:
            self.drop(seq)

    def carried_gradients(self) -> list[torch.Tensor]:
        """The gradients later pieces left on earlier pieces' keys and values, held until those pieces' backward
        (what a memory measure adds to the graph's saved tensors)."""
        return [g for carry in self._carries.values() for g in carry.leaf_gradients()]

    @staticmethod
    def owe(leaves: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]]) -> None:
        """An I's gradients of the joined leaves, added to their ``.grad`` (where later pieces left theirs too)."""
        for leaf, g in zip(leaves, grads):
            if g is not None:
                leaf.grad = g if leaf.grad is None else leaf.grad + g
