"""Channels: the executor's way to move tensors between ranks.

The executor only knows the ``Channel``/``Handle`` protocols (``send`` and
``recv`` returning handles with ``wait(timeout, what)`` and ``is_completed()``);
this module gives it two implementations over the C++ runtime:

- ``DistChannel`` over a torch.distributed ProcessGroup (one process per rank).
  It keeps no state: it moves one message per call (packed into ONE buffer
  the send owns, so the caller may write its tensors again) and posts receives
  into buffers of a layout it is given. Which layouts are known is the step's
  communication plan (``runtime/protocol/plan.py``, owned by the executor);
  the executor talks to a ``DistChannel`` through that plan's ``StepMessages``.
- ``LocalChannel`` over a ``LocalHub`` (one thread per rank, one process):
  tensors are handed over; across CUDA devices the copy runs on copy streams.

Every wait releases the GIL and raises ``ChannelTimeout`` (a ``TimeoutError``)
naming what it waited for, or ``ChannelError`` when a peer failed.
"""
from __future__ import annotations

import contextlib
import math
import signal
import threading
from typing import Any, Iterator, Optional, Sequence, Union

import torch

from pipeline_ext._ext import _C
from pipeline_ext.runtime.protocol.identity import describe_tag, stable_hash

__all__ = [
    "ChannelError",
    "ChannelTimeout",
    "ChannelHandle",
    "DistChannel",
    "check_timeout",
    "watch_signals",
    "LocalHub",
    "LocalChannel",
    "describe_tag",
    "stable_hash",
]

ChannelError = _C.ChannelError
ChannelTimeout = _C.ChannelTimeout
Device = Union[str, torch.device]


def check_timeout(timeout: Any, none_means: str) -> Optional[float]:
    """``timeout`` as seconds: a positive, finite number, or None (``none_means`` says what None does).

    Checked where the user passes it (construction), so a bad value is named
    once instead of failing every step later (inf or nan overflow the
    milliseconds, 0 makes Gloo fall back to its own timeout, -1 reads as "timed
    out after -1 s").
    """
    if timeout is None:
        return None
    ok = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
    if not ok or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"timeout must be a positive, finite number of seconds (or None: {none_means}), "
                         f"got {timeout!r}")
    return float(timeout)


def watch_signals() -> None:
    """Let a signal end a wait for a peer: Ctrl-C then reaches a waiting rank at once, not after ``timeout``.

    Hands the C++ signal watcher's pipe to ``signal.set_wakeup_fd`` (see
    csrc/runtime/interrupt.h). Only from the main thread, and only when no one
    else (an asyncio event loop) owns the wakeup fd: theirs is kept, and a
    wait then ends at its timeout as before. Cheap enough to call every step.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    fd = _C.interrupt_fd()
    try:
        old = signal.set_wakeup_fd(fd, warn_on_full_buffer=False)
    except ValueError:  # not the main interpreter
        return
    if old not in (-1, fd):
        signal.set_wakeup_fd(old)


def _ms(timeout: Optional[float]) -> int:
    """Seconds (Python side) to milliseconds (C++ side); None or inf waits forever."""
    if timeout is None or math.isinf(timeout):
        return -1
    return max(0, int(math.ceil(timeout * 1000)))


class ChannelHandle:
    """A send or receive in flight (wraps the C++ ``Request``)."""

    __slots__ = ("_request",)

    def __init__(self, request: "_C.Request") -> None:
        self._request = request

    def wait(self, timeout: Optional[float], what: str) -> list[torch.Tensor]:
        """Block (GIL released) up to ``timeout`` seconds; returns received tensors, [] for sends."""
        return self._request.wait(_ms(timeout), what)

    def is_completed(self) -> bool:
        """True once done. Gloo only marks sends/receives done inside ``wait``, so this
        stays False until then there; NCCL and in-process requests report progress."""
        return self._request.is_completed()


class DistChannel:
    """Point-to-point messages over a torch.distributed group (Gloo on CPU, NCCL on GPU); stateless.

    ``group`` defaults to the default (WORLD) group; peers are ranks *in that
    group*. ``device`` is where receive buffers live (``"cuda:i"`` with NCCL).
    ``num_stages`` only makes error messages name stage and microbatch.
    """

    #: the executor must go through a communication plan (layouts) with this channel
    needs_layouts = True
    #: the transport asked for (``PipelineSchedule(transport=)``): the process group itself
    requested = "gloo"
    #: a message of one tensor is packed too (into the plan's reused buffer when given)
    packs_single = True

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

    @property
    def rank(self) -> int:
        return self._pg.rank

    @property
    def device(self) -> torch.device:
        return self._pg.device

    def begin_step(self, step: int) -> None:
        """Step ``step`` (the group's number, ``GroupSteps``) starts its messages on this rank.

        Nothing to do over a process group: Gloo delivers a send only into a
        receive posted with its tag, and a send nobody receives fails on its
        sender; NCCL matches by order. Shared memory drops earlier steps'
        leftovers here (``ShmChannel``).
        """

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

        NCCL pipelines route each direction over a group of its own (``runtime/groups.py``).
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


class LocalChannel:
    """One rank's end of a ``LocalHub``: in-process, matched by (peer, tag)."""

    def __init__(self, hub: "LocalHub", rank: int) -> None:
        self.hub = hub
        self.rank = rank
        self._channel = _C.LocalChannel(hub._hub, rank)

    def send(self, tensors: Sequence[torch.Tensor], peer: int, tag: int, owned: bool = False) -> ChannelHandle:
        """Hand tensors (detached; copies on the same device unless ``owned``) to ``peer``; blocks only
        while the hub's bound is full."""
        return ChannelHandle(self._channel.send(list(tensors), peer, tag, owned))

    def recv(self, peer: int, tag: int) -> ChannelHandle:
        """A handle whose ``wait`` blocks (GIL released) until ``peer``'s message arrives."""
        return ChannelHandle(self._channel.recv(peer, tag))


class LocalHub:
    """Mailboxes between the worker threads of one process, one device per rank.

    ``capacity`` bounds the messages waiting from one rank to another (a sender
    beyond it waits up to ``send_timeout`` seconds). ``close(reason)`` makes
    every wait fail with ``reason``: call it when a worker thread fails so the
    others stop at once instead of waiting out their timeouts.
    ``copy_streams=False`` queues copies between devices on the compute
    streams instead of the copy streams: only the overlap benchmark's baseline.
    """

    def __init__(self, devices: Sequence[Device], capacity: int = 4096, send_timeout: Optional[float] = 300.0,
                 copy_streams: bool = True) -> None:
        self.devices = [torch.device(d) for d in devices]
        self._hub = _C.LocalHub(self.devices, capacity, _ms(send_timeout), copy_streams)

    @property
    def size(self) -> int:
        return self._hub.size

    def channel(self, rank: int) -> LocalChannel:
        return LocalChannel(self, rank)

    def close(self, reason: str) -> None:
        self._hub.close(reason)

    @property
    def closed(self) -> bool:
        return self._hub.closed

    def pending(self) -> int:
        """Messages sent and not yet received (non-zero after a step means a leak)."""
        return self._hub.pending()
