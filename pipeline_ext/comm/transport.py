"""Which transport a multi-process pipeline's channels use, and the setup over the group that settles it.

One mechanism, the choice: the request (``requested_transport``,
``check_request``), each rank's description of itself to every peer
(``_Setup``: host, shared-memory inbox, whether it can use CUDA IPC, a probe),
the decision every rank takes alike from those descriptions
(``decide_transport``, ``probe_verdict``), and the per-group record of what was
settled (``_post`` when a group's first channel is built, ``_connect`` at its
first message; ``UnsettledTransport`` stands in for a channel's C++ channel
until then). The channels that move the bytes over what this settles
(``AutoChannel``, ``IpcChannel``, and ``make_channel`` that builds the one a
request asks for) are in ``shm.py``: the decision is a pure function of the
ranks' descriptions, read and tested without a channel, and the channels do
not depend on how the ranks came to agree.

Each rank describes itself to every peer over the group when its first
channel on that group is built (see ``_Setup``); the transport is decided at
the first message. All channels of one process on one group share one
transport, as they share the group's Gloo pairs.

Choosing: ``PipelineSchedule(transport=...)`` or the environment variable
``PIPELINE_EXT_TRANSPORT``: ``"auto"`` (default), ``"process_group"`` (the
process group's own backend, Gloo on CPU and NCCL on GPU, whatever the hosts;
``"gloo"`` and ``"nccl"`` are accepted as other names for it), ``"shm"`` (shared
memory, an error naming the hosts when the ranks are not all on this one) or
``"ipc"`` (GPU stages: CUDA IPC between the processes of one host, see
``IpcChannel`` in shm.py; an error naming the problem on CPU stages, across hosts,
or where IPC is not available).

GPU stages: ``"auto"`` is the process group (NCCL): the CUDA IPC channel has
not yet run on a GPU, so it is used only when asked for (``"ipc"``). Once it
has, ``"auto"`` is to pick it when every rank is on this host and every rank
can use it (a CUDA build of ``pipeline_ext._C``, a CUDA device), which is what
:func:`decide_transport` already decides: a function of every rank's
description alone, so every rank takes the same branch.
``PIPELINE_EXT_SHM_RING_BYTES`` sizes each ring (default 8 MiB; larger
messages go in chunks) and must be equal on every rank.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import weakref
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from pipeline_ext.runtime._ext import _C
from pipeline_ext.runtime.channel import ChannelError, ChannelTimeout, _ms

__all__ = ["TRANSPORTS", "TRANSPORT_ENV", "UnsettledTransport", "check_request", "decide_transport",
           "ipc_unavailable", "probe_verdict", "requested_transport"]

TRANSPORTS = ("auto", "process_group", "shm", "ipc")
#: other names accepted for a transport
TRANSPORT_ALIASES = {"gloo": "process_group", "nccl": "process_group"}
TRANSPORT_ENV = "PIPELINE_EXT_TRANSPORT"
RING_BYTES_ENV = "PIPELINE_EXT_SHM_RING_BYTES"
SPIN_US_ENV = "PIPELINE_EXT_SHM_SPIN_US"
DEFAULT_RING_BYTES = 8 << 20
DEFAULT_SPIN_US = 20
#: the rings of a CUDA IPC channel's acknowledgements (one block id per message)
ACK_RING_BYTES = 256 << 10  # the smallest ring ShmChannel takes (4 chunks of 64 KiB)


def requested_transport(transport: Optional[str]) -> str:
    """The transport asked for: the argument, else ``$PIPELINE_EXT_TRANSPORT``, else ``"auto"``."""
    choice = transport if transport is not None else os.environ.get(TRANSPORT_ENV, "auto")
    choice = str(choice).strip().lower()
    choice = TRANSPORT_ALIASES.get(choice, choice)
    if choice not in TRANSPORTS:
        source = "transport=" if transport is not None else f"${TRANSPORT_ENV}="
        raise ValueError(f"{source}{choice!r}: the transport must be one of {', '.join(TRANSPORTS)} "
                         "(gloo and nccl are other names of process_group)")
    return choice


def check_request(choice: str, device: torch.device) -> None:
    """Refuses a transport that cannot move ``device`` tensors, before anything is set up (ValueError)."""
    if choice == "shm" and device.type != "cpu":
        raise ValueError(f"transport='shm' moves CPU tensors; stages on {device} use the process group "
                         "or CUDA IPC (transport='auto', 'ipc' or 'process_group')")
    if choice == "ipc" and device.type != "cuda":
        raise ValueError(f"transport='ipc' moves CUDA tensors between the processes of one host; stages on "
                         f"{device} use shared memory or the process group (transport='auto', 'shm' or 'process_group')")


def ipc_unavailable(device: Union[str, torch.device]) -> str:
    """Why this process cannot move ``device`` tensors over CUDA IPC; empty when it can.

    A local check (the extension, the device); whether two processes can map
    each other's memory is only known when the first handle is opened.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return f"stages on {device}, not a CUDA device"
    if not getattr(_C, "with_cuda", False) or not hasattr(_C, "IpcChannel"):
        return "pipeline_ext._C was built without CUDA"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    if device.index is not None and device.index >= torch.cuda.device_count():
        return f"{device} does not exist ({torch.cuda.device_count()} CUDA devices)"
    return ""


