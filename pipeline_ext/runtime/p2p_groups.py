"""One process group per direction between two pipeline ranks, so NCCL never deadlocks on receives posted ahead.

Why: NCCL runs every point-to-point operation of one communicator on one
internal stream, in the order the host issued them, and a receive there holds
the stream until its message arrives. torch gives each pair of ranks one
communicator. The executor posts receives ahead of use (its receive window),
so on one communicator a receive posted early would hold up a send issued
after it to the same peer, on both ranks at once: rank 0 waits for a gradient
before its activation can leave, rank 1 waits for that activation before it
can make the gradient. With one 2-rank group per direction, each stream
carries one direction's messages, issued in the same order at both ends (the
plan's ordering rule, ``protocol/plan.py``), so every stream drains.

Creating a group is collective, and NCCL creates a group's communicator
lazily, inside its first operation, which is collective too. So the groups
are made the way DeviceMesh makes its groups: every rank of the default group
creates every direction group of every pipeline (``new_group`` over the
default group, in one sorted order; non-members get a non-member handle), and
the two members of each run one small all-reduce on it right away. No
communicator is then first made inside a step, where the schedule decides the
order and it differs between ranks. (``new_group(...,
use_local_synchronization=True)`` would let non-members stay out, but it
names a group after how many groups each process already has, so two ranks
with different histories make differently named groups and wait forever.)
This makes building an NCCL pipeline, and giving it a schedule with new
pairs, a collective over the default group: every rank must do it together,
as every rank creates a DeviceMesh together.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["message_pairs", "matches_by_order", "DirectionGroups"]


def matches_by_order(group: Optional[dist.ProcessGroup], device: torch.device) -> bool:
    """True when ``group`` moves ``device`` tensors over NCCL, which matches messages by order, not tag.

    Only there do the directions need groups of their own; Gloo (and shared
    memory) match every message by its tag.
    """
    if torch.device(device).type == "cpu":
        return False
    try:
        backend = str(dist.get_backend(group if group is not None else dist.group.WORLD))
    except (RuntimeError, ValueError):
        return False
    return "nccl" in backend.lower()


def message_pairs(stage_to_rank: Sequence[int]) -> list[tuple[int, int]]:
    """The ordered pairs of ranks (sender, receiver) that activations or gradients move between, sorted."""
    pairs = set()
    for a, b in zip(stage_to_rank, stage_to_rank[1:]):
        if a != b:
            pairs.update({(a, b), (b, a)})
    return sorted(pairs)


class DirectionGroups:
    """The direction groups of one pipeline group on this rank, made once and reused across schedules.

    ``route(channel, stage_to_rank)`` makes the groups a schedule needs (if
    not made yet; collective over the default group) and routes the channel's
    messages through them: messages to a peer over the (me, peer) group, from
    it over the (peer, me) group.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], device: torch.device) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.device = torch.device(device)
        self.rank = dist.get_rank(self.group)
        self._global = dist.get_process_group_ranks(self.group)  # group rank -> global rank
        self._me = self._global[self.rank]
        self._groups: dict[tuple[int, int], dist.ProcessGroup] = {}  # (sender, receiver) global ranks

    def _backend(self) -> Optional[str]:
        try:
            return dist.get_backend(self.group)
        except (RuntimeError, ValueError):
            return None

    def route(self, channel, stage_to_rank: Sequence[int]) -> None:
        """Make the groups ``stage_to_rank``'s messages need, then route ``channel`` (a DistChannel) through them."""
        mine = [(self._global[a], self._global[b]) for a, b in message_pairs(stage_to_rank)]
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)  # every pipeline's pairs (other data-parallel replicas' too)
        for pair in sorted({tuple(p) for pairs in everyone for p in pairs}):
            if pair in self._groups:
                continue
            made = dist.new_group(sorted(pair), backend=self._backend())
            if self._me in pair:  # make its communicator now, on both members, in this order
                dist.all_reduce(torch.zeros(1, device=self.device), group=made)
            self._groups[pair] = made
        for a, peer in mine:
            if a != self._me:
                continue
            out, back = self._groups[(self._me, peer)], self._groups[(peer, self._me)]
            channel.set_route(self._global.index(peer), out, dist.get_group_rank(out, peer),
                              back, dist.get_group_rank(back, peer))

    def __len__(self) -> int:
        """How many direction groups this rank is a member of."""
        return sum(1 for pair in self._groups if self._me in pair)
