"""The transport of a multi-process pipeline: Gloo/NCCL, or same-host shared memory for CPU ranks.

Why a second transport: a Gloo message costs the receiver an IO-thread and a
condition-variable wake-up, milliseconds per message on a loaded 2-core box,
and 1F1B has two messages per microbatch on its critical path. Between
processes of one host, C++ ``ShmChannel`` (csrc/runtime/shm_channel.h) writes
the bytes into the receiver's inbox (a ring in POSIX shared memory) and wakes
it through a futex after a short spin.

:class:`ShmChannel` is a :class:`DistChannel` whose transport is decided at its
first message, collectively over the group's store: shared memory when every
rank of the group is on this host (same hostname, boot, /dev/shm and pid
namespace), Gloo otherwise. The channel stays stateless and matches by (peer,
tag) exactly like Gloo, so the executor and the communication plans
(``protocol/plan.py``) use it unchanged. All channels of one process on one
group share one transport, as they share the group's Gloo pairs.

Choosing: ``PipelineSchedule(transport=...)`` or the environment variable
``PIPELINE_EXT_TRANSPORT``: ``"auto"`` (default), ``"gloo"`` (the process
group, whatever the hosts; the only choice for GPU stages) or ``"shm"`` (shared
memory, an error naming the hosts when the ranks are not all on this one).
``PIPELINE_EXT_SHM_RING_BYTES`` sizes each ring (default 8 MiB; larger
messages go in chunks) and must be equal on every rank.

Crash safety: every inbox's name is removed from /dev/shm as soon as every
peer mapped it (the end of the setup), so a SIGKILL leaves nothing behind; a
peer whose process is gone is reported by the wait (through a pidfd) within
50 ms, as Gloo reports a closed socket.
"""
from __future__ import annotations

import json
import os
import socket
import threading
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from pipeline_ext._ext import _C
from pipeline_ext.runtime.channels import ChannelError, DistChannel

__all__ = ["TRANSPORTS", "TRANSPORT_ENV", "ShmChannel", "make_channel", "requested_transport"]

TRANSPORTS = ("auto", "gloo", "shm")
TRANSPORT_ENV = "PIPELINE_EXT_TRANSPORT"
RING_BYTES_ENV = "PIPELINE_EXT_SHM_RING_BYTES"
SPIN_US_ENV = "PIPELINE_EXT_SHM_SPIN_US"
DEFAULT_RING_BYTES = 8 << 20
DEFAULT_SPIN_US = 20


def requested_transport(transport: Optional[str]) -> str:
    """The transport asked for: the argument, else ``$PIPELINE_EXT_TRANSPORT``, else ``"auto"``."""
    choice = transport if transport is not None else os.environ.get(TRANSPORT_ENV, "auto")
    choice = str(choice).strip().lower()
    if choice not in TRANSPORTS:
        source = "transport=" if transport is not None else f"${TRANSPORT_ENV}="
        raise ValueError(f"{source}{choice!r}: the transport must be one of {', '.join(TRANSPORTS)}")
    return choice


def make_channel(group: Optional[dist.ProcessGroup], device: Union[str, torch.device], num_stages: Optional[int],
                 transport: Optional[str] = None, timeout: float = 300.0) -> DistChannel:
    """The channel of a pipeline's stages on ``device`` (see the module doc for ``transport``)."""
    choice = requested_transport(transport)
    device = torch.device(device)
    if choice == "shm" and device.type != "cpu":
        raise ValueError(f"transport='shm' moves CPU tensors; stages on {device} use the process group "
                         "(transport='gloo' or 'auto')")
    if choice == "gloo" or device.type != "cpu":
        return DistChannel(group, device, num_stages=num_stages)
    return ShmChannel(group, num_stages=num_stages, required=choice == "shm", timeout=timeout)


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    try:
        return default if raw is None else int(raw)
    except ValueError:
        raise ValueError(f"${name}={raw!r} is not an integer") from None