def probe_verdict(reports: dict[int, str]) -> str:
    """Why CUDA IPC cannot be used, from every rank's probe report ("" when it opened every peer's memory)."""
    return "; ".join(r for _, r in sorted(reports.items()) if r)


def _hosts(me: dict, peers: dict[int, dict]) -> str:
    return ", ".join(sorted({e["host"].split("|")[0] + ("" if e["host"] == me["host"] else " (other boot or namespace)")
                             for e in [me, *peers.values()]}))


def decide_transport(device_type: str, rank: int, me: dict, peers: dict[int, dict]) -> tuple[str, str]:
    """The transport every rank of a group settles on, from every rank's description: ``(kind, reason)``.

    ``kind`` is "shm" (CPU stages), "ipc" (CUDA stages) or "process_group";
    ``reason`` says why not the same-host transport. A description (``_Setup``)
    holds ``host``, ``ring_bytes``, ``segment`` (the inbox, "" when it could not
    be made), ``error`` (why not) and for CUDA stages ``ipc`` (why this rank
    cannot use CUDA IPC, "" when it can) and ``acks`` (the acknowledgement inbox).
    Every rank sees the same descriptions, so every rank gets the same answer
    (the fallback is taken together). Rings of different sizes are an error.
    """
    if any(e["host"] != me["host"] for e in peers.values()):
        return "process_group", "hosts: " + _hosts(me, peers)
    everyone = sorted([(rank, me), *peers.items()], key=lambda pe: pe[0])
    if device_type == "cuda":
        no_ipc = {p: e.get("ipc", "no CUDA IPC description") for p, e in everyone if e.get("ipc", "?")}
        if no_ipc:
            return "process_group", "no CUDA IPC (" + "; ".join(f"rank {p}: {why}" for p, why in no_ipc.items()) + ")"
    unmade = {p: e.get("error", "") for p, e in everyone if not e["segment"] or (device_type == "cuda" and not e.get("acks"))}
    if unmade:
        said = "; ".join(f"rank {p}: {why}" for p, why in sorted(unmade.items()))
        return "process_group", f"no shared-memory inbox ({said})"
    rings = sorted({e["ring_bytes"] for _, e in everyone})
    if len(rings) > 1:
        raise ChannelError(f"${RING_BYTES_ENV} differs between the ranks ({rings}); set the same value everywhere")
    return ("ipc" if device_type == "cuda" else "shm"), ""


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
    """What one process uses on one group: ``kind`` ("shm" or "process_group"), the C++ channel, and why."""

    def __init__(self, kind: str, channel: Any, reason: str = "", hosts: Optional[dict[int, str]] = None) -> None:
        self.kind, self.channel, self.reason = kind, channel, reason
        #: every rank's host (``_host_id``), as the setup exchanged them: what a failed step names
        self.hosts = hosts or {}


