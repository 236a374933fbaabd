"""Lowering: where stages live, and the SEND/RECV actions that connect them.

A generator says what each rank computes; the runtime also needs to know what
it sends and receives, in an order that blocking point-to-point (NCCL, Gloo)
can match without deadlock. This module holds the stage-to-rank maps, turns an
unlowered schedule into a lowered one and checks lowered schedules for the two
ways they can hang: a receive that waits for a send that can never come
(deadlock), and sends and receives between one pair of ranks posted in
different orders (NCCL matches them first-in, first-out).

Comm semantics are torch.distributed.pipelining's: ``SEND_F s m`` on stage s's
rank sends stage s's output of microbatch m to stage s+1's rank, ``RECV_F s m``
receives stage s's input; ``SEND_B s m`` sends the grad w.r.t. stage s's input
to stage s-1's rank, ``RECV_B s m`` receives the grad w.r.t. stage s's output.
Neighbouring stages on one rank (the bottom of a V) hand over locally.
"""
from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

from pipeline_ext.schedules.inorder import run_in_order
from pipeline_ext.schedules.ir import Action, ActionKind, Schedule, ScheduleError, check_structure

F, B, I = ActionKind.F, ActionKind.B, ActionKind.I
SEND_F, RECV_F, SEND_B, RECV_B = ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B
Channel = tuple[int, int]  # (source rank, destination rank)


def loop_placement(p: int, v: int = 1) -> list[int]:
    """Stage s on rank s % p: v stages per rank, each rank's stages p apart."""
    return [s % p for s in range(p * v)]


def v_placement(p: int) -> list[int]:
    """Stage s < p on rank s, stage s >= p on rank 2p-1-s: down the ranks and back up.

    Rank 0 holds the first and the last stage and the hand-over between stages
    p-1 and p stays on rank p-1, which saves one transfer each way.
    """
    return [s if s < p else 2 * p - 1 - s for s in range(2 * p)]


def receives_for(action: Action, stage_to_rank: list[int]) -> list[Action]:
    """The RECVs a compute action consumes (none when the producer is on the same rank)."""
    s, kind, j = action
    here = stage_to_rank[s]
    if kind is F and s > 0 and stage_to_rank[s - 1] != here:
        return [Action(s, RECV_F, j)]
    if kind in (B, I) and s < len(stage_to_rank) - 1 and stage_to_rank[s + 1] != here:
        return [Action(s, RECV_B, j)]
    return []


def sends_for(action: Action, stage_to_rank: list[int]) -> list[Action]:
    """The SENDs a compute action produces (none when the consumer is on the same rank)."""
    s, kind, j = action
    here = stage_to_rank[s]
    if kind is F and s < len(stage_to_rank) - 1 and stage_to_rank[s + 1] != here:
        return [Action(s, SEND_F, j)]
    if kind in (B, I) and s > 0 and stage_to_rank[s - 1] != here:
        return [Action(s, SEND_B, j)]
    return []


_PEER = {SEND_F: (1, RECV_F), RECV_F: (-1, SEND_F), SEND_B: (-1, RECV_B), RECV_B: (1, SEND_B)}


def counterpart(comm: Action, stage_to_rank: list[int]) -> tuple[int, Action]:
    """(peer rank, the matching action that must run there) for a SEND or RECV.

    Raises :class:`ScheduleError` when the peer stage does not exist.
    """
    s, kind, j = comm
    step, peer_kind = _PEER[kind]
    peer_stage = s + step
    if not 0 <= peer_stage < len(stage_to_rank):
        raise ScheduleError(f"{comm} has no peer: stage {peer_stage} does not exist")
    return stage_to_rank[peer_stage], Action(peer_stage, peer_kind, j)


def lower(schedule: Schedule) -> Schedule:
    """Insert SEND/RECV actions; return an already-lowered schedule unchanged (as a copy).

    Each SEND goes right after its producer. Each RECV goes right before its
    consumer, then receives are moved earlier where needed so that, for every
    (source, destination) pair of ranks, the destination receives in the order
    the source sends. Moving a receive earlier keeps it before its consumer;
    whether the result can deadlock is for :func:`check_deadlock` to say.
    FSDP actions (UNSHARD, RESHARD, REDUCE_GRAD) are rank-local and keep their
    places among the compute actions: after the SENDs of the action before
    them, before the RECVs of the one after (an all-gather is issued before
    the rank blocks on a message).
    """
    check_structure(schedule)
    placement = list(schedule.stage_to_rank)
    if schedule.lowered:
        return schedule.with_actions([list(a) for a in schedule.actions])
    compute = schedule.actions
    send_order: dict[Channel, list[Action]] = defaultdict(list)  # expected RECVs, in send order
    for rank, acts in enumerate(compute):
        for action in acts:
            for send in sends_for(action, placement):
                peer, recv = counterpart(send, placement)
                send_order[(rank, peer)].append(recv)
    lowered = []
    for rank, acts in enumerate(compute):
        # [Note: an overlapped pair lowers as two actions]
        # A pair's receives go right before the action that consumes them and its sends right after the action that
        # produces them, as for any two actions: run one after the other (no overlap, or halves that never hand
        # over), the first's output leaves before the second runs and the first never waits on the second's input,
        # which is what the simulator models. A function that runs the pair as one unit gets the receives lying
        # between the two waited on before it and the sends after it (``Executor``); that order is deadlock-free
        # because the validator checks a pair completes as one unit.
        deadline: dict[Action, int] = {}  # RECV -> index of the compute action it must precede
        for i, action in enumerate(acts):
            for recv in receives_for(action, placement):
                deadline[recv] = i
        order_key: dict[Action, tuple[int, int, int]] = {}
        for (src, dst), recvs in send_order.items():
            if dst != rank:
                continue
            latest = len(acts)
            for seq in range(len(recvs) - 1, -1, -1):
                latest = min(deadline.get(recvs[seq], latest), latest)
                order_key[recvs[seq]] = (latest, src, seq)
        at: dict[int, list[Action]] = defaultdict(list)
        for recv in sorted(order_key, key=order_key.__getitem__):
            at[order_key[recv][0]].append(recv)
        row: list[Action] = []
        for i, action in enumerate(acts):
            row.extend(at.pop(i, []))
            row.append(action)
            row.extend(sends_for(action, placement))
        row.extend(a for rest in at.values() for a in rest)  # receives nobody consumes: validate reports them
        lowered.append(row)
    return schedule.with_actions(lowered)