def _host_id() -> str:
    """Equal on two processes that can share /dev/shm and see each other's pids."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    shm = os.stat("/dev/shm") if os.path.isdir("/dev/shm") else None
    pidns = os.stat("/proc/self/ns/pid").st_ino if os.path.exists("/proc/self/ns/pid") else 0
    return f"{socket.gethostname()}|{boot}|{shm and (shm.st_dev, shm.st_ino)}|{pidns}"


class _GroupTransport:
    """What one process uses on one group: ``kind`` ("shm" or "gloo"), the C++ channel, and why."""

    def __init__(self, kind: str, channel: Any, reason: str = "") -> None:
        self.kind, self.channel, self.reason = kind, channel, reason


_connected: dict[str, _GroupTransport] = {}  # by group name
_setups: dict[str, int] = {}  # setups started per group name: the store keys of one setup
_lock = threading.Lock()


def _connect(group: dist.ProcessGroup, required: bool, timeout: float) -> _GroupTransport:
    """Every rank of ``group`` meets in its store: shared memory if all are on this host, else Gloo."""
    name = group.group_name
    with _lock:
        known = _connected.get(name)
        if known is None:
            _setups[name] = _setups.get(name, 0) + 1
            known = _setup(group, f"pipeline_ext/transport/{_setups[name]}/", timeout)
            _connected[name] = known
    if required and known.kind != "shm":
        raise ChannelError(f"transport='shm': the ranks of group {name!r} are not all on this host "
                           f"({known.reason}); use transport='auto' or 'gloo'")
    return known


def _setup(group: dist.ProcessGroup, prefix: str, timeout: float) -> _GroupTransport:
    store = dist.distributed_c10d._get_process_group_store(group)
    rank, size = group.rank(), group.size()
    wait = timedelta(seconds=timeout)

    def gather(what: str, value: str) -> list[str]:
        store.set(f"{prefix}{what}/{rank}", value)
        keys = [f"{prefix}{what}/{r}" for r in range(size)]
        try:
            store.wait(keys, wait)
        except Exception as exc:  # noqa: BLE001 - the store's own error type varies by store
            raise ChannelError(f"rank {rank}: setting up the pipeline transport, not every rank of the group "
                               f"reached it within {timeout:g} s (do all ranks use the same transport "
                               f"setting?): {exc}") from None
        return [store.get(k).decode() for k in keys]

    ring_bytes = _int_env(RING_BYTES_ENV, DEFAULT_RING_BYTES)
    me = {"host": _host_id(), "ring_bytes": ring_bytes}
    everyone = [json.loads(v) for v in gather("host", json.dumps(me, sort_keys=True))]
    hosts = sorted({e["host"].split("|")[0] + ("" if e["host"] == me["host"] else " (other boot or namespace)")
                    for e in everyone})
    if any(e["host"] != me["host"] for e in everyone):
        return _GroupTransport("gloo", _C.ProcessGroupChannel(group, torch.device("cpu")), "hosts: " + ", ".join(hosts))
    rings = sorted({e["ring_bytes"] for e in everyone})
    if len(rings) > 1:
        raise ChannelError(f"${RING_BYTES_ENV} differs between the ranks ({rings}); set the same value everywhere")
    shm = _C.ShmChannel(rank, size, ring_bytes, _int_env(SPIN_US_ENV, DEFAULT_SPIN_US))
    try:
        names = gather("segment", shm.name)
        for peer, seg in enumerate(names):
            if peer != rank:
                shm.attach(peer, seg)
        gather("attached", "1")
    finally:
        shm.unlink()  # every peer mapped it (or the setup failed): nothing may outlive a crash in /dev/shm
    return _GroupTransport("shm", shm)


class _Unresolved:
    """Stands in for the C++ channel until the first message decides the transport."""

    def __init__(self, owner: "ShmChannel", group: dist.ProcessGroup, required: bool, timeout: float) -> None:
        self._owner, self._group, self._required, self._timeout = owner, group, required, timeout
        self.rank = group.rank()
        self.device = torch.device("cpu")

    def _resolve(self) -> Any:
        transport = _connect(self._group, self._required, self._timeout)
        self._owner.transport = transport.kind
        self._owner._pg = transport.channel
        return transport.channel

    def send(self, *args: Any) -> Any:
        return self._resolve().send(*args)

    def recv(self, *args: Any) -> Any:
        return self._resolve().recv(*args)

    def recv_layout(self, *args: Any) -> Any:
        return self._resolve().recv_layout(*args)


class ShmChannel(DistChannel):
    """A ``DistChannel`` over same-host shared memory (CPU stages); falls back to Gloo across hosts.

    ``required``: shared memory or an error (``transport="shm"``), instead of
    Gloo when the ranks are not all on this host. ``timeout`` bounds the setup
    at the first message. ``transport`` is ``None`` until then, then "shm" or "gloo".
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, num_stages: Optional[int] = None,
                 required: bool = False, timeout: float = 300.0) -> None:
        if group is None:
            if not dist.is_initialized():
                raise RuntimeError("ShmChannel: torch.distributed is not initialised (call init_process_group)")
            group = dist.group.WORLD
        self.num_stages = num_stages
        self.transport: Optional[str] = None
        self._pg = _Unresolved(self, group, required, timeout)

    def connect(self) -> str:
        """Decide the transport now (collective over the group, as the first message would); returns it."""
        if isinstance(self._pg, _Unresolved):
            self._pg._resolve()
        assert self.transport is not None
        return self.transport
