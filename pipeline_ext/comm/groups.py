"""The process groups a pipeline makes: every one with every rank (GroupMaker), one per direction for NCCL.

[Note: groups made with every rank]
Making groups (``GroupMaker``): torch's ``new_group`` must be called by every
rank of the default group, in the same order. Its escape hatch,
``use_local_synchronization=True`` (only the members call), names a group
after how many groups the process already has, so two members with different
histories (one rank made an extra group earlier, or belongs to two different
tied-parameter groups) pick different names and wait for each other forever
(measured: a 3-rank ring hangs on its second group). So the library makes its
groups the way DeviceMesh does: the ranks exchange which groups they need, and
every rank makes all of them in one sorted order. Building a pipeline that
needs groups (GPU stages, tied parameters across part of it) is therefore
collective over the default group.

[Note: why DirectionGroups]
One group per direction (``DirectionGroups``), for NCCL pipelines: NCCL runs
every point-to-point operation of one communicator on one internal stream, in
the order the host issued them, and a receive there holds the stream until
its message arrives. torch gives each pair of ranks one communicator. The
executor posts receives ahead of use (its receive window), so on one
communicator a receive posted early would hold up a send issued after it to
the same peer, on both ranks at once: rank 0 waits for a gradient before its
activation can leave, rank 1 waits for that activation before it can make the
gradient. With one 2-rank group per direction, each stream carries one
direction's messages, issued in the same order at both ends (the plan's
ordering rule, ``comm/comm_plan.py``), so every stream drains.

NCCL also makes things lazily, inside the first operation that needs them,
and both members must take part: the communicator (inside the first
operation on the group, collective too), and each pair's point-to-point
connection (inside the first send or receive between them: a handshake
with the peer, blocking, when the batch is issued). In a pipeline the first
of those would come in schedule order, different on every rank: rank 0
posts its first receive (a gradient, over the (1, 0) group) while rank 1
posts its own (an activation, over the (0, 1) group), and each waits inside
its post for the other to join a handshake it never starts. So the members
of each direction group, right after making it, run one small all-reduce and
one message in the group's direction (a batch, as the channel sends), every
rank in the same sorted order of groups: a total order, so every handshake
has both members.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["message_pairs", "matches_by_order", "GroupMaker", "DirectionGroups", "group_timeout"]


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


class GroupMaker:
    """Makes process groups together with every rank of the default group, as torch's ``new_group`` requires.

    ``make(mine)``: ``mine`` are the groups this rank needs, as tuples of
    global ranks (a tuple is a group's identity: (0, 1) and (1, 0) are two
    groups of the same members). Collective over the default group: the ranks
    exchange what they need, and every rank makes every group that some rank
    needs and none has made yet, in one sorted order (non-members get a
    non-member handle). Returns the groups this rank needs.
    ``warm_on``: a device on which the two members of each new group run one
    all-reduce right away, so its communicator exists before anything else
    uses it (NCCL makes communicators lazily, inside a first operation).
    ``connect``: the groups are directions (sender, receiver), and the sender
    also sends the receiver one message on ``warm_on`` (a batch, as the
    channel sends), so their point-to-point connection exists too (see
    [Note: why DirectionGroups]).
    """

    #: elements of the message that connects a direction (1 MiB of float32: NCCL may spread a message
    #: over several channels by its size, and each channel's connection is made by its first message)
    CONNECT_NUMEL = 1 << 18

    def __init__(self, backend: Optional[str] = None, warm_on: Optional[torch.device] = None,
                 connect: bool = False) -> None:
        self.backend, self.warm_on, self.connect = backend, warm_on, connect
        self._made: dict[tuple[int, ...], dist.ProcessGroup] = {}  # every group made, non-member handles too

    def make(self, mine: Sequence[Sequence[int]]) -> dict[tuple[int, ...], dist.ProcessGroup]:
        wanted = [tuple(g) for g in mine]
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, wanted)
        me = dist.get_rank()
        for key in sorted({tuple(g) for gs in everyone for g in gs} - set(self._made)):
            made = dist.new_group(sorted(set(key)), backend=self.backend)
            if me in key and self.warm_on is not None:
                dist.all_reduce(torch.zeros(1, device=self.warm_on), group=made)
                if self.connect:
                    self._connect(key, made)
            self._made[key] = made
        return {key: self._made[key] for key in wanted}

    def _connect(self, key: tuple[int, ...], group: dist.ProcessGroup) -> None:
        """One message from ``key[0]`` to ``key[1]`` over ``group``, issued as a batch (the channel's way)."""
        sender, receiver = key
        me = dist.get_rank()
        buf = torch.zeros(self.CONNECT_NUMEL, device=self.warm_on)
        op = dist.P2POp(dist.isend, buf, receiver, group=group) if me == sender else \
            dist.P2POp(dist.irecv, buf, sender, group=group)
        for work in dist.batch_isend_irecv([op]):
            work.wait()

    def __len__(self) -> int:
        """How many of the groups made so far hold this rank."""
        return sum(1 for key in self._made if dist.get_rank() in key)


class DirectionGroups:
    """The direction groups of one pipeline group on this rank, made once and reused across schedules.

    ``route(channel, stage_to_rank)`` makes the groups a schedule needs (if
    not made yet; collective over the default group, see ``GroupMaker``) and
    routes the channel's messages through them: messages to a peer over the
    (me, peer) group, from it over the (peer, me) group.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], device: torch.device) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self._global = dist.get_process_group_ranks(self.group)  # group rank -> global rank
        self._me = self._global[self.rank]
        try:
            backend: Optional[str] = dist.get_backend(self.group)
        except (RuntimeError, ValueError):
            backend = None
        self._maker = GroupMaker(backend, warm_on=torch.device(device), connect=True)

    def route(self, channel, stage_to_rank: Sequence[int]) -> None:
        """Make the groups ``stage_to_rank``'s messages need, then route ``channel`` (a DistChannel) through them."""
        mine = [(self._global[a], self._global[b]) for a, b in message_pairs(stage_to_rank)]
        groups = self._maker.make(mine)
        for a, peer in mine:
            if a != self._me:
                continue
            out, back = groups[(self._me, peer)], groups[(peer, self._me)]
            channel.set_route(self._global.index(peer), out, dist.get_group_rank(out, peer),
                              back, dist.get_group_rank(back, peer))

    def __len__(self) -> int:
        """How many direction groups this rank is a member of."""
        return len(self._maker)


def group_timeout(group: Optional[dist.ProcessGroup]) -> float:
    """The process group's own timeout, in seconds: what ``timeout=None`` means."""
    group = group if group is not None else dist.group.WORLD
    try:
        backend = group._get_backend(torch.device("cpu" if dist.get_backend(group) == "gloo" else "cuda"))
        return backend.options._timeout.total_seconds()
    except (AttributeError, RuntimeError, ValueError):  # a backend without options: torch's default
        return dist.default_pg_timeout.total_seconds()
