"""NCCL's ordering rules, checked on a lowered schedule before a GPU runs it.

``check_deadlock`` proves a lowered schedule finishes when receives block on
the host until their send was issued: Gloo's world, which matches by tag and
never holds one message behind another. NCCL adds orderings Gloo hides: every
operation of one communicator runs on that communicator's one CUDA stream in
issue order, a receive there holds the stream until its message comes, a send
may hold it until the receive is posted, and each NCCL stream is fenced after
the stream that was current when the operation was issued. torch's users hit
such hangs with looped schedules on one shared group (pytorch PR 195760 draws
a receive queued behind two unrelated sends). This module turns a
lowered schedule plus a runtime's way of issuing messages (``IssuePolicy``:
which communicator carries each message, when receives are posted, on which
stream) into every rank's host program and streams, and plays them with the
rules of ``nccl_streams.py``.

[Note: what the runtime issues, as modelled]
``IssuePolicy.runtime()`` mirrors this library's multi-process NCCL path, and
changes there must change it: ``comm/groups.py`` (``DirectionGroups``: one
2-rank communicator per direction), ``csrc/runtime/channel.cpp``
(``ProcessGroupChannel``: a send fences the channel's send stream after the
compute stream at the send, then issues on it; a receive is issued from the
idle receive stream; always in a coalesced batch; back-to-back sends on one
group in one batch), ``runtime/executor.py`` (receives posted ahead in list
order, ``recv_window`` of them, from the step's first message action on, each
waited on at its RECV with the compute stream waiting for it; the step's end
makes the compute stream wait for every send) and ``comm/comm_plan.py``
(discovery steps: each message's layout first, layout and data in one batch on
the sender; per peer only the oldest unresolved receive has its layout posted,
and the host reads each layout at its RECV, blocking until the compute stream
got there); each step starts by posting the step records over Gloo, which the
host waits for at the first message (``comm/session.py``). Overlapped pairs
are checked as units (``lowering.as_units``): the receives between the halves
waited on before the pair, its sends after it, the latest any interleaving of
the halves issues them.
``IssuePolicy.torch()`` is torch.distributed.pipelining's: one communicator
(a device-bound group, as PR 195760 assumes), each SEND and RECV issued at its
action with the compute stream current, each receive waited on at its
consumer, sends waited on at the step's end.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Union

from pipeline_ext.schedules.ir import Action, ActionKind, Schedule, ScheduleError, check_structure
from pipeline_ext.schedules.lowering import as_units, counterpart, lower, receives_for
from pipeline_ext.schedules.nccl_streams import Deadlock, Item, Op, World

__all__ = ["IssuePolicy", "Collectives", "OrderReport", "model_order", "check_fifo_order", "GROUPS"]

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W
SENDS, RECVS = (ActionKind.SEND_F, ActionKind.SEND_B), (ActionKind.RECV_F, ActionKind.RECV_B)

#: how messages map to communicators: (sender, receiver, "forward" | "backward") -> communicator name
Groups = Union[str, Callable[[int, int, str], str]]
GROUPS = {
    "direction": lambda src, dst, way: f"{src}->{dst}",  # DirectionGroups (ours); torch PR 195760's directed edges
    "pair": lambda src, dst, way: f"{min(src, dst)}<->{max(src, dst)}",  # one 2-rank communicator per pair
    "shared": lambda src, dst, way: "pp",  # one communicator for every message (torch's default)
    "forward_backward": lambda src, dst, way: f"pp-{way}",  # one for activations, one for gradients (torch PR 186173)
}


@dataclass(frozen=True)
class IssuePolicy:
    """How a runtime issues one step's messages (see [Note: what the runtime issues, as modelled]).

    ``groups``: a name in ``GROUPS`` or ``fn(sender, receiver, way) -> communicator``.
    ``recv_window``: receives posted ahead in list order, at most this many not yet waited on, from the
    first message action on, each waited on at its RECV (ours); None: posted at the RECV, waited on at the
    compute action that consumes it (torch's). ``streams``: "own" (sends fenced after the compute stream
    through the channel's send stream, receives issued from an idle receive stream) or "current"
    (both issued with the compute stream current). ``batch_sends``: back-to-back sends on one communicator
    go as one NCCL group. ``overlap``: overlapped pairs run as units (their messages around them).
    ``records``: each step starts with an exchange over Gloo among every rank, which the host waits for at
    the step's first message (ours: the step records, ``comm/agreement.py``).
    """

    groups: Groups = "direction"
    recv_window: Optional[int] = 4
    streams: str = "own"
    batch_sends: bool = True
    overlap: bool = True
    records: bool = True

    @classmethod
    def runtime(cls, groups: Groups = "direction") -> "IssuePolicy":
        """This library's NCCL path: direction groups, a receive window of 4, its own streams, batched sends."""
        return cls(groups)

    @classmethod
    def torch(cls, groups: Groups = "shared") -> "IssuePolicy":
        """torch.distributed.pipelining's runtime: one communicator, each message issued at its action on the
        compute stream (``groups="pair"`` for a lazily initialised group, whose single sends and receives get a
        2-rank communicator per pair of ranks)."""
        return cls(groups, recv_window=None, streams="current", batch_sends=False, records=False)

    def __post_init__(self) -> None:
        if isinstance(self.groups, str) and self.groups not in GROUPS:
            raise ValueError(f"groups={self.groups!r}: expected one of {', '.join(GROUPS)} or a function")
        if self.streams not in ("own", "current"):
            raise ValueError(f"streams={self.streams!r}: expected 'own' or 'current'")
        if self.recv_window is not None and self.recv_window < 1:
            raise ValueError(f"recv_window={self.recv_window}: expected at least 1, or None (posted at the RECV)")

    def communicator(self, src: int, dst: int, way: str) -> str:
        fn = GROUPS[self.groups] if isinstance(self.groups, str) else self.groups
        return str(fn(src, dst, way))

    def __str__(self) -> str:
        groups = self.groups if isinstance(self.groups, str) else getattr(self.groups, "__name__", "custom")
        posting = (f"receives posted {self.recv_window} ahead" if self.recv_window is not None
                   else "receives posted at their RECV")
        streams = "the channel's own streams" if self.streams == "own" else "the compute stream"
        return f"communicators: {groups}; {posting}, issued from {streams}" + \
            ("; back-to-back sends batched" if self.batch_sends else "")


@dataclass(frozen=True)
class Collectives:
    """The collectives a step issues besides the pipeline's messages, each rank replicated ``tp * dp`` times.

    ``tp``: an all-reduce on the rank's tensor-parallel communicator after every compute action of a kind in
    ``tp_kinds`` (Megatron's row-parallel forward and column-parallel input grad), waited on by the compute
    stream. ``dp``: "fsdp" all-gathers a stage's parameters before its next compute action when they were
    resharded (after every forward) and reduce-scatters once after its last B/W (waited on at the step's
    end); "ddp" all-reduces once after its last B/W (waited on at once). A schedule with FSDP actions
    (``schedules/fsdp.py``) places them itself: an all-gather issued at each UNSHARD and waited on by the
    compute stream before the stage's next compute action, a reduce-scatter at each REDUCE_GRAD waited on at
    the step's end. Every replica runs the same schedule over pipeline communicators of its own.
    """

    tp: int = 1
    dp: int = 1
    dp_kind: str = "fsdp"
    tp_kinds: tuple[str, ...] = ("F", "B", "I")

    def __post_init__(self) -> None:
        if self.tp < 1 or self.dp < 1 or self.dp_kind not in ("fsdp", "ddp"):
            raise ValueError(f"Collectives(tp={self.tp}, dp={self.dp}, dp_kind={self.dp_kind!r}): degrees must be "
                             "at least 1 and dp_kind 'fsdp' or 'ddp'")


@dataclass(frozen=True)
class OrderReport:
    """What ``model_order`` played: the policy, how many streams and items, and the deadlock (None: none)."""

    schedule: str
    policy: IssuePolicy
    discovery: bool
    streams: int
    items: int
    deadlock: Optional[Deadlock]
    steps: int = 1

    @property
    def ok(self) -> bool:
        return self.deadlock is None

    def __str__(self) -> str:
        step = ("discovery step" if self.discovery else "known step") if self.steps == 1 else \
            f"{self.steps} steps" + (", the first a discovery step" if self.discovery else "")
        head = f"schedule {self.schedule!r} ({step}; {self.policy})"
        if self.deadlock is None:
            return f"{head}: completes ({self.streams} streams, {self.items} items)"
        return f"{head} deadlocks under NCCL's ordering: {self.deadlock}"


def model_order(schedule: Schedule, groups: Optional[Groups] = None, *, policy: Optional[IssuePolicy] = None,
                discovery: bool = False, collectives: Optional[Collectives] = None, steps: int = 1) -> OrderReport:
    """Play ``steps`` steps of ``schedule`` (lowered here if not) on modelled GPU streams; never raises for a hang.

    ``policy`` defaults to ``IssuePolicy.runtime()``; ``groups`` replaces its communicators. ``discovery``:
    the first step exchanges layouts (a step with a new microbatch signature: the first of every run), the
    others are known. Several steps check that a step's messages cannot catch on the previous step's, which
    the host does not wait for (its waits are device-side).
    """
    policy = policy if policy is not None else IssuePolicy.runtime()
    if groups is not None:
        policy = replace(policy, groups=groups)
    if steps < 1:
        raise ValueError(f"steps={steps}: expected at least 1")
    check_structure(schedule)
    lowered = lower(schedule)
    if policy.overlap:
        lowered = as_units(lowered)
    coll = collectives or Collectives()
    world = World()
    programs = [_RankProgram(world, lowered, rank, (t, d) if collectives is not None else None, policy, coll)
                for rank in range(lowered.num_ranks) for t in range(coll.tp) for d in range(coll.dp)]
    for k in range(steps):
        for program in programs:
            program.step(k, discovery and k == 0)
    deadlock = world.run()
    return OrderReport(lowered.name, policy, discovery, len(world.streams),
                       sum(len(q) for q in world.streams.values()), deadlock, steps)


def check_fifo_order(schedule: Schedule, groups: Optional[Groups] = None, *, policy: Optional[IssuePolicy] = None,
                     discovery: bool = False, collectives: Optional[Collectives] = None,
                     steps: int = 1) -> OrderReport:
    """As :func:`model_order`, but raise :class:`ScheduleError` naming the cycle (ranks, streams, actions) on a hang."""
    report = model_order(schedule, groups, policy=policy, discovery=discovery, collectives=collectives, steps=steps)
    if not report.ok:
        raise ScheduleError(str(report))
    return report


def _rank_id(rank: int, replica: Optional[tuple[int, int]]) -> Any:
    """A rank's name in the model: the pipeline rank, or ``"r[tp t, dp d]"`` for one replica of it."""
    return rank if replica is None else f"{rank}[tp {replica[0]}, dp {replica[1]}]"


class _Recv:
    """A posted receive: its NCCL item, or in a discovery step its layout's and (once read) its data's."""

    def __init__(self, action: Action, peer: int, comm: str, key: str) -> None:
        self.action, self.peer, self.comm, self.key = action, peer, comm, key
        self.layout: Optional[Item] = None
        self.data: Optional[Item] = None


class _RankProgram:
    """One rank's (one replica's) steps, issued as the policy's runtime issues them, into ``world``."""

    def __init__(self, world: World, lowered: Schedule, rank: int, replica: Optional[tuple[int, int]],
                 policy: IssuePolicy, coll: Collectives) -> None:
        self.world, self.lowered, self.rank, self.replica = world, lowered, rank, replica
        self.policy, self.coll = policy, coll
        self.me = self._id(rank)
        self.placement = lowered.stage_to_rank
        self.actions = lowered.actions[rank]
        self.planned = lowered.has_fsdp  # FSDP collectives at the schedule's UNSHARD / REDUCE_GRAD actions

    def _id(self, rank: int) -> Any:
        return _rank_id(rank, self.replica)

    def _comm(self, src: int, dst: int, way: str) -> str:
        """The communicator of a message, or the step records' ("gloo"): each replica has its own."""
        name = "gloo" if way == "records" else self.policy.communicator(src, dst, way)
        return name if self.replica is None else f"{name}@tp{self.replica[0]},dp{self.replica[1]}"

    # -- one step --------------------------------------------------------------------------------
    def step(self, k: int, discovery: bool) -> None:
        self.k, self.discovery = k, discovery
        self.names: dict[Action, str] = {}
        self.pending = deque(a for a in self.actions if a.kind in RECVS)
        self.posted: dict[Action, _Recv] = {}
        self.unresolved: dict[int, deque[_Recv]] = {}
        self.sends: list[Item] = []
        self.late: list[Item] = []  # collectives the step's end waits for
        self.run_ops: list[Op] = []  # the open batch on one communicator: its ops, names, fence
        self.run_comm, self.run_what, self.run_fence = "", [], None  # type: tuple[str, list[str], Optional[Item]]
        self.sharded = {s: True for s in self.lowered.stages_of(self.rank)}
        self.backwards = {s: 0 for s in self.sharded}
        self.gathering: dict[int, Item] = {}  # a planned step's all-gathers not yet waited on, by stage
        record = None
        if self.policy.records and self.lowered.num_ranks > 1:  # posted when the step starts, over Gloo
            members = tuple(self._id(r) for r in range(self.lowered.num_ranks))
            record = self.world.issue(self.me, "gloo", f"step {k}'s records",
                                      ops=[Op("coll", self._comm(0, 0, "records"), members, f"records {k}")])
        opened, window = False, self.policy.recv_window
        is_send = [a.kind in SENDS for a in self.actions] + [False]
        for i, a in enumerate(self.actions):
            if a.is_comm and not opened:  # the step opens: the records are waited on (host), receives posted
                opened = True
                self.world.block(self.me, record)
                self._post_window()
            if a.kind in SENDS:
                self._send(a)
                if not (self.policy.batch_sends and is_send[i + 1]):  # a run of sends goes as one batch
                    self._flush()
            elif a.kind in RECVS:
                if window is None:
                    self.posted[a] = self._post(a)
                else:
                    self._wait(self.posted.pop(a))
                    self._post_window()
            elif a.is_fsdp:
                self._fsdp(a)
            else:
                if window is None:
                    for recv in receives_for(a, self.placement):
                        self._wait(self.posted.pop(recv))
                self._compute(a)
        self._flush()
        for item in self.sends + self.late:  # the step ends when every send (and reduce-scatter) completed
            self.world.issue(self.me, "compute", f"step {k}'s end: wait for {item.what}", after=[item])

    # -- messages --------------------------------------------------------------------------------
    def _n(self, a: Action) -> str:
        """An action's name in this step: ``0F3``, or ``0F3@step1`` from the second step on."""
        name = self.names.get(a)
        if name is None:
            name = self.names[a] = str(a) if self.k == 0 else f"{a}@step{self.k}"
        return name

    def _fence(self, stream: str) -> Optional[Item]:
        """What a NCCL operation issued now is fenced after: the current stream's last item."""
        return self.world.tail(self.me, "compute" if self.policy.streams == "current" else stream)

    def _send(self, a: Action) -> None:
        peer, _ = counterpart(a, self.placement)
        comm = self._comm(self.rank, peer, "forward" if a.kind is ActionKind.SEND_F else "backward")
        if self.policy.streams == "own":  # the send stream waits for the compute stream at the send
            self.world.issue(self.me, "send", f"fence of {self._n(a)} after the compute stream",
                             after=[self.world.tail(self.me, "compute")])
        if self.run_ops and comm != self.run_comm:
            self._flush()
        key = self._n(a)
        if self.discovery:
            self.run_ops.append(Op("send", comm, self._id(peer), ("layout", key)))
        self.run_ops.append(Op("send", comm, self._id(peer), key))
        self.run_comm, self.run_fence = comm, self._fence("send")
        self.run_what.append(f"{key} to rank {self._id(peer)}")

    def _flush(self) -> None:
        if not self.run_ops:
            return
        what = ("send " if len(self.run_what) == 1 else "batched sends ") + ", ".join(self.run_what)
        if self.discovery:
            what += " (layouts first)"
        self.sends.append(self.world.issue(self.me, f"nccl[{self.run_comm}]", what, after=[self.run_fence],
                                           ops=self.run_ops))
        self.run_ops, self.run_what = [], []

    def _post_window(self) -> None:
        while self.pending and len(self.posted) < (self.policy.recv_window or 0):
            a = self.pending.popleft()
            self.posted[a] = self._post(a)

    def _post(self, a: Action) -> _Recv:
        peer, send = counterpart(a, self.placement)
        way = "forward" if a.kind is ActionKind.RECV_F else "backward"
        h = _Recv(a, peer, self._comm(peer, self.rank, way), self._n(send))
        if not self.discovery:
            self._recv_item(h, data=True)
            return h
        queue = self.unresolved.setdefault(peer, deque())
        queue.append(h)
        if len(queue) == 1:
            self._recv_item(h, data=False)
        return h

    def _recv_item(self, h: _Recv, data: bool) -> None:
        what = f"recv {'' if data else 'the layout of '}{self._n(h.action)} from rank {self._id(h.peer)}"
        item = self.world.issue(self.me, f"nccl[{h.comm}]", what, after=[self._fence("recv")],
                                ops=[Op("recv", h.comm, self._id(h.peer), h.key if data else ("layout", h.key))])
        if data:
            h.data = item
        else:
            h.layout = item

    def _wait(self, h: _Recv) -> None:
        queue = self.unresolved.get(h.peer)
        while h.data is None:  # discovery: read layouts from this peer, oldest first, on the host
            head = queue[0]
            read = self.world.issue(self.me, "compute", f"wait for the layout of {self._n(head.action)}",
                                    after=[head.layout])
            self.world.block(self.me, read)
            self._recv_item(head, data=True)
            queue.popleft()
            if queue:
                self._recv_item(queue[0], data=False)
        self.world.issue(self.me, "compute", f"wait for {self._n(h.action)}", after=[h.data])

    # -- compute and collectives -----------------------------------------------------------------
    def _fsdp(self, a: Action) -> None:
        """A planned step's UNSHARD, RESHARD or REDUCE_GRAD (FSDP collectives only with ``dp > 1``, "fsdp")."""
        if not (self.coll.dp > 1 and self.coll.dp_kind == "fsdp"):
            return
        if a.kind is ActionKind.UNSHARD:
            self.gathering[a.stage] = self._collective("dp", "all-gather", a, wait=False)
        elif a.kind is ActionKind.REDUCE_GRAD:
            self.late.append(self._collective("dp", "reduce-scatter", a, wait=False))

    def _compute(self, a: Action) -> None:
        s = a.stage
        fsdp = self.coll.dp > 1 and self.coll.dp_kind == "fsdp"
        if self.planned:  # the schedule's UNSHARD issued the all-gather; its first compute after waits for it
            gathering = self.gathering.pop(s, None)
            if gathering is not None:
                self.world.issue(self.me, "compute", f"wait for the all-gather of stage {s}", after=[gathering])
        elif fsdp and self.sharded[s]:
            self._collective("dp", "all-gather", a, wait=True)
        if a.kind is not F:
            self.sharded[s] = False
        self.world.issue(self.me, "compute", self._n(a))
        if a.kind is F:
            self.sharded[s] = True  # FSDP reshards after forward
        self._tensor_parallel(a)
        if a.kind in (B, W):
            self.backwards[s] += 1
            if self.backwards[s] == self.lowered.n_microbatches and self.coll.dp > 1 and not (fsdp and self.planned):
                item = self._collective("dp", "reduce-scatter" if fsdp else "all-reduce", a, wait=not fsdp)
                if fsdp:
                    self.late.append(item)

    def _tensor_parallel(self, a: Action) -> None:
        if self.coll.tp > 1 and a.kind.value in self.coll.tp_kinds:
            self._collective("tp", "all-reduce", a, wait=True)

    def _collective(self, group: str, name: str, a: Action, wait: bool) -> Item:
        """A collective of this replica's tp or dp group, issued now on the compute stream (fenced after it)."""
        assert self.replica is not None
        t, d = self.replica
        if group == "tp":
            comm, replicas = f"tp[{self.rank},dp{d}]", [(x, d) for x in range(self.coll.tp)]
        else:
            comm, replicas = f"dp[{self.rank},tp{t}]", [(t, x) for x in range(self.coll.dp)]
        members = tuple(_rank_id(self.rank, r) for r in replicas)
        what = f"{name} of stage {a.stage} at {self._n(a)}"
        item = self.world.issue(self.me, f"nccl[{comm}]", what, after=[self.world.tail(self.me, "compute")],
                                ops=[Op("coll", comm, members, what)])
        if wait:
            self.world.issue(self.me, "compute", f"wait for the {what}", after=[item])
        return item
