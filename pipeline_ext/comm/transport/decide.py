"""Which transport each edge of a group uses: pure functions of the request and of the ranks' descriptions.

Nothing here talks to another process or keeps anything: the setup
(``setup.py``) gathers every rank's description of itself and hands them
here, and every rank, given the same descriptions, computes the same answer.
That is what lets the ranks fall back together without a further round, and
what the tests check from plain dicts.

A description (``setup._Setup._describe``) holds ``host`` (``setup._host_id``),
``ring_bytes``, ``segment`` (where to open the rank's inbox, "" when it could
not be made), ``error`` (why not) and, for CUDA stages, ``ipc`` (why this rank
cannot use CUDA IPC, "" when it can), ``acks`` (the acknowledgement inbox) and
``probe`` (an exported buffer the peers try to open).

[Note: transport per edge]
CPU stages choose per pair of ranks (``decide_edges``): shared memory between
two ranks of one host, the process group between hosts, so a job of two hosts
with several ranks each keeps its same-host edges off the network. Every rank
computes the whole table from the same descriptions, so every rank takes the
same choice for every edge; its digest travels in the step records
(``comm/agreement.py``, ``edges_digest``), which checks it. A rank with peers
of both kinds holds a ``PerEdgeChannel`` (``channels.py``: both C++ channels,
each message on its peer's); the group's kind is then "per_edge". When a
group spans hosts, or an edge of one host fell back, group rank 0 says once
which edge uses what (``setup.announce_edges``: a ``UserWarning`` starting
``pipeline_ext: transport per edge:``), and ``PipelineSchedule.transport_per_edge``
and the trace report hold the table. GPU stages decide for the whole group
(``decide_transport``: CUDA IPC everywhere or the process group everywhere).
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch

from pipeline_ext.comm.identity import stable_hash
from pipeline_ext.runtime.channel import ChannelError

__all__ = ["TRANSPORTS", "TRANSPORT_ENV", "HOST_ENV", "RING_BYTES_ENV", "check_request", "decide_edges",
           "decide_transport", "edges_digest", "edges_kind", "edges_summary", "hosts_summary", "probe_verdict",
           "requested_transport"]

TRANSPORTS = ("auto", "process_group", "shm", "ipc")
#: other names accepted for a transport
TRANSPORT_ALIASES = {"gloo": "process_group", "nccl": "process_group"}
TRANSPORT_ENV = "PIPELINE_EXT_TRANSPORT"
RING_BYTES_ENV = "PIPELINE_EXT_SHM_RING_BYTES"
SPIN_US_ENV = "PIPELINE_EXT_SHM_SPIN_US"
#: tests and benchmarks only: added to this process's host identity (``setup._host_id``), to simulate several hosts
HOST_ENV = "PIPELINE_EXT_TEST_HOST"
DEFAULT_RING_BYTES = 8 << 20
DEFAULT_SPIN_US = 20
#: the rings of a CUDA IPC channel's acknowledgements (one block id per message)
ACK_RING_BYTES = 256 << 10  # the smallest ring ShmChannel takes (4 chunks of 64 KiB)

Edge = tuple[int, int]
Table = dict[Edge, tuple[str, str]]


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


def probe_verdict(reports: dict[int, str]) -> str:
    """Why CUDA IPC cannot be used, from every rank's probe report ("" when it opened every peer's memory)."""
    return "; ".join(r for _, r in sorted(reports.items()) if r)


def hosts_of(me: dict, peers: dict[int, dict]) -> str:
    """The hostnames of the ranks described, "(other boot or namespace)" after one that is not this rank's host."""
    return ", ".join(sorted({e["host"].split("|")[0] + ("" if e["host"] == me["host"] else " (other boot or namespace)")
                             for e in [me, *peers.values()]}))


def decide_transport(device_type: str, rank: int, me: dict, peers: dict[int, dict]) -> tuple[str, str]:
    """The transport every rank of a group settles on, from every rank's description: ``(kind, reason)``.

    ``kind`` is "shm" (CPU stages), "ipc" (CUDA stages) or "process_group";
    ``reason`` says why not the same-host transport. Every rank sees the same
    descriptions (the module doc says what they hold), so every rank gets the
    same answer (the fallback is taken together). Rings of different sizes
    are an error.
    """
    if any(e["host"] != me["host"] for e in peers.values()):
        return "process_group", "hosts: " + hosts_of(me, peers)
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


def _name(host: str) -> str:
    return host.split("|")[0]


def decide_edges(rank: int, me: dict, peers: dict[int, dict]) -> Table:
    """CPU stages' transport per pair of ranks ``(a, b)``, ``a < b``: ``{edge: (kind, reason)}``.

    ``kind`` is "shm" when both ranks are on one host (``setup._host_id``) and
    both made their inbox, else "process_group", with ``reason`` saying why not
    shared memory: ``hosts a|b`` (the hostnames; "other boot or namespace"
    when they are equal) or the rank whose inbox could not be made. Every rank
    has the same descriptions, so every rank computes the same table. Rings of
    different sizes on a shared-memory edge are an error.
    """
    everyone = {rank: me, **peers}
    table: Table = {}
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


def whole_group(ranks: Any, kind: str, reason: str) -> Table:
    """The table of a group that took one transport for every edge (GPU stages: ``decide_transport``)."""
    ranks = sorted(ranks)
    return {(a, b): (kind, reason) for i, a in enumerate(ranks) for b in ranks[i + 1:]}


def edges_kind(table: Table) -> str:
    """The group's transport from its table: one kind on every edge ("shm", "ipc", "process_group"), else "per_edge"."""
    kinds = {kind for kind, _ in table.values()}
    return kinds.pop() if len(kinds) == 1 else ("per_edge" if kinds else "shm")


def edges_summary(table: Table, edges: Optional[Any] = None) -> str:
    """``0<->1 shm, 1<->2 process_group (hosts a|b)``: the table's ``edges`` (pairs in any order; default all)."""
    pairs = sorted({tuple(sorted(e)) for e in edges} if edges is not None else table)
    said = []
    for a, b in pairs:
        if (a, b) in table:
            kind, reason = table[(a, b)]
            said.append(f"{a}<->{b} {kind}" + (f" ({reason})" if reason else ""))
    return ", ".join(said)


def edges_digest(table: Optional[Table]) -> int:
    """What the step records carry of the table (0: not settled yet), so that the ranks check they took the same."""
    if not table:
        return 0
    return stable_hash(repr(sorted((edge, kind) for edge, (kind, _) in table.items()))) or 1


def hosts_summary(hosts: dict[int, str]) -> str:
    """Which ranks run on which host (``{rank: host id}``), when they are on more than one (else ""):
    ``pipeline_ext: the ranks' hosts: ranks 0, 1 on host a; rank 2 on host b``. Two hosts of one hostname
    (containers, namespaces) are told apart by the rest of their identity."""
    if len(set(hosts.values())) < 2:
        return ""
    by_host: dict[str, list[int]] = {}
    for rank, host in sorted(hosts.items()):
        by_host.setdefault(host, []).append(rank)
    names = [h.partition("|")[0] for h in by_host]

    def where(host: str) -> str:
        name, _, rest = host.partition("|")  # (_host_id: hostname|boot id|/dev/shm|pid namespace)
        return name + (f" ({rest})" if names.count(name) > 1 else "")  # one name, two hosts: say which

    said = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} on host {where(h)}"
                     for h, ranks in by_host.items())
    return f"pipeline_ext: the ranks' hosts: {said}"
