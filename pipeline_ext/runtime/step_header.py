"""The step header: what every rank must know before a multi-process step starts.

The rank holding stage 0 splits the batch, so only it knows the step's shapes;
every other rank needs them (as a *signature*, to pick cached message layouts)
and the rows per microbatch (loss weights). This module computes the signature
cheaply and moves the header with direct point-to-point messages.

Why not ``dist.broadcast``: on Gloo a collective runs on the process group's
worker thread, so each rank pays a hand-off to that thread and back (two thread
wake-ups per rank per step, on a critical path), while a point-to-point send
or receive runs in the caller's thread. The sender does not wait for its sends
here; ``finish`` reaps them after the step, so stage 0 starts computing at once.
"""
from __future__ import annotations

import hashlib
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

__all__ = ["HEADER_TAG", "REJECTED", "StepHeader", "step_signature"]

# Outside the executor's message tags (< 2^30) and their layout bit (2^30).
HEADER_TAG = 2**31 - 1

_CACHE_LIMIT = 64

#: the signature sent when the rank of stage 0 rejected the step's batch (real ones are >= 0)
REJECTED = -1


def _leaf_key(x: Any) -> Any:
    return (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__


class StepHeader:
    """Shares (signature, microbatch sizes) from the rank of stage 0 with the other ranks of ``group``."""

    def __init__(self, group: Optional[dist.ProcessGroup], rank: int, num_ranks: int, first_rank: int,
                 n_microbatches: int, device: torch.device) -> None:
        self.group, self.rank, self.num_ranks = group, rank, num_ranks
        self.first_rank, self.n_microbatches, self.device = first_rank, n_microbatches, device
        self._pending: list[Any] = []  # (tensor, works) of headers in flight
        self._signatures: dict[tuple, int] = {}

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def signature(self, args: Sequence[Any], kwargs: dict, sizes: Sequence[int], chunk_spec: Any) -> int:
        """A 62-bit hash of the batch's pytree structure, shapes and dtypes, the split and the chunk spec.

        The microbatches' shapes follow from these, so hashing the whole batch
        once stands for hashing every microbatch. Cached per distinct key.
        """
        leaves, spec = pytree.tree_flatten((tuple(args), kwargs))
        key = (spec, tuple(_leaf_key(x) for x in leaves), tuple(sizes), repr(chunk_spec))
        sig = self._signatures.get(key)
        if sig is None:
            sig = step_signature(repr(key))
            if len(self._signatures) >= _CACHE_LIMIT:
                self._signatures.clear()
            self._signatures[key] = sig
        return sig

    def share(self, signature: int, sizes: Sequence[int]) -> tuple[int, list[int]]:
        """On the rank of stage 0: start sending; elsewhere: receive. Returns (signature, sizes) everywhere."""
        if self.num_ranks == 1:
            return signature, list(sizes)
        if self.rank == self.first_rank:
            header = torch.tensor([signature, *sizes], dtype=torch.int64, device=self.device)
            works = [dist.isend(header, self._global(r), group=self.group, tag=HEADER_TAG)
                     for r in range(self.num_ranks) if r != self.rank]
            self._pending.append((header, works))
            return signature, list(sizes)
        header = torch.empty(1 + self.n_microbatches, dtype=torch.int64, device=self.device)
        dist.recv(header, self._global(self.first_rank), group=self.group, tag=HEADER_TAG)
        values = header.tolist()
        return values[0], values[1:]

    def finish(self) -> None:
        """Wait for the header sends of the step (they completed long ago on any real step)."""
        pending, self._pending = self._pending, []
        for _, works in pending:
            for w in works:
                w.wait()

    def drop(self) -> None:
        """Forget sends of a failed step (the group is not reused after a failure)."""
        self._pending = []


def step_signature(text: str) -> int:
    """62 bits of blake2b over ``text``: fits an int64 header slot with room to spare."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2