#: Tag of the setup messages on the group (the step records use 2**31 - 1; data tags are below 2**31).
SETUP_TAG = 2**31 - 2
#: Tag of the CUDA IPC probe reports (GPU stages' second setup round)
PROBE_TAG = 2**31 - 3
_INFO_BYTES = 1024


class _Setup:
    """One group's transport setup: posted when its first channel is built, finished at its first message.

    Posting creates this rank's inbox and sends (host, ring size, inbox name) to
    every peer over the group itself (Gloo point to point, so every wait is
    bounded; a store can be served by a frozen rank and wait past any timeout).
    Finishing waits for the peers' messages, then maps their inboxes (shm) or
    drops this rank's (Gloo). A peer that is already stuck in its first step
    has sent its message when it built its channel, so the setup never waits on
    a peer's main thread. GPU stages about to use CUDA IPC take a second round
    (``_probe``): each rank opens every peer's exported probe buffer and sends
    every peer how that went, so that all fall back together if any failed;
    that round waits for every peer's first message (bounded by ``timeout``).
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device = torch.device("cpu"),
                 wire: Optional[dist.ProcessGroup] = None) -> None:
        # ``group`` carries the data of the fallback (NCCL for CUDA stages); ``wire`` (default: ``group``)
        # carries the descriptions, CPU tensors.
        self.group, self.rank, self.size = group, group.rank(), group.size()
        self.device, self.wire = device, wire if wire is not None else group
        self.ring_bytes = _int_env(RING_BYTES_ENV, DEFAULT_RING_BYTES)
        # An inbox that cannot be made (a small /dev/shm, as in containers) is told to the peers, so that
        # every rank falls back to Gloo together ("auto") or names the reason ("shm").
        self.shm: Optional[Any] = None
        self.error = ""
        try:
            self.shm = _C.ShmChannel(self.rank, self.size, self.ring_bytes, _int_env(SPIN_US_ENV, DEFAULT_SPIN_US))
        except ChannelError as exc:
            self.error = str(exc)[:400]
        # CUDA stages: whether this rank can use CUDA IPC, a second inbox for the receivers' acknowledgements,
        # and a probe: a small exported buffer every peer tries to open (finish)
        self.ipc, self.acks, self.probe, self.probe_handle = "", None, None, ""
        if device.type == "cuda":
            self.ipc = ipc_unavailable(device)[:200]
            if self.shm is not None and not self.ipc:
                try:
                    self.acks = _C.ShmChannel(self.rank, self.size, ACK_RING_BYTES, _int_env(SPIN_US_ENV, DEFAULT_SPIN_US))
                    self.probe = torch.zeros(1, device=device)
                    self.probe_handle = bytes(_C.ipc_export_probe(self.probe)).hex()
                except (ChannelError, RuntimeError) as exc:
                    self.error = str(exc)[:400]
        self._post(SETUP_TAG, self._describe())

    def _post(self, tag: int, info: dict) -> None:
        """Sends ``info`` to every peer over the wire and posts the receives of theirs (``_gather`` waits)."""
        data = json.dumps(info).encode()
        if len(data) > _INFO_BYTES:
            raise ChannelError(f"transport setup: this rank's message takes {len(data)} bytes, more than {_INFO_BYTES}")
        out = torch.zeros(_INFO_BYTES, dtype=torch.uint8)
        out[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.inbox = {p: torch.zeros(_INFO_BYTES, dtype=torch.uint8) for p in range(self.size) if p != self.rank}
        self.works: list[tuple[int, Any]] = []
        self.failed: Optional[tuple[int, Exception]] = None  # raised by _gather(): building a channel never fails
        for peer, buf in self.inbox.items():
            try:
                self.works += [(peer, self.wire.recv([buf], peer, tag)), (peer, self.wire.send([out], peer, tag))]
            except Exception as exc:  # noqa: BLE001 - a peer already gone: said at the first message
                self.failed = (peer, exc)
                break

    def _gather(self, timeout: float, what: str) -> dict[int, dict]:
        """The peers' messages of the exchange posted last (each wait bounded by ``timeout``)."""
        for peer, work in self.works:
            if self.failed is not None:
                break
            try:
                _C.wait_work(work, _ms(timeout), f"rank {self.rank}: waiting for rank {peer}'s transport {what}")
            except ChannelError as exc:
                self.failed = (peer, exc)
        if self.failed is not None:
            peer, exc = self.failed
            raise ChannelTimeout(f"rank {self.rank}: setting up the pipeline transport, rank {peer}'s {what} "
                                 f"did not come within {timeout:g} s (has it built its schedule?): {exc}")
        return {p: json.loads(bytes(buf.numpy()).rstrip(b"\0").decode()) for p, buf in self.inbox.items()}

    def _describe(self) -> dict:
        info = {"host": _host_id(), "ring_bytes": self.ring_bytes,
                "segment": self.shm.name if self.shm is not None else "", "error": self.error}
        if self.device.type == "cuda":
            info.update(ipc=self.ipc, acks=self.acks.name if self.acks is not None else "", probe=self.probe_handle)
        return info

    def _probe(self, peers: dict[int, dict], timeout: float) -> str:
        """Second round (CUDA stages about to use IPC): open every peer's probe, tell every peer how it went.

        Every rank ends with every rank's report, so every rank takes the same verdict (``probe_verdict``).
        """
        failed = []
        for peer, e in sorted(peers.items()):
            why = _C.ipc_open_probe(bytes.fromhex(e.get("probe", "")), self.device) if e.get("probe") else "no probe"
            if why:
                failed.append(f"rank {self.rank} cannot open rank {peer}'s memory: {why}")
        mine = "; ".join(failed)[:400]
        self._post(PROBE_TAG, {"report": mine})
        reports = {p: r["report"] for p, r in self._gather(timeout, "CUDA IPC probe report").items()}
        self.probe = None  # every peer has opened (and closed) it
        return probe_verdict({**reports, self.rank: mine})

    def _fallback(self, reason: str) -> _GroupTransport:
        self.drop()
        return _GroupTransport("process_group", _C.ProcessGroupChannel(self.group, self.device), reason)

    def finish(self, timeout: float) -> _GroupTransport:
        peers = self._gather(timeout, "description")
        try:
            kind, reason = decide_transport(self.device.type, self.rank, self._describe(), peers)
        except ChannelError:
            self.drop()
            raise
        if kind == "ipc":
            failed = self._probe(peers, timeout)
            if failed:
                kind, reason = "process_group", f"CUDA IPC between the ranks failed ({failed})"
        if kind == "process_group":
            settled = self._fallback(reason)
            settled.hosts = {p: e["host"] for p, e in [(self.rank, self._describe()), *peers.items()]}
            return settled
        for peer, e in peers.items():
            self.shm.attach(peer, e["segment"])
            if self.acks is not None:
                self.acks.attach(peer, e["acks"])
        if kind == "ipc":
            return _GroupTransport("ipc", _C.IpcChannel(self.shm, self.acks, self.device))
        return _GroupTransport("shm", self.shm)

    def drop(self) -> None:
        """Withdraw this rank's inbox (the transport is not shared memory after all, or setup failed)."""
        for inbox in (self.shm, self.acks):
            if inbox is not None:
                inbox.withdraw()


