"""The channels of a multi-process pipeline: the Python faces of the C++ ``_C.Channel`` types, and ``make_channel``.

A channel keeps no state: it moves one message per call (packed into ONE
buffer the send owns, so the caller may write its tensors again) and posts
receives into buffers of a layout it is given. Which layouts are known is the
step's communication plan (``comm/comm_plan.py``, held by the session per step
kind); a step talks to the channel through that plan's ``StepMessages``.

- :class:`DistChannel`: the group's own send/recv (C++ ``ProcessGroupChannel``:
  Gloo on CPU, NCCL on GPU).
- :class:`AutoChannel`: CPU stages, same-host shared memory (C++
  ``ShmChannel``) per pair of ranks, the process group between hosts
  (:class:`PerEdgeChannel` when a rank has peers of both kinds).
- :class:`IpcChannel`: GPU stages over CUDA IPC between the processes of one
  host (C++ ``IpcChannel``), NCCL otherwise.
- :func:`make_channel` builds the one a request (``transport=``) asks for.

Why a same-host transport: a Gloo message costs the receiver an IO-thread and
a condition-variable wake-up, milliseconds per message on a loaded 2-core box,
and 1F1B has two messages per microbatch on its critical path. C++
``ShmChannel`` (csrc/runtime/shm_channel.h) writes the bytes into the
receiver's inbox (a ring in shared memory) and wakes it through a futex after
a short spin. Crash safety: an inbox is an anonymous file (``memfd_create``)
that the peers open through ``/proc/<pid>/fd``, so no exit (an exception,
``os._exit``, SIGKILL) leaves anything behind; a peer whose process is gone is
reported by the wait (through a pidfd) within 50 ms, as Gloo reports a closed
socket.

[Note: a channel connects at the step's opening]
A same-host channel describes its rank to the peers when it is built
(``setup.GroupTransport.post``) and takes its C++ channel when ``connect()``
is called: explicitly, by the step's opening (``comm/session.Step.open``),
after the ranks agreed on the transport they asked for (a rank that asked
for another would never answer the setup). Connecting is collective, so it
is never a side effect: until then the channel has no C++ channel and a
message on it is an error naming the missing call, and the questions
(``matches_by_tag``, ``packs_single``) only read what ``connect`` settled.
The channel keeps its own view of the settled record (``_take``) and writes
into nothing else.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist

from pipeline_ext.comm.transport.decide import check_request, requested_transport
from pipeline_ext.comm.transport.setup import GroupTransport, Settled
from pipeline_ext.runtime._ext import _C
from pipeline_ext.runtime.channel import ChannelError, ChannelHandle
from pipeline_ext.runtime.ops import explain_unmovable, raise_named
from pipeline_ext.runtime.tags import describe_tag

__all__ = ["AutoChannel", "DistChannel", "IpcChannel", "PerEdgeChannel", "make_channel"]

Device = Union[str, torch.device]
#: what a same-host transport is called in its errors
_NAMES = {"shm": "shared memory", "ipc": "CUDA IPC"}


def make_channel(group: Optional[dist.ProcessGroup], device: Device, num_stages: Optional[int],
                 transport: Optional[str] = None, timeout: float = 300.0,
                 setup_group: Optional[dist.ProcessGroup] = None) -> "DistChannel":
    """The channel of a pipeline's stages on ``device`` (``transport``: see the package doc).

    ``setup_group``: a group that moves CPU tensors (Gloo) with the ranks of
    ``group``, over which GPU stages describe themselves to each other
    ("auto" and "ipc"); ``group`` itself when not given (then it must move CPU tensors).
    """
    choice = requested_transport(transport)
    device = torch.device(device)
    check_request(choice, device)
    if choice == "process_group" or device.type not in ("cpu", "cuda"):
        return DistChannel(group, device, num_stages=num_stages)
    if device.type == "cuda":
        if choice != "ipc":  # "auto": NCCL until the CUDA IPC channel has run on a GPU (package doc)
            return DistChannel(group, device, num_stages=num_stages)
        return IpcChannel(group, device, num_stages=num_stages, required=True, timeout=timeout,
                          setup_group=setup_group)
    return AutoChannel(group, num_stages=num_stages, required=choice == "shm", timeout=timeout)


class DistChannel:
    """Point-to-point messages over a torch.distributed group (Gloo on CPU, NCCL on GPU); stateless.

    The Python face of one C++ type, ``_C.Channel`` (held as ``_pg``): here a
    ``_C.ProcessGroupChannel``; ``AutoChannel`` holds a ``_C.ShmChannel`` (or,
    across hosts, a ``_C.ProcessGroupChannel``) behind the same methods.
    ``group`` defaults to the default (WORLD) group; peers are ranks *in that
    group*. ``device`` is where receive buffers live (``"cuda:i"`` with NCCL).
    ``num_stages`` only makes error messages name stage and microbatch.
    """

    #: the transport asked for (``PipelineSchedule(transport=)``): the process group itself
    requested = "process_group"
    #: what the same-host channels' setup settled (``setup.Settled``: per-edge table, hosts); None here
    settled = None

    def __init__(self, group: Optional[dist.ProcessGroup] = None, device: Device = "cpu",
                 num_stages: Optional[int] = None) -> None:
        self.group = self.resolve_group(group)
        self._pg = _C.ProcessGroupChannel(self.group, torch.device(device))
        self.num_stages = num_stages

    @classmethod
    def resolve_group(cls, group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
        """``group``, or the default (WORLD) group; an error naming the channel when there is none."""
        if group is not None:
            return group
        if not dist.is_initialized():
            raise RuntimeError(f"{cls.__name__}: torch.distributed is not initialised (call init_process_group)")
        return dist.group.WORLD

    def packs_single(self, peer: int) -> bool:
        """A message of one tensor to ``peer`` is packed too (into the plan's reused buffer when given)."""
        return True

    @property
    def edges(self) -> dict[tuple[int, int], tuple[str, str]]:
        """Every pair of ranks' transport and why (``decide.decide_edges``); empty until settled, and on a
        transport settled without an exchange (``"process_group"``)."""
        return self.settled.edges if self.settled is not None else {}

    @property
    def rank(self) -> int:
        return self._pg.rank

    @property
    def device(self) -> torch.device:
        return self._pg.device

    def matches_by_tag(self) -> bool:
        """True when messages are matched by (peer, tag) (Gloo, shared memory, CUDA IPC), not by order (NCCL)."""
        return self.device.type == "cpu"

    def connect(self) -> str:
        """The transport, decided (the process group needs no decision; the same-host channels settle theirs:
        collective over the group, made by the step's opening)."""
        return "process_group"

    def begin_step(self, step: int) -> None:
        """Step ``step`` (the group's number, ``GroupSteps``) starts its messages on this rank.

        The C++ channel decides what that means: nothing over a process group
        (Gloo delivers a send only into a receive posted with its tag, and a
        send nobody receives fails on its sender; NCCL matches by order);
        shared memory drops earlier steps' leftovers.
        """
        self._pg.begin_step(step)

    def notify_failure(self, step: int, text: str) -> None:
        """Tell the peers that step ``step`` failed on this rank, so their waits in it end now with ``text``.

        Only shared memory can (``_C.ShmChannel.notify_failure``: a notice in
        each peer's inbox, which every wait there reads). A process group's
        waits cannot be woken from outside: its peers wait out their timeout,
        as before a transport is settled (no message has moved then).
        """
        notify = getattr(self._pg, "notify_failure", None)
        if notify is not None:
            notify(step, text)

    def send(self, tensors: Sequence[torch.Tensor], peer: int, tag: int, expected: Optional["_C.PackLayout"] = None,
             with_layout: bool = False, out: Optional[torch.Tensor] = None,
             owned: bool = False) -> tuple[ChannelHandle, "_C.PackLayout"]:
        """Send ``tensors`` as one message now; with ``with_layout`` its layout goes first.

        ``expected``: the layout the receiver preallocated; a mismatch fails
        before anything is sent. ``out``: a reused pack buffer. The handle keeps
        the buffers alive until the send completes. The send owns its bytes
        when it returns (a copy), except for ``owned`` tensors: the pipeline's
        own (autograd's gradients), which no one else can write.
        """
        try:
            request, layout = self._pg.send(list(tensors), peer, tag, expected, with_layout, out, owned)
        except ChannelError as exc:
            raise ChannelError(
                f"rank {self.rank}: {describe_tag(tag, self.num_stages)} to rank {peer}: {exc}"
            ) from None
        except TypeError as exc:  # the core refuses what it cannot read (check_readable): name it
            raise_named(exc, explain_unmovable(f"rank {self.rank}: {describe_tag(tag, self.num_stages)} to rank "
                                               f"{peer}", tensors))
        return ChannelHandle(request), layout

    def recv(self, layout: "_C.PackLayout", peer: int, tag: int) -> ChannelHandle:
        """Post a receive of a message packed as ``layout``; ``wait`` returns its tensors (views)."""
        return ChannelHandle(self._pg.recv(layout, peer, tag))

    def recv_layout(self, peer: int, tag: int) -> ChannelHandle:
        """Post the receive of the layout sent with ``with_layout``; ``wait`` returns ``[words]``."""
        return ChannelHandle(self._pg.recv_layout(peer, tag))

    def set_route(self, peer: int, send_group: dist.ProcessGroup, send_peer: int,
                  recv_group: dist.ProcessGroup, recv_peer: int) -> None:
        """Messages to ``peer`` go over ``send_group`` (to its rank ``send_peer``), from it over ``recv_group``.

        NCCL pipelines route each direction over a group of its own (``comm/groups.py``).
        """
        self._pg.set_route(peer, send_group, send_peer, recv_group, recv_peer)

    @property
    def batches(self) -> bool:
        """True when operations are coalesced into batches (NCCL): see ``batch``."""
        return getattr(self._pg, "batches", False)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Sends and receives posted in the block go as one batch per group (torch's ``batch_isend_irecv``).

        On NCCL they are issued when the block ends, in one launch; their
        handles may be waited on only after it. Only operations that are waited
        on together belong in one batch: a batched receive completes when the
        whole batch has. Backends that do not coalesce (Gloo) and transports
        without batches (shared memory) issue at once.
        """
        channel = self._pg  # the one the batch began on
        if not hasattr(channel, "begin_batch"):
            yield
            return
        channel.begin_batch()
        try:
            yield
        finally:
            channel.end_batch()


class PerEdgeChannel:
    """The C++ channel of a rank with peers on this host and on others: shared memory to the first, the process
    group to the second ([Note: transport per edge] in ``decide.py``). Each message goes on its peer's channel;
    both keep the ``_C.Channel`` contract, so the executor cannot tell."""

    def __init__(self, shm: Any, pg: Any, shm_peers: Any) -> None:
        self._shm, self._pg, self._shm_peers = shm, pg, frozenset(shm_peers)

    def on(self, peer: int) -> Any:
        """The C++ channel messages to and from ``peer`` go on."""
        return self._shm if peer in self._shm_peers else self._pg

    rank = property(lambda self: self._pg.rank)
    size = property(lambda self: self._pg.size)
    device = property(lambda self: self._pg.device)

    def send(self, tensors: Any, peer: int, *args: Any) -> Any:
        return self.on(peer).send(tensors, peer, *args)

    def recv(self, layout: Any, peer: int, tag: int) -> Any:
        return self.on(peer).recv(layout, peer, tag)

    def recv_layout(self, peer: int, tag: int) -> Any:
        return self.on(peer).recv_layout(peer, tag)

    def begin_step(self, step: int) -> None:
        self._shm.begin_step(step)
        self._pg.begin_step(step)

    def notify_failure(self, step: int, text: str) -> None:
        """Same-host peers' waits end now; the other hosts' wait out their timeout (a process group cannot be woken)."""
        self._shm.notify_failure(step, text)

    def unexpected(self) -> int:
        return self._shm.unexpected()

    def discarded(self) -> int:
        return self._shm.discarded()


class AutoChannel(DistChannel):
    """A ``DistChannel`` over same-host shared memory (CPU stages); the process group across hosts, per pair of ranks.

    ``required``: shared memory or an error (``transport="shm"``), instead of
    the process group when the ranks are not all on this host. ``timeout``
    bounds the wait for the peers' descriptions in ``connect``.
    ``transport`` is ``None`` until then, then "shm", "process_group", or
    "per_edge" (shared memory to this host's peers, the process group to other
    hosts': ``edges`` says which, [Note: transport per edge] in ``decide.py``).
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, num_stages: Optional[int] = None,
                 required: bool = False, timeout: float = 300.0) -> None:
        self._describe(group, torch.device("cpu"), num_stages, "shm" if required else "auto", timeout)

    def _describe(self, group: Optional[dist.ProcessGroup], device: torch.device, num_stages: Optional[int],
                  requested: str, timeout: float, wire: Optional[dist.ProcessGroup] = None) -> None:
        """Everything but the C++ channel; this rank's description goes to every peer now (``GroupTransport.post``)."""
        self.group = self.resolve_group(group)
        self.num_stages = num_stages
        self.requested = requested
        self.transport: Optional[str] = None
        self.settled: Optional[Settled] = None
        self._rank, self._device, self._timeout = self.group.rank(), device, timeout
        self._wire: Optional[Any] = None  # the C++ channel, from connect()
        self._transports = GroupTransport.of(self.group)  # the group's one registry ([Note: one transport per group])
        self._transports.post(self.group, device, wire)

    @property
    def _pg(self) -> Any:
        """The C++ channel every message goes on (``connect`` took it from what the group's setup settled)."""
        if self._wire is None:
            raise self._not_connected()
        return self._wire

    def _not_connected(self) -> ChannelError:
        return ChannelError(f"rank {self._rank}: the {self.requested!r} channel on group {self.group.group_name!r} "
                            "is not connected: call connect() first (a step's opening does, Step.open)")

    rank = property(lambda self: self._rank)
    device = property(lambda self: self._device)

    def connect(self) -> str:
        """Settle the transport and take its C++ channel; returns the kind.

        Collective over the group: the group's first connect in this process
        waits (up to ``timeout`` per peer) for every peer's description. The
        step's opening calls it, after the ranks agreed on what they asked for.
        """
        if self.settled is None:
            settled = self._transports.connect(self._device, self._timeout)
            if self.requested != "auto" and settled.kind != self.requested:
                raise ChannelError(f"transport={self.requested!r}: group {self.group.group_name!r} cannot use "
                                   f"{_NAMES[self.requested]} ({settled.reason}); use transport='auto' or "
                                   "'process_group'")
            self._take(settled)
        assert self.transport is not None
        return self.transport

    def _take(self, settled: Settled) -> None:
        """This channel's own view of what the group settled (shared C++ channels, this channel's routing)."""
        self.settled, self.transport = settled, settled.kind
        self._wire = (PerEdgeChannel(settled.near_channel, settled.channel, settled.near) if settled.near
                      else settled.channel)

    def matches_by_tag(self) -> bool:
        """Whether the settled transport matches by tag (all but NCCL); reads what ``connect`` settled."""
        if self.transport is None:
            raise self._not_connected()
        return self.transport != "process_group" or self._device.type == "cpu"

    def packs_single(self, peer: int) -> bool:
        """On shared memory (or CUDA IPC) one tensor is copied into the ring (an exported block) as it is: no
        pack buffer for it."""
        kind = self.transport
        if kind == "per_edge":
            kind = self.edges[(min(self.rank, peer), max(self.rank, peer))][0]
        return kind not in ("shm", "ipc")

    def notify_failure(self, step: int, text: str) -> None:
        """As ``DistChannel``'s; before ``connect`` no message has moved, and nothing is told."""
        if self._wire is not None:
            super().notify_failure(step, text)


class IpcChannel(AutoChannel):
    """A ``DistChannel`` for GPU stages over CUDA IPC between the processes of one host; NCCL otherwise.

    The C++ ``_C.IpcChannel`` (csrc/runtime/ipc_channel.h): control messages
    (tag, layout, IPC handles of the sender's exported block and its events)
    travel over the shared-memory rings, matched by (peer, tag) like Gloo; the
    receiver copies the payload with ``cudaMemcpyAsync`` on its receive stream.
    Connected like ``AutoChannel``: the ranks describe themselves over
    ``setup_group`` (a group that moves CPU tensors, e.g. the Gloo twin of an
    NCCL group; ``group`` itself by default) and every rank takes the same
    transport (``decide.decide_transport``). ``required``: CUDA IPC or an error
    (``transport="ipc"``). Routes (``set_route``) apply to the NCCL fallback only.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], device: Device, num_stages: Optional[int] = None,
                 required: bool = False, timeout: float = 300.0,
                 setup_group: Optional[dist.ProcessGroup] = None) -> None:
        self._routes: dict[int, tuple] = {}
        self._describe(group, torch.device(device), num_stages, "ipc" if required else "auto", timeout, setup_group)

    def set_route(self, peer: int, send_group: dist.ProcessGroup, send_peer: int,
                  recv_group: dist.ProcessGroup, recv_peer: int) -> None:
        """Kept until the transport is settled; used by the NCCL fallback, not by CUDA IPC (it matches by tag)."""
        self._routes[peer] = (send_group, send_peer, recv_group, recv_peer)
        if self.transport == "process_group":
            super().set_route(peer, *self._routes[peer])

    def _take(self, settled: Settled) -> None:
        super()._take(settled)
        if settled.kind == "process_group":
            for peer, route in self._routes.items():
                settled.channel.set_route(peer, *route)
