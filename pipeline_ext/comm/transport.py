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

[Note: transport per edge]
CPU stages choose per pair of ranks (``decide_edges``): shared memory between
two ranks of one host, the process group between hosts, so a job of two hosts
with several ranks each keeps its same-host edges off the network. Every rank
computes the whole table from the same descriptions, so every rank takes the
same choice for every edge; its digest travels in the step records
(``agreement.py``, ``edges_digest``), which checks it. A rank with peers of
both kinds holds a ``PerEdgeChannel`` (both C++ channels, each message on its
peer's); the group's ``kind`` is then "per_edge". When a group spans hosts, or
an edge of one host fell back, group rank 0 says once which edge uses what
(``announce_edges``: a ``UserWarning`` starting ``pipeline_ext: transport per
edge:``), and ``PipelineSchedule.transport_per_edge`` and the trace report
hold the table.

Same host means same hostname, boot id, /dev/shm (device and inode) and PID
namespace (``_host_id``), never the hostname alone. ``$PIPELINE_EXT_TEST_HOST``
is for tests and benchmarks only: when set, it is added to this process's
host identity, so that ranks of one machine given different values act as
ranks of different hosts (it can only split a host, never join two).

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
description alone, so every rank takes the same branch. GPU stages decide for
the whole group (CUDA IPC everywhere or the process group everywhere); the
per-edge choice is CPU stages'.
``PIPELINE_EXT_SHM_RING_BYTES`` sizes each ring (default 8 MiB; larger
messages go in chunks) and must be equal on every rank.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import warnings
import weakref
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from pipeline_ext.comm.identity import stable_hash
from pipeline_ext.runtime._ext import _C
from pipeline_ext.runtime.channel import ChannelError, ChannelTimeout, _ms

__all__ = ["TRANSPORTS", "TRANSPORT_ENV", "HOST_ENV", "PerEdgeChannel", "UnsettledTransport", "check_request",
           "decide_edges", "decide_transport", "edges_digest", "edges_kind", "edges_summary", "ipc_unavailable",
           "probe_verdict", "requested_transport"]

TRANSPORTS = ("auto", "process_group", "shm", "ipc")
#: other names accepted for a transport
TRANSPORT_ALIASES = {"gloo": "process_group", "nccl": "process_group"}
TRANSPORT_ENV = "PIPELINE_EXT_TRANSPORT"
RING_BYTES_ENV = "PIPELINE_EXT_SHM_RING_BYTES"
SPIN_US_ENV = "PIPELINE_EXT_SHM_SPIN_US"
#: tests and benchmarks only: added to this process's host identity (``_host_id``), to simulate several hosts
HOST_ENV = "PIPELINE_EXT_TEST_HOST"
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


Edge = tuple[int, int]


def _name(host: str) -> str:
    return host.split("|")[0]


def decide_edges(rank: int, me: dict, peers: dict[int, dict]) -> dict[Edge, tuple[str, str]]:
    """CPU stages' transport per pair of ranks ``(a, b)``, ``a < b``: ``{edge: (kind, reason)}``.

    ``kind`` is "shm" when both ranks are on one host (``_host_id``) and both
    made their inbox, else "process_group", with ``reason`` saying why not
    shared memory: ``hosts a|b`` (the hostnames; "other boot or namespace"
    when they are equal) or the rank whose inbox could not be made. A pure
    function of the descriptions (``decide_transport`` says what they hold),
    which every rank has alike, so every rank computes the same table. Rings of
    different sizes on a shared-memory edge are an error.
    """
    everyone = {rank: me, **peers}
    table: dict[Edge, tuple[str, str]] = {}
    ranks = sorted(everyone)
    for i, a in enumerate(ranks):
        for b in ranks[i + 1:]:
            ea, eb = everyone[a], everyone[b]
            if ea["host"] != eb["host"]:
                same_name = _name(ea["host"]) == _name(eb["host"])
                table[(a, b)] = ("process_group", f"hosts {_name(ea['host'])}|{_name(eb['host'])}"
                                 + (" (other boot or namespace)" if same_name else ""))
                continue
            unmade = [f"rank {p}: {e.get('error', '')}" for p, e in ((a, ea), (b, eb)) if not e["segment"]]
            if unmade:
                table[(a, b)] = ("process_group", f"no shared-memory inbox ({'; '.join(unmade)})")
                continue
            if ea["ring_bytes"] != eb["ring_bytes"]:
                raise ChannelError(f"${RING_BYTES_ENV} differs between the ranks ({sorted({ea['ring_bytes'], eb['ring_bytes']})});"
                                   " set the same value everywhere")
            table[(a, b)] = ("shm", "")
    return table


def edges_kind(table: dict[Edge, tuple[str, str]]) -> str:
    """The group's transport from its table: one kind on every edge ("shm", "ipc", "process_group"), else "per_edge"."""
    kinds = {kind for kind, _ in table.values()}
    return kinds.pop() if len(kinds) == 1 else ("per_edge" if kinds else "shm")


def edges_summary(table: dict[Edge, tuple[str, str]], edges: Optional[Any] = None) -> str:
    """``0<->1 shm, 1<->2 process_group (hosts a|b)``: the table's ``edges`` (pairs in any order; default all)."""
    pairs = sorted({tuple(sorted(e)) for e in edges} if edges is not None else table)
    said = []
    for a, b in pairs:
        if (a, b) in table:
            kind, reason = table[(a, b)]
            said.append(f"{a}<->{b} {kind}" + (f" ({reason})" if reason else ""))
    return ", ".join(said)


def edges_digest(table: Optional[dict[Edge, tuple[str, str]]]) -> int:
    """What the step records carry of the table (0: not settled yet), so that the ranks check they took the same."""
    if not table:
        return 0
    return stable_hash(repr(sorted((edge, kind) for edge, (kind, _) in table.items()))) or 1


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


class _GroupTransport:
    """What one process uses on one group: ``kind`` ("shm", "ipc", "process_group" or "per_edge"), the C++
    channel (or ``PerEdgeChannel``), and why not the same-host transport."""

    def __init__(self, kind: str, channel: Any, reason: str = "", hosts: Optional[dict[int, str]] = None,
                 edges: Optional[dict[Edge, tuple[str, str]]] = None) -> None:
        self.kind, self.channel, self.reason = kind, channel, reason
        #: every rank's host (``_host_id``), as the setup exchanged them: what a failed step names
        self.hosts = hosts or {}
        #: every pair of ranks' transport and why (``decide_edges``), the same on every rank
        self.edges = edges or {}


class PerEdgeChannel:
    """The C++ channel of a group whose ranks have peers on this host and on others: shared memory to the first,
    the process group to the second (``decide_edges``). Each message goes on its peer's channel; both keep the
    ``_C.Channel`` contract, so the executor cannot tell."""

    def __init__(self, shm: Any, pg: Any, shm_peers: set[int]) -> None:
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
        ranks = sorted(hosts)
        edges = {(a, b): (kind, reason) for i, a in enumerate(ranks) for b in ranks[i + 1:]}
        if kind == "process_group":
            settled = self._fallback(reason)
            settled.hosts, settled.edges = hosts, edges
            return settled
        for peer, e in peers.items():
            self.shm.attach(peer, e["segment"])
            if self.acks is not None:
                self.acks.attach(peer, e["acks"])
        return _GroupTransport("ipc", _C.IpcChannel(self.shm, self.acks, self.device), hosts=hosts, edges=edges)

    def _finish_per_edge(self, peers: dict[int, dict], hosts: dict[int, str]) -> _GroupTransport:
        """CPU stages: shared memory to this host's peers, the process group to the others' ([Note: transport per edge])."""
        try:
            edges = decide_edges(self.rank, self.mine, peers)
        except ChannelError:
            self.drop()
            raise
        kind = edges_kind(edges)
        # why not shared memory everywhere: the hosts first (as a forced "shm" names them), else the inboxes
        reasons = list(dict.fromkeys(r for _, r in edges.values() if r))
        reason = ("hosts: " + _hosts(self.mine, peers)) if len(set(hosts.values())) > 1 else "; ".join(reasons)
        near = {b if a == self.rank else a for (a, b), (k, _) in edges.items() if k == "shm" and self.rank in (a, b)}
        if not near and peers:  # (a group of one rank keeps its inbox, as on one host: nothing moves)
            settled = self._fallback(reason)
            settled.kind, settled.hosts, settled.edges = kind, hosts, edges
            return settled
        for peer in sorted(near):
            self.shm.attach(peer, peers[peer]["segment"])
        if len(near) == len(peers):
            return _GroupTransport(kind, self.shm, reason, hosts, edges)
        channel = PerEdgeChannel(self.shm, _C.ProcessGroupChannel(self.group, self.device), near)
        return _GroupTransport(kind, channel, reason, hosts, edges)

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


# Summaries said, by group (weakly): each once per process
_announced: "weakref.WeakKeyDictionary[Any, set[str]]" = weakref.WeakKeyDictionary()


def announce_edges(group: Any, settled: Optional[_GroupTransport], edges: Any) -> str:
    """Group rank 0 says once which of ``edges`` (pairs of group ranks) uses what, when not every edge is on one
    host's transport (the group spans hosts, or an edge fell back); returns the line ("" when none is said).

    A ``UserWarning``, so that it shows once by default and filters like the library's other notices.
    """
    if settled is None or not settled.edges or settled.kind in ("shm", "ipc"):
        return ""
    line = f"pipeline_ext: transport per edge: {edges_summary(settled.edges, edges)}"
    said = _announced.setdefault(group, set())
    if line in said or group.rank() != 0:
        return ""
    said.add(line)
    warnings.warn(line, UserWarning, stacklevel=2)
    return line


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
    then the ``AutoChannel`` holds the settled ``_C.ShmChannel``,
    ``_C.ProcessGroupChannel`` (or a ``PerEdgeChannel`` of both) itself, and this object is dropped.
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
        self._owner.settled = transport
        self._owner._pg = transport.channel
        self._owner._settled(transport)
        return transport.channel

    def send(self, *args: Any) -> Any:
        return self._resolve().send(*args)

    def recv(self, *args: Any) -> Any:
        return self._resolve().recv(*args)

    def recv_layout(self, *args: Any) -> Any:
        return self._resolve().recv_layout(*args)
