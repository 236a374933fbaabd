"""The transport: what moves a multi-process pipeline's messages between two ranks, and how the ranks choose it.

Three modules, each importing only the ones before it:

- ``decide.py``: pure decisions. The request (``requested_transport``,
  ``check_request``) and, from every rank's description of itself, which
  transport each edge takes (``decide_edges``, ``decide_transport``,
  ``probe_verdict``); no process group, no state.
- ``setup.py``: the exchange over the group that gathers those descriptions
  (``_Setup``), and the one registry per process group that holds what it
  settled (``GroupTransport``, [Note: one transport per group]).
- ``channels.py``: the channels, the Python faces of the C++ ones
  (``DistChannel``, ``AutoChannel``, ``IpcChannel``, ``PerEdgeChannel``), and
  ``make_channel``, which builds the one a request asks for.

The flow goes one way: a same-host channel posts its rank's description when
it is built; the step's opening (``comm/session.Step.open``) calls
``connect()`` once the ranks agreed on what they asked for; the setup waits
for the peers, the decision runs, and the channel takes its C++ channel from
the settled record. Nothing settles as a side effect of a message or a question.

Choosing: ``PipelineSchedule(transport=...)`` or ``$PIPELINE_EXT_TRANSPORT``:
``"auto"`` (default), ``"process_group"`` (the process group's own backend,
Gloo on CPU and NCCL on GPU, whatever the hosts; ``"gloo"`` and ``"nccl"`` are
other names for it), ``"shm"`` (shared memory, an error naming the hosts when
the ranks are not all on this one) or ``"ipc"`` (GPU stages: CUDA IPC between
the processes of one host; an error naming the problem on CPU stages, across
hosts, or where IPC is not available).

GPU stages: ``"auto"`` is the process group (NCCL): the CUDA IPC channel has
not yet run on a GPU, so it is used only when asked for (``"ipc"``). Once it
has, ``"auto"`` is to pick it when every rank is on this host and every rank
can use it, which is what ``decide_transport`` already decides.
``PIPELINE_EXT_SHM_RING_BYTES`` sizes each ring (default 8 MiB; larger
messages go in chunks) and must be equal on every rank.
"""
from pipeline_ext._lazy import lazy_names

_DECIDE = "pipeline_ext.comm.transport.decide"
_SETUP = "pipeline_ext.comm.transport.setup"
_CHANNELS = "pipeline_ext.comm.transport.channels"
#: the package's names, each from its module (resolved at first use: ``decide`` needs no process group)
_EXPORTS = {
    **dict.fromkeys(["TRANSPORTS", "TRANSPORT_ENV", "HOST_ENV", "RING_BYTES_ENV", "ACK_RING_BYTES",
                     "DEFAULT_RING_BYTES", "DEFAULT_SPIN_US", "requested_transport", "check_request",
                     "decide_transport", "decide_edges", "edges_digest", "edges_kind", "edges_summary",
                     "hosts_summary", "probe_verdict"], _DECIDE),
    **dict.fromkeys(["GroupTransport", "Settled", "announce_edges", "hosts_note", "ipc_unavailable"], _SETUP),
    **dict.fromkeys(["DistChannel", "AutoChannel", "IpcChannel", "PerEdgeChannel", "make_channel"], _CHANNELS),
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_names(__name__, _EXPORTS, __all__)
