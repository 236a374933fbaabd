"""The setup over a group that settles its transport, and the one record per group of what it settled.

Each rank describes itself to every peer (``_Setup``: host, shared-memory
inbox, whether it can use CUDA IPC, a probe) when its first same-host channel
on a group is built (``GroupTransport.post``); the step's opening connects
(``GroupTransport.connect``, from ``Step.open``): it waits for the peers'
descriptions, hands them to the pure decision (``decide.py``) and keeps what
came out (``Settled``: the kind, the C++ channel(s), every edge's transport,
every rank's host). The channels (``channels.py``) take their C++ channel
from that record; nothing here writes into a channel.

[Note: one transport per group]
All channels of one process on one group share one transport, as they share
the group's Gloo pairs: the setup's messages go under fixed tags on the
group, and a process has one inbox per group. So what the setup settled
belongs to the group, not to a schedule: ``GroupTransport.of(group)`` is the
group's one registry in this process (its setups, in flight or settled, one
per device type, and the summary lines already said), and a training and an
eval schedule on one group use the same. The group's lifetime is torch's
(``new_group``, ``destroy_process_group``) and a ``ProcessGroup`` takes no
attributes, so the registry hangs on the group by a weak reference: a group
destroyed and made again, even under the same name, gets a registry of its
own, as it gets step numbers of its own (``comm/identity.GroupSteps``). It
is the package's only state that outlives a channel.

Same host means same hostname, boot id, /dev/shm (device and inode) and PID
namespace (``_host_id``), never the hostname alone. ``$PIPELINE_EXT_TEST_HOST``
is for tests and benchmarks only: when set, it is added to this process's
host identity, so that ranks of one machine given different values act as
ranks of different hosts (it can only split a host, never join two).
"""
from __future__ import annotations

import json
import os
import socket
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from pipeline_ext.comm.transport.decide import (ACK_RING_BYTES, DEFAULT_RING_BYTES, DEFAULT_SPIN_US, HOST_ENV,
                                                RING_BYTES_ENV, SPIN_US_ENV, Table, decide_edges, decide_transport,
                                                edges_kind, edges_summary, hosts_of, hosts_summary, probe_verdict,
                                                whole_group)
from pipeline_ext.runtime._ext import _C
from pipeline_ext.runtime.channel import ChannelError, ChannelTimeout, _ms

__all__ = ["GroupTransport", "Settled", "announce_edges", "hosts_note", "ipc_unavailable"]


def ipc_unavailable(device: Union[str, torch.device]) -> str:
    """Why this process cannot move ``device`` tensors over CUDA IPC; empty when it can.

    A local check (the extension, the device), part of this rank's
    description; whether two processes can map each other's memory is only
    known when the first handle is opened (the probe round, ``_Setup._probe``).
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


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    try:
        return default if raw is None else int(raw)
    except ValueError:
        raise ValueError(f"${name}={raw!r} is not an integer") from None


def _host_id() -> str:
    """Equal on two processes that can share /dev/shm and see each other's pids (``hostname|boot|shm|pidns``)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    shm = os.stat("/dev/shm") if os.path.isdir("/dev/shm") else None
    pidns = os.stat("/proc/self/ns/pid").st_ino if os.path.exists("/proc/self/ns/pid") else 0
    simulated = os.environ.get(HOST_ENV, "")  # tests only (module doc): splits a host, never joins two
    name = socket.gethostname() + (f"~{simulated}" if simulated else "")
    return f"{name}|{boot}|{shm and (shm.st_dev, shm.st_ino)}|{pidns}"


@dataclass
class Settled:
    """What one group's setup settled in this process: data the channels read, never change.

    ``kind`` is "shm", "ipc", "process_group" or "per_edge" (the group's, from
    every edge: ``decide.edges_kind``); ``reason`` says why not the same-host
    transport everywhere. ``channel`` is the C++ channel messages to every
    peer go on, except the ``near`` peers' (a rank with peers on its host and
    on others: [Note: transport per edge]), which go on ``near_channel``
    (shared memory; ``channels.PerEdgeChannel`` routes them).
    """

    kind: str
    channel: Any
    reason: str = ""
    #: every rank's host (``_host_id``), as the setup exchanged them: what a failed step names
    hosts: dict[int, str] = field(default_factory=dict)
    #: every pair of ranks' transport and why (``decide.decide_edges``), the same on every rank
    edges: Table = field(default_factory=dict)
    near: frozenset = frozenset()
    near_channel: Any = None


#: Tag of the setup messages on the group (the step records use 2**31 - 1; data tags are below 2**31).
SETUP_TAG = 2**31 - 2
#: Tag of the CUDA IPC probe reports (GPU stages' second setup round)
PROBE_TAG = 2**31 - 3
_INFO_BYTES = 1024


