"""Device streams run in issue order: the engine under the NCCL ordering model (``nccl_order.py``).

Gloo matches every message by its tag and completes it on the host, so an
order that hangs on a GPU can pass every CPU test. On a GPU, nothing the host
issues runs when it is issued: each CUDA stream runs its queue strictly in
order, a stream may wait for an item of another stream (an event), and NCCL
runs every operation of one communicator on that communicator's own stream,
where a send or receive holds the stream until its peer has joined it. Whether
a step finishes is then a question about these queues alone, which this module
answers without a GPU: ``World`` holds every rank's host program (the order in
which its thread issues items, and where it blocks), every stream's queue, and
the rendezvous between ranks; ``World.run`` plays them to the end or to a
deadlock, and names the cycle.

[Note: the stream model's rules]
- A stream runs its queue in issue order; its head *starts* once the host has
  issued it and every item it is fenced after has completed (a CUDA event wait:
  ``cudaStreamWaitEvent``, or NCCL fencing its stream after the current one).
- An item without operations (a kernel, an event wait) completes when it starts:
  kernels are finite, only waits can hang.
- A point-to-point operation completes once its partner has started too (NCCL's
  send and receive rendezvous; conservatively both must be in progress, since
  NCCL may hold a send until the receive is posted, whatever its size). Partners
  are paired by order on each (communicator, sender, receiver), as NCCL pairs
  them; a pair whose messages differ is an error (wrong data, not a hang).
- A collective completes once every member's matching call (the k-th on that
  communicator) has started.
- An item of several operations (one NCCL group, a coalesced batch) starts as
  one and completes when all of them have.
- A host issues its program in order and stops only where it blocks on an item
  (a host read of device memory); streams of different communicators progress
  independently (what concurrent kernels give; NCCL's documentation does not
  promise it when a GPU is full, and neither does this model check it).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

from pipeline_ext.schedules.ir import ScheduleError

StreamKey = tuple[Any, str]  # (rank, stream name): a rank is any hashable, e.g. an int or (rank, replica)


@dataclass(eq=False, slots=True)
class Op:
    """One NCCL operation inside an item: a send, a receive, or one member's call of a collective."""

    kind: str  # "send", "recv" or "coll"
    comm: str
    peer: Any  # the other rank (send / recv), or the tuple of members (coll)
    key: Any  # what the partner must carry (a message, or the collective's name)
    item: "Item" = field(repr=False, default=None)  # type: ignore[assignment]
    partners: list["Op"] = field(default_factory=list, repr=False)
    done: bool = False


@dataclass(eq=False, slots=True)
class Item:
    """One entry of a stream's queue: ``what`` it is, the items it is fenced after, its NCCL operations."""

    stream: StreamKey
    what: str
    after: list["Item"]
    ops: list[Op]
    issued: bool = False
    started: bool = False
    done: bool = False
    waiters: list = field(default_factory=list, repr=False)  # nodes to look at again when it completes

    def __str__(self) -> str:
        return f"{self.what} on rank {self.stream[0]} stream {self.stream[1]}"


@dataclass(frozen=True)
class Wait:
    """One link of a deadlock cycle: ``node`` (a stream or a host) is stuck at ``at`` and ``why``."""

    rank: Any
    node: str  # a stream's name, or "host"
    at: str
    why: str

    def __str__(self) -> str:
        return f"rank {self.rank} {self.node} at {self.at} {self.why}"


@dataclass(frozen=True)
class Deadlock:
    """Where the streams stopped: ``cycle`` (each link waits for the next, the last for the first), or, when the
    waits end at an operation nothing can match, ``cycle`` is that chain and ``unmatched`` is True."""

    cycle: tuple[Wait, ...]
    unmatched: bool = False
    stuck: int = 0  # how many streams and hosts could not finish

    @property
    def ranks(self) -> list[Any]:
        return sorted({w.rank for w in self.cycle}, key=repr)

    def __str__(self) -> str:
        links = " -> ".join(str(w) for w in self.cycle)
        if self.unmatched:
            return f"{self.stuck} streams and hosts stuck; a chain ends at an operation nothing matches: {links}"
        return f"{self.stuck} streams and hosts stuck; cycle: {links} -> (back to rank {self.cycle[0].rank} " \
               f"{self.cycle[0].node})"


