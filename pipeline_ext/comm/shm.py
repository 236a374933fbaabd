"""The same-host channels of a multi-process pipeline: shared memory (CPU stages) and CUDA IPC (GPU stages).

Why a second transport: a Gloo message costs the receiver an IO-thread and a
condition-variable wake-up, milliseconds per message on a loaded 2-core box,
and 1F1B has two messages per microbatch on its critical path. Between
processes of one host, C++ ``ShmChannel`` (csrc/runtime/shm_channel.h) writes
the bytes into the receiver's inbox (a ring in POSIX shared memory) and wakes
it through a futex after a short spin.

:class:`AutoChannel` is a :class:`DistChannel` whose transport is decided at its
first message, per pair of ranks: shared memory between two ranks of one host
(same hostname, boot, /dev/shm and pid namespace), Gloo between hosts. Which one,
and the setup over the group that decides it, is ``transport.py``'s (its
module doc also says how a transport is asked for); until then the channel
holds an ``UnsettledTransport``. The channel stays stateless and matches by
(peer, tag) exactly like Gloo, so the executor and the communication plans
(``comm/comm_plan.py``) use it unchanged. :class:`IpcChannel` is the same for
GPU stages over CUDA IPC. :func:`make_channel` builds the channel a request
(``transport=``) asks for.

Crash safety: an inbox is an anonymous file (``memfd_create``) that the peers
open through ``/proc/<pid>/fd``: nothing is ever named in /dev/shm, so no exit
(an exception, ``os._exit``, SIGKILL, before or after the first step) leaves
anything behind; a peer whose process is gone is reported by the wait
(through a pidfd) within 50 ms, as Gloo reports a closed socket.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist

from pipeline_ext.comm.channels import DistChannel
# The choice of transport moved to transport.py; its public names stay importable from here.
from pipeline_ext.comm.transport import (TRANSPORTS, TRANSPORT_ENV, UnsettledTransport, _GroupTransport,
                                         check_request, decide_transport, ipc_unavailable, probe_verdict,
                                         requested_transport)

__all__ = ["TRANSPORTS", "TRANSPORT_ENV", "IpcChannel", "AutoChannel", "UnsettledTransport", "check_request",
           "decide_transport", "ipc_unavailable", "make_channel", "probe_verdict", "requested_transport"]


def make_channel(group: Optional[dist.ProcessGroup], device: Union[str, torch.device], num_stages: Optional[int],
                 transport: Optional[str] = None, timeout: float = 300.0,
                 setup_group: Optional[dist.ProcessGroup] = None) -> DistChannel:
    """The channel of a pipeline's stages on ``device`` (``transport``: see transport.py's module doc).

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
        if choice != "ipc":  # "auto": NCCL until the CUDA IPC channel has run on a GPU (transport.py)
            return DistChannel(group, device, num_stages=num_stages)
        return IpcChannel(group, device, num_stages=num_stages, required=True, timeout=timeout,
                          setup_group=setup_group)
    return AutoChannel(group, num_stages=num_stages, required=choice == "shm", timeout=timeout)


class AutoChannel(DistChannel):
    """A ``DistChannel`` over same-host shared memory (CPU stages); Gloo across hosts, per pair of ranks.

    ``required``: shared memory or an error (``transport="shm"``), instead of
    Gloo when the ranks are not all on this host. ``timeout`` bounds the wait
    for the peers' descriptions at the first message. ``transport`` is ``None`` until then, then "shm",
    "process_group", or "per_edge" (shared memory to this host's peers, the process group to other hosts':
    ``edges`` says which, transport.py [Note: transport per edge]).
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, num_stages: Optional[int] = None,
                 required: bool = False, timeout: float = 300.0) -> None:
        self.group = self.resolve_group(group)
        self.num_stages = num_stages
        self.transport: Optional[str] = None
        self.settled = None
        self.requested = "shm" if required else "auto"
        self._pg = UnsettledTransport(self, self.group, required, timeout)

    def packs_single(self, peer: int) -> bool:
        """On shared memory (or CUDA IPC) one tensor is copied into the ring (an exported block) as it is: no
        pack buffer for it."""
        kind = self.transport
        if kind == "per_edge":
            kind = self.edges[(min(self.rank, peer), max(self.rank, peer))][0]
        return kind not in ("shm", "ipc")

    def matches_by_tag(self) -> bool:
        """Settles the transport (collective over the group), then says whether it matches by tag."""
        return self.connect() != "process_group" or self.device.type == "cpu"

    def _settled(self, transport: _GroupTransport) -> None:
        """The transport was just decided (``transport.channel`` is now ``_pg``)."""

    def begin_step(self, step: int) -> None:
        """Settle the transport (as the step's first message would); on shared memory, drop what earlier
        steps left in the inbox: a message is only ever taken by the step that sent it."""
        self.connect()
        super().begin_step(step)

    def connect(self) -> str:
        """Decide the transport now (collective over the group, as the first message would); returns it."""
        if isinstance(self._pg, UnsettledTransport):
            self._pg._resolve()
        assert self.transport is not None
        return self.transport


class IpcChannel(AutoChannel):
    """A ``DistChannel`` for GPU stages over CUDA IPC between the processes of one host; NCCL otherwise.

    The C++ ``_C.IpcChannel`` (csrc/runtime/ipc_channel.h): control messages
    (tag, layout, IPC handles of the sender's exported block and its events)
    travel over the shared-memory rings, matched by (peer, tag) like Gloo; the
    receiver copies the payload with ``cudaMemcpyAsync`` on its receive stream.
    Decided at the first message like ``AutoChannel``: the ranks describe
    themselves over ``setup_group`` (a group that moves CPU tensors, e.g. the
    Gloo twin of an NCCL group; ``group`` itself by default) and every rank
    takes the same transport (``decide_transport``). ``required``: CUDA IPC or
    an error (``transport="ipc"``). Routes (``set_route``) apply to the NCCL
    fallback only.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], device: Union[str, torch.device],
                 num_stages: Optional[int] = None, required: bool = False, timeout: float = 300.0,
                 setup_group: Optional[dist.ProcessGroup] = None) -> None:
        self.group = self.resolve_group(group)
        self.num_stages = num_stages
        self.transport: Optional[str] = None
        self.settled = None
        self.requested = "ipc" if required else "auto"
        self._routes: dict[int, tuple] = {}
        self._pg = UnsettledTransport(self, self.group, "ipc" if required else False, timeout,
                                      torch.device(device), setup_group)

    def set_route(self, peer: int, send_group: dist.ProcessGroup, send_peer: int,
                  recv_group: dist.ProcessGroup, recv_peer: int) -> None:
        """Kept until the transport is settled; used by the NCCL fallback, not by CUDA IPC (it matches by tag)."""
        self._routes[peer] = (send_group, send_peer, recv_group, recv_peer)
        if self.transport == "process_group":
            super().set_route(peer, *self._routes[peer])

    def _settled(self, transport: _GroupTransport) -> None:
        if transport.kind == "process_group":
            for peer, route in self._routes.items():
                transport.channel.set_route(peer, *route)