class _Setup:
    """One group's transport setup: posted when its first channel is built, finished by the step's opening.

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
        #: this rank's description as its peers got it (what the decision reads on every rank)
        self.mine = self._describe()
        self._post(SETUP_TAG, self.mine)

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
            except Exception as exc:  # noqa: BLE001 - a peer already gone: said when connecting
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

    def _process_group(self) -> Any:
        """The group's own C++ channel, for a rank with no peer on shared memory: its inbox is withdrawn."""
        self.drop()
        return _C.ProcessGroupChannel(self.group, self.device)

    def finish(self, timeout: float) -> Settled:
        peers = self._gather(timeout, "description")
        hosts = {p: e["host"] for p, e in [(self.rank, self.mine), *peers.items()]}
        if self.device.type != "cuda":
            return self._finish_per_edge(peers, hosts)
        try:
            kind, reason = decide_transport(self.device.type, self.rank, self.mine, peers)
        except ChannelError:
            self.drop()
            raise
        if kind == "ipc":
            failed = self._probe(peers, timeout)
            if failed:
                kind, reason = "process_group", f"CUDA IPC between the ranks failed ({failed})"
        edges = whole_group(hosts, kind, reason)
        if kind == "process_group":
            return Settled(kind, self._process_group(), reason, hosts, edges)
        for peer, e in peers.items():
            self.shm.attach(peer, e["segment"])
            if self.acks is not None:
                self.acks.attach(peer, e["acks"])
        return Settled("ipc", _C.IpcChannel(self.shm, self.acks, self.device), hosts=hosts, edges=edges)

    def _finish_per_edge(self, peers: dict[int, dict], hosts: dict[int, str]) -> Settled:
        """CPU stages: shared memory to this host's peers, the process group to the others' ([Note: transport per edge])."""
        try:
            edges = decide_edges(self.rank, self.mine, peers)
        except ChannelError:
            self.drop()
            raise
        kind = edges_kind(edges)
        # why not shared memory everywhere: the hosts first (as a forced "shm" names them), else the inboxes
        reasons = list(dict.fromkeys(r for _, r in edges.values() if r))
        reason = ("hosts: " + hosts_of(self.mine, peers)) if len(set(hosts.values())) > 1 else "; ".join(reasons)
        near = {b if a == self.rank else a for (a, b), (k, _) in edges.items() if k == "shm" and self.rank in (a, b)}
        if not near and peers:  # (a group of one rank keeps its inbox, as on one host: nothing moves)
            return Settled(kind, self._process_group(), reason, hosts, edges)
        for peer in sorted(near):
            self.shm.attach(peer, peers[peer]["segment"])
        if len(near) == len(peers):
            return Settled(kind, self.shm, reason, hosts, edges)
        return Settled(kind, _C.ProcessGroupChannel(self.group, self.device), reason, hosts, edges,
                       near=frozenset(near), near_channel=self.shm)

    def drop(self) -> None:
        """Withdraw this rank's inbox (the transport is not shared memory after all, or setup failed)."""
        for inbox in (self.shm, self.acks):
            if inbox is not None:
                inbox.withdraw()


class GroupTransport:
    """One process group's transport in this process: [Note: one transport per group].

    Holds the group's setups, one per device type (GPU stages' by the group
    their fallback uses, NCCL, apart from CPU stages' on the same group), each
    a ``_Setup`` until the first connect and a ``Settled`` after, and the
    summary lines group rank 0 already said.
    """

    _of: "weakref.WeakKeyDictionary[Any, GroupTransport]" = weakref.WeakKeyDictionary()
    _made = threading.Lock()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._setups: dict[str, Union[_Setup, Settled]] = {}
        self._said: set[str] = set()

    @classmethod
    def of(cls, group: Any) -> "GroupTransport":
        """``group``'s registry, made at its first use in this process."""
        with cls._made:
            known = cls._of.get(group)
            if known is None:
                known = cls._of[group] = cls()
            return known

    @classmethod
    def known(cls, group: Any) -> Optional["GroupTransport"]:
        """``group``'s registry if any channel on it was built in this process, else None (nothing is made)."""
        return cls._of.get(group) if group is not None else None

    def post(self, group: dist.ProcessGroup, device: torch.device, wire: Optional[dist.ProcessGroup] = None) -> None:
        """Start this process's setup for ``device`` stages, once (every channel on the group shares it)."""
        with self._lock:
            if device.type not in self._setups:
                self._setups[device.type] = _Setup(group, device, wire)

    def connect(self, device: torch.device, timeout: float) -> Settled:
        """What the setup for ``device`` stages settled; the first call finishes it (collective over the group:
        it waits, up to ``timeout`` per message, for every peer's description)."""
        with self._lock:
            known = self._setups[device.type]
            if isinstance(known, _Setup):
                try:
                    known = known.finish(timeout)
                except BaseException:
                    known.drop()
                    raise
                self._setups[device.type] = known
            return known

    def settled(self, device_type: str = "cpu") -> Optional[Settled]:
        """What the setup for ``device_type`` stages settled; None before the first connect (or without a setup)."""
        known = self._setups.get(device_type)
        return known if isinstance(known, Settled) else None

    def hosts(self) -> dict[int, str]:
        """Every rank's host, once a setup on the group settled by an exchange (else empty)."""
        for kind in ("cpu", "cuda"):
            settled = self.settled(kind)
            if settled is not None and settled.hosts:
                return settled.hosts
        return {}

    def say_once(self, line: str) -> bool:
        """True the first time ``line`` is said on this group in this process."""
        with self._lock:
            if line in self._said:
                return False
            self._said.add(line)
            return True


def announce_edges(group: Any, settled: Optional[Settled], edges: Any) -> str:
    """Group rank 0 says once which of ``edges`` (pairs of group ranks) uses what, when not every edge is on one
    host's transport (the group spans hosts, or an edge fell back); returns the line ("" when none is said).

    A ``UserWarning``, so that it shows once by default and filters like the library's other notices.
    """
    if settled is None or not settled.edges or settled.kind in ("shm", "ipc"):
        return ""
    line = f"pipeline_ext: transport per edge: {edges_summary(settled.edges, edges)}"
    if group.rank() != 0 or not GroupTransport.of(group).say_once(line):
        return ""
    warnings.warn(line, UserWarning, stacklevel=2)
    return line


def hosts_note(group: Any) -> str:
    """Which ranks of ``group`` run on which host, when they are on more than one (else ""): what a failed step adds
    to its error, so that "peer rank 2" also says where to look. Known once the group's transport is settled by an
    exchange (``transport="auto"``, "shm", "ipc"); a group on ``"process_group"`` never exchanged it."""
    registry = GroupTransport.known(group)
    return hosts_summary(registry.hosts()) if registry is not None else ""