# By group object (weakly), in flight or decided: a group destroyed and made again under the same name gets
# a transport of its own, as it gets step numbers of its own (comm/identity.GroupSteps).
_setups: "weakref.WeakKeyDictionary[dist.ProcessGroup, Union[_Setup, _GroupTransport]]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


# GPU stages' setups, by the group their fallback uses (NCCL), apart from CPU stages' on the same group.
_cuda_setups: "weakref.WeakKeyDictionary[dist.ProcessGroup, Union[_Setup, _GroupTransport]]" = weakref.WeakKeyDictionary()
_NAMES = {"shm": "shared memory", "ipc": "CUDA IPC"}


def _post(group: dist.ProcessGroup, device: torch.device = torch.device("cpu"),
          wire: Optional[dist.ProcessGroup] = None) -> None:
    """Start the group's setup, once per process (every channel on a group shares its transport)."""
    setups = _cuda_setups if device.type == "cuda" else _setups
    with _lock:
        if group not in setups:
            setups[group] = _Setup(group, device, wire)


def _connect(group: dist.ProcessGroup, required: Union[bool, str], timeout: float,
             device: torch.device = torch.device("cpu")) -> _GroupTransport:
    """The group's transport, finishing its setup if this is the first message: shm or ipc on one host, else
    the process group. ``required``: the transport that must come out ("shm", "ipc"; True: "shm"), or False."""
    setups = _cuda_setups if device.type == "cuda" else _setups
    with _lock:
        known = setups[group]
        if isinstance(known, _Setup):
            try:
                known = known.finish(timeout)
            except BaseException:
                known.drop()
                raise
            setups[group] = known
    wanted = "shm" if required is True else required
    if wanted and known.kind != wanted:
        raise ChannelError(f"transport={wanted!r}: group {group.group_name!r} cannot use {_NAMES[wanted]} "
                           f"({known.reason}); use transport='auto' or 'process_group'")
    return known


