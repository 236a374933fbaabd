"""Sequence pieces at the front end: a schedule's ``seq_chunks=K`` cuts each microbatch into K pieces.

The schedule (``schedules/pieces.py``) runs units, piece k of microbatch j
being unit ``j * K + k``; the runners carry keys and values between a
sequence's pieces (``runtime/pieces.py``). What is left is here: cutting a
step's batch into units (microbatches along the batch dimension as without
pieces, then each along ``seq_dim``), weighting each unit's loss by its
share of the batch, and putting the outputs and losses back per microbatch.

Cut: every tensor of the inputs, keyword arguments and target whose
``seq_dim`` has the sequence's length (the first positional input's) is cut
there; anything else goes whole to every piece. Targets are cut as they are:
they must already be shifted (``target[t]`` belongs to position ``t``), since
a loss that shifts inside a piece would lose each piece's last position. The
lengths are ``schedules.pieces.piece_lengths``' (``seq_split``): equal, or
balanced by cost, later pieces shorter since they attend to more keys.

Weights: the step's objective is the one without pieces (microbatches
weighted by their rows, 1 each with ``scale_grads=False``, or by the loss's
own ``microbatch_weights``); a mean-reduced loss of a piece is the mean over
its elements, so within its microbatch a piece weighs its share of the
target's elements (its length), or of the loss's own weights
(``PieceWeightedLoss``).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from pipeline_ext.runtime.microbatch import microbatch_weights
from pipeline_ext.schedules.pieces import attention_share, piece_lengths

__all__ = ["PieceCut", "PieceWeightedLoss"]


class PieceCut:
    """Cuts microbatches into pieces along ``seq_dim`` and puts outputs back; one per schedule."""

    def __init__(self, pieces: int, seq_dim: int, split: Union[str, float] = "equal") -> None:
        if isinstance(pieces, bool) or not isinstance(pieces, int) or pieces < 1:
            raise ValueError(f"seq_chunks must be a positive int, got {pieces!r}")
        if isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or seq_dim < 1:
            raise ValueError(f"seq_dim must be an int >= 1 (dimension 0 is the batch), got {seq_dim!r}")
        attention_share(split)  # checks ``split``
        self.pieces, self.seq_dim, self.split = pieces, seq_dim, split

    def _length(self, microbatch: int, values: Sequence[Any]) -> int:
        leaves, _ = tree_flatten(list(values))
        for t in leaves:
            if isinstance(t, torch.Tensor) and t.dim() > self.seq_dim:
                return t.shape[self.seq_dim]
        raise ValueError(f"microbatch {microbatch}: no input tensor has a sequence dimension {self.seq_dim} to cut "
                         f"into seq_chunks={self.pieces} pieces")

    def cut(self, per_microbatch: Sequence[Any], lengths: Sequence[int], microbatch: int) -> list[Any]:
        """One microbatch's value (a tuple of args, a dict, a target) as one value per piece."""
        length = sum(lengths)

        def piece(k: int) -> Callable[[Any], Any]:
            start = sum(lengths[:k])

            def take(t: Any) -> Any:
                if isinstance(t, torch.Tensor) and t.dim() > self.seq_dim and t.shape[self.seq_dim] == length:
                    return t.narrow(self.seq_dim, start, lengths[k])
                return t

            return take

        return [tree_map(piece(k), per_microbatch) for k in range(self.pieces)]

    def units(self, args: Optional[list], kwargs: Optional[list], targets: Optional[list]
              ) -> tuple[Optional[list], Optional[list], Optional[list]]:
        """Per-microbatch lists (any of them None: not given on this rank) as per-unit lists."""
        n = next((len(x) for x in (args, kwargs, targets) if x is not None), 0)
        lengths = []  # per microbatch: its pieces' lengths
        for j in range(n):
            found = [x[j] for x in (args, kwargs, targets) if x is not None and x[j] is not None]
            lengths.append(piece_lengths(self._length(j, found), self.pieces, self.split))

        def cut_all(values: Optional[list]) -> Optional[list]:
            if values is None:
                return None
            return [p for j, v in enumerate(values) for p in (self.cut(v, lengths[j], j) if v is not None
                                                               else [None] * self.pieces)]

        return cut_all(args), cut_all(kwargs), cut_all(targets)

    def merge(self, outputs: list[Any]) -> list[Any]:
        """Per-unit outputs as per-microbatch ones: each microbatch's pieces joined along ``seq_dim``."""
        k = self.pieces

        def join(*parts: Any) -> Any:
            first = parts[0]
            if isinstance(first, torch.Tensor) and first.dim() > self.seq_dim:
                return torch.cat(parts, dim=self.seq_dim)
            return first

        return [_tree_zip(join, outputs[j * k:(j + 1) * k]) for j in range(len(outputs) // k)]


def _tree_zip(fn: Callable[..., Any], trees: list[Any]) -> Any:
    """``fn`` over the leaves of structurally equal trees."""
    flat = [tree_flatten(t) for t in trees]
    leaves, spec = flat[0]
    return tree_unflatten([fn(*(f[0][i] for f in flat)) for i in range(len(leaves))], spec)


class PieceWeightedLoss:
    """The user's loss, each unit weighted so that the step's objective is the one without pieces.

    Without pieces a microbatch's loss is weighted by its share of the rows
    (1 with ``scale_grads=False``, torch's plain sum), or by the loss's own
    ``microbatch_weights`` (``TokenMeanLoss``: its share of valid tokens). A
    piece's loss is the mean over the piece, so within its microbatch a piece
    weighs its share of the microbatch's target elements (or of the loss's
    own weights): the pieces of one microbatch add up to that microbatch's
    loss, and turning ``seq_chunks`` on changes no gradient, also when the
    microbatches have different lengths (``step_microbatches``).
    """

    def __init__(self, loss_fn: Callable[..., torch.Tensor], pieces: int) -> None:
        self.loss_fn = loss_fn
        self.pieces = pieces
        self._own = getattr(loss_fn, "microbatch_weights", None)

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.loss_fn(*args, **kwargs)

    def piece_weights(self, sizes: Sequence[int], targets: list[Any], scale_grads: bool) -> list[Any]:
        """Each unit's loss weight (``runtime/microbatch.loss_weights``); ``sizes`` (rows) and ``targets`` per unit,
        a microbatch's K pieces next to each other."""
        k = self.pieces
        if self._own is not None:
            own = self._own(targets)
            if isinstance(own, torch.Tensor):  # stays on its device (never read on the host)
                own = own.reshape(-1, k)
                if not scale_grads:  # a microbatch's loss weighs 1: its pieces share it by their own weights
                    own = own / own.sum(dim=1, keepdim=True).clamp(min=torch.finfo(own.dtype).tiny)
                return list(own.reshape(-1).unbind(0))
            own = [float(w) for w in own]
            if scale_grads:
                return own
            shares = own
        else:
            shares = []
            for t in targets:
                leaves = [x for x in tree_flatten(t)[0] if isinstance(x, torch.Tensor)]
                if not leaves:
                    raise ValueError("seq_chunks weighs each piece's loss by its target's elements; a target has "
                                     "no tensor")
                shares.append(float(leaves[0].numel()))
        rows = [sizes[j] for j in range(0, len(sizes), k)]
        per_mb = microbatch_weights(rows) if scale_grads and self._own is None else [1.0] * len(rows)
        out: list[Any] = []
        for j, weight in enumerate(per_mb):
            group = shares[j * k:(j + 1) * k]
            total = sum(group)
            out += [weight * g / total if total else 0.0 for g in group]
        return out