Step = tuple[str, Item]  # ("issue" | "block", item)


class World:
    """Every rank's host program and streams; build with ``issue`` / ``block``, then ``run`` once."""

    def __init__(self) -> None:
        self.streams: dict[StreamKey, list[Item]] = {}
        self.hosts: dict[Any, list[Step]] = {}
        self._ops: list[Op] = []

    # -- building ----------------------------------------------------------------------------
    def issue(self, rank: Any, stream: str, what: str, after: Optional[list[Optional[Item]]] = None,
              ops: Optional[list[Op]] = None) -> Item:
        """Append an item to ``rank``'s ``stream``, issued by its host now (after its earlier steps)."""
        item = Item((rank, stream), what, [a for a in (after or []) if a is not None], list(ops or []))
        for op in item.ops:
            op.item = item
            self._ops.append(op)
        self.streams.setdefault(item.stream, []).append(item)
        self.hosts.setdefault(rank, []).append(("issue", item))
        return item

    def tail(self, rank: Any, stream: str) -> Optional[Item]:
        """The last item issued to a stream (what a fence or an event recorded now waits for), None if empty."""
        queue = self.streams.get((rank, stream))
        return queue[-1] if queue else None

    def block(self, rank: Any, item: Optional[Item]) -> None:
        """The host of ``rank`` waits here until ``item`` has completed (a host read of what it produced)."""
        if item is not None:
            self.hosts.setdefault(rank, []).append(("block", item))

    # -- matching ----------------------------------------------------------------------------
    def _match(self) -> None:
        """Pair operations by order, as NCCL does; a pair carrying different messages is an error."""
        sends: dict[tuple, list[Op]] = {}
        recvs: dict[tuple, list[Op]] = {}
        calls: dict[tuple, list[Op]] = {}
        for op in self._ops:  # in issue order per rank: hosts issue in program order, ops in item order
            rank = op.item.stream[0]
            if op.kind == "send":
                sends.setdefault((op.comm, rank, op.peer), []).append(op)
            elif op.kind == "recv":
                recvs.setdefault((op.comm, op.peer, rank), []).append(op)
            else:
                calls.setdefault((op.comm, rank), []).append(op)
        for chan, out in sends.items():
            for k, (s, r) in enumerate(zip(out, recvs.get(chan, []))):
                if s.key != r.key:
                    comm, src, dst = chan
                    raise ScheduleError(
                        f"communicator {comm}: send #{k} from rank {src} to rank {dst} is {s.key} ({s.item}), but "
                        f"receive #{k} on rank {dst} expects {r.key} ({r.item}): NCCL pairs messages by order")
                s.partners, r.partners = [r], [s]
        for (comm, rank), mine in calls.items():
            for k, op in enumerate(mine):
                others = [calls.get((comm, m), []) for m in op.peer if m != rank]
                op.partners = [o[k] for o in others if k < len(o)]
                if len(op.partners) < len(others):
                    continue  # a member calls it fewer times: this call hangs, run() names it
                wrong = [p for p in op.partners if p.key != op.key]
                if wrong:
                    raise ScheduleError(f"communicator {comm}: call #{k} is {op.key} ({op.item}) but {wrong[0].key} "
                                        f"({wrong[0].item}): every member must call the same collectives in order")

    def _expected_partners(self, op: Op) -> int:
        return len(op.peer) - 1 if op.kind == "coll" else 1

    # -- running -----------------------------------------------------------------------------
    def run(self) -> Optional[Deadlock]:
        """Play every host and stream to the end; None when everything completed, else the deadlock.

        Event driven: a stream or host is looked at again only when something it may wait for changed (an
        item it is fenced after completed, a partner started, its host issued), so a step of thousands of
        items plays in milliseconds; the outcome does not depend on the order nodes are looked at, since
        every rule only ever lets more items start.
        """
        self._match()
        for queue in self.streams.values():
            for item in queue:
                for a in item.after:
                    a.waiters.append(("stream", item.stream))
        for rank, steps in self.hosts.items():
            for kind, item in steps:
                if kind == "block":
                    item.waiters.append(("host", rank))
        host_pos = {rank: 0 for rank in self.hosts}
        head = {key: 0 for key in self.streams}
        todo: deque = deque([("host", r) for r in self.hosts] + [("stream", k) for k in self.streams])
        queued = set(todo)

        def wake(node: tuple) -> None:
            if node not in queued:
                queued.add(node)
                todo.append(node)

        while todo:
            node = todo.popleft()
            queued.discard(node)
            if node[0] == "host":
                rank = node[1]
                steps, pos = self.hosts[rank], host_pos[rank]
                while pos < len(steps):
                    kind, item = steps[pos]
                    if kind == "issue":
                        item.issued = True
                        wake(("stream", item.stream))
                    elif not item.done:
                        break
                    pos += 1
                host_pos[rank] = pos
                continue
            key = node[1]
            queue, i = self.streams[key], head[key]
            while i < len(queue):
                item = queue[i]
                if not item.started:
                    if not item.issued or not _all_done(item.after):
                        break
                    item.started = True
                    for op in item.ops:
                        for p in op.partners:
                            wake(("stream", p.item.stream))
                for op in item.ops:
                    if not op.done and len(op.partners) == self._expected_partners(op) \
                            and all(p.item.started for p in op.partners):
                        op.done = True
                if not _all_done(item.ops):
                    break
                item.done, i = True, i + 1
                for waiter in item.waiters:
                    wake(waiter)
            head[key] = i
        return self._deadlock(host_pos, head)

    def _deadlock(self, host_pos: dict[Any, int], head: dict[StreamKey, int]) -> Optional[Deadlock]:
        Node = tuple[Any, str]
        waits: dict[Node, tuple[Wait, Optional[Node]]] = {}
        for rank, steps in self.hosts.items():
            if host_pos[rank] < len(steps):
                item = steps[host_pos[rank]][1]
                waits[(rank, "host")] = (Wait(rank, "host", f"a read of {item.what}",
                                              f"waits for it on stream {item.stream[1]}"), item.stream)
        for key, queue in self.streams.items():
            if head[key] < len(queue):
                waits[key] = self._why(queue[head[key]], host_pos)
        if not waits:
            return None
        for start in waits:  # every stuck node waits for another stuck node, or for an op nothing matches
            path: list[Node] = []
            seen: dict[Node, int] = {}
            node: Optional[Node] = start
            while node is not None and node not in seen:
                seen[node] = len(path)
                path.append(node)
                node = waits[node][1]
            if node is not None:
                return Deadlock(tuple(waits[n][0] for n in path[seen[node]:]), stuck=len(waits))
        chain, node = [], next(iter(waits))
        while node is not None:
            chain.append(waits[node][0])
            node = waits[node][1]
        return Deadlock(tuple(chain), unmatched=True, stuck=len(waits))

    def _why(self, item: Item, host_pos: dict[Any, int]) -> tuple[Wait, Optional[StreamKey]]:
        rank, name = item.stream
        if not item.issued:
            step = self.hosts[rank][host_pos[rank]][1]
            return Wait(rank, name, item.what, f"(not issued yet: its host waits for {step.what})"), (rank, "host")
        if not item.started:
            fence = next(a for a in item.after if not a.done)
            return Wait(rank, name, item.what, f"waits for {fence.what} on stream {fence.stream[1]}"
                        + ("" if fence.stream[0] == rank else f" of rank {fence.stream[0]}")), fence.stream
        op = next(o for o in item.ops if not o.done)
        if len(op.partners) < self._expected_partners(op):
            return Wait(rank, name, item.what, f"whose {op.kind} of {op.key} nothing matches"), None
        other = next(p for p in op.partners if not p.item.started)
        return Wait(rank, name, item.what, f"waits for its partner {other.item.what} on rank {other.item.stream[0]} "
                                            f"stream {other.item.stream[1]}"), other.item.stream


def _all_done(things: list) -> bool:
    for thing in things:  # a loop, not all(...): this runs for every item, and most lists are empty
        if not thing.done:
            return False
    return True