def hosts_note(group: Any) -> str:
    """Which ranks of ``group`` run on which host, when they are on more than one (else ""): what a failed step adds
    to its error, so that "peer rank 2" also says where to look. Known once the group's transport is settled by an
    exchange (``transport="auto"``, "shm", "ipc"); a group on ``"process_group"`` never exchanged it."""
    if group is None:
        return ""
    settled = [t for t in (_setups.get(group), _cuda_setups.get(group)) if isinstance(t, _GroupTransport) and t.hosts]
    if not settled or len(set(settled[0].hosts.values())) < 2:
        return ""
    by_host: dict[str, list[int]] = {}
    for rank, host in sorted(settled[0].hosts.items()):
        by_host.setdefault(host, []).append(rank)
    names = [h.partition("|")[0] for h in by_host]

    def where(host: str) -> str:
        name, _, rest = host.partition("|")  # (_host_id: hostname|boot id|/dev/shm|pid namespace)
        return name + (f" ({rest})" if names.count(name) > 1 else "")  # one name, two hosts: say which

    said = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} on host {where(h)}"
                     for h, ranks in by_host.items())
    return f"pipeline_ext: the ranks' hosts: {said}"


class UnsettledTransport:
    """The C++ channel of an ``AutoChannel`` whose transport is not settled yet: shared memory or the group's own.

    ``owner`` is that ``AutoChannel`` (or ``IpcChannel``, comm/shm.py). It takes the C++ channel's place until the first message (or ``begin_step``)
    settles the group's transport (collective over the group, see ``_Setup``);
    then the ``AutoChannel`` holds the settled ``_C.ShmChannel`` or
    ``_C.ProcessGroupChannel`` itself, and this object is dropped.
    """

    def __init__(self, owner: Any, group: dist.ProcessGroup, required: Union[bool, str], timeout: float,
                 device: torch.device = torch.device("cpu"), wire: Optional[dist.ProcessGroup] = None) -> None:
        self._owner, self._group, self._required, self._timeout = owner, group, required, timeout
        self.rank = group.rank()
        self.device = device
        _post(group, device, wire)

    def _resolve(self) -> Any:
        transport = _connect(self._group, self._required, self._timeout, self.device)
        self._owner.transport = transport.kind
        self._owner._pg = transport.channel
        self._owner._settled(transport)
        return transport.channel

    def send(self, *args: Any) -> Any:
        return self._resolve().send(*args)

    def recv(self, *args: Any) -> Any:
        return self._resolve().recv(*args)

    def recv_layout(self, *args: Any) -> Any:
        return self._resolve().recv_layout(*args)