def forward_only(schedule: Schedule) -> Schedule:
    """The lowered forward-only version of ``schedule`` (for eval and ``pipe(x)``).

    The forwards of a valid schedule, in the same order, are a valid
    forward-only schedule; lowering gives them their activation sends and
    receives (no gradients travel).
    """
    return lower(schedule.with_actions([[a for a in acts if a.kind == ActionKind.F] for acts in schedule.actions],
                                       name=f"{schedule.name}-forward", overlapped=()))


def check_fifo(lowered: Schedule) -> None:
    """Raise unless, for every pair of ranks, receives are posted in the order sends are.

    NCCL (and this project's channels) match point-to-point messages between two
    ranks first-in, first-out; a different order would pair a tensor with the
    wrong microbatch or hang.
    """
    placement = lowered.stage_to_rank
    sent: dict[Channel, list[tuple[int, Action]]] = defaultdict(list)
    received: dict[Channel, list[tuple[int, Action]]] = defaultdict(list)
    for rank, acts in enumerate(lowered.actions):
        for pos, action in enumerate(acts):
            if action.kind in (SEND_F, SEND_B):
                peer, recv = counterpart(action, placement)
                sent[(rank, peer)].append((pos, recv))
            elif action.kind in (RECV_F, RECV_B):
                peer, _ = counterpart(action, placement)
                received[(peer, rank)].append((pos, action))
    for (src, dst), recvs in sorted(received.items()):
        expected = sent.get((src, dst), [])
        for k, ((pos, got), (send_pos, want)) in enumerate(zip(recvs, expected)):
            if got != want:
                raise ScheduleError(
                    f"rank {dst}, position {pos}: {got} is receive #{k} from rank {src}, but send #{k} from "
                    f"rank {src} (position {send_pos}) is for {want}: sends and receives between a pair of ranks "
                    "must be in the same order (FIFO matching)"
                )


class _Awaited(NamedTuple):
    action: Action
    rank: int

    def __str__(self) -> str:
        return f"{self.action} on rank {self.rank}"


def as_units(lowered: Schedule) -> Schedule:
    """``lowered`` with each overlapped pair run as one unit: the messages between its two actions moved around it.

    The receives lying between a pair's actions go before its first, the sends after its second: the order a
    function that runs the pair as one unit follows (``Executor._custom``). It only waits earlier and sends later
    than the lowered order, so when it cannot deadlock, neither can the lowered one.
    """
    rows = []
    for acts in lowered.actions:
        row = list(acts)
        pos = {a: i for i, a in enumerate(row)}  # a rearranged span keeps its length: other positions stay
        for first, second in lowered.overlapped:
            if first in pos and second in pos:
                i, j = pos[first], pos[second]
                between = row[i + 1:j]
                recvs = [a for a in between if a.kind in (RECV_F, RECV_B)]
                sends = [a for a in between if a.kind in (SEND_F, SEND_B)]
                others = [a for a in between if not a.is_comm]  # rank-local (FSDP): validate refuses them here
                row[i:j + 1] = recvs + others + [first, second] + sends
        rows.append(row)
    return lowered.with_actions(rows)


def check_deadlock(lowered: Schedule) -> None:
    """Raise unless the lowered schedule runs to completion with blocking receives.

    Sends never block; a RECV blocks until its matching SEND has run. On a hang
    the error names every stuck rank, its position, its action and the send it
    waits for. Overlapped pairs are checked as units (``as_units``): what a
    function that runs a pair at once does.
    """
    check_structure(lowered)
    lowered = as_units(lowered)
    placement = lowered.stage_to_rank
    sent: set[tuple[int, Action]] = set()

    def blocked_on(rank: int, action: Action):
        if action.kind not in (RECV_F, RECV_B):
            return None
        peer, send = counterpart(action, placement)
        return None if (peer, send) in sent else _Awaited(send, peer)

    def run(rank: int, action: Action) -> None:
        if action.kind in (SEND_F, SEND_B):
            sent.add((rank, action))

    run_in_order(lowered.actions, blocked_on, run, f"lowered schedule {lowered.name!r} deadlocks")
