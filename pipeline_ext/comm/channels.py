"""The multi-process channel over a torch.distributed process group (Gloo on CPU, NCCL on GPU).

It keeps no state: it moves one message per call (packed into ONE buffer the
send owns, so the caller may write its tensors again) and posts receives into
buffers of a layout it is given. Which layouts are known is the step's
communication plan (``comm/comm_plan.py``, held by the session per step kind);
a step talks to the channel through that plan's ``StepMessages``. Same-host
shared memory (``comm/shm.py``) is the other implementation of the same
interface.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence, Union

import torch

from pipeline_ext.runtime._ext import _C
from pipeline_ext.runtime.channel import ChannelError, ChannelHandle
from pipeline_ext.runtime.ops import explain_unmovable, raise_named
from pipeline_ext.runtime.tags import describe_tag

__all__ = ["DistChannel"]

Device = Union[str, torch.device]


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
    #: what the same-host channels settled (``comm/transport._GroupTransport``: per-edge table, hosts); None here
    settled = None

    def __init__(self, group: Optional["torch.distributed.ProcessGroup"] = None, device: Device = "cpu",
                 num_stages: Optional[int] = None) -> None:
        self.group = self.resolve_group(group)
        self._pg = _C.ProcessGroupChannel(self.group, torch.device(device))
        self.num_stages = num_stages

    @classmethod
    def resolve_group(cls, group: Optional["torch.distributed.ProcessGroup"]) -> "torch.distributed.ProcessGroup":
        """``group``, or the default (WORLD) group; an error naming the channel when there is none."""
        import torch.distributed as dist

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
        """Every pair of ranks' transport and why (``comm/transport.decide_edges``); empty until settled, and on a
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
        """The transport, decided (the process group needs no decision; the same-host channels settle theirs)."""
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

    def set_route(self, peer: int, send_group: "torch.distributed.ProcessGroup", send_peer: int,
                  recv_group: "torch.distributed.ProcessGroup", recv_peer: int) -> None:
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
        channel = self._pg  # the one the batch began on (a transport may be settled inside the block)
        if not hasattr(channel, "begin_batch"):
            yield
            return
        channel.begin_batch()
        try:
            yield
        finally:
            channel.end_batch()
