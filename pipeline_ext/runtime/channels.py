"""Channels: the executor's way to move tensors between ranks.

The executor only knows the ``Channel``/``Handle`` protocols (``send`` and
``recv`` returning handles with ``wait(timeout, what)`` and ``is_completed()``);
this module gives it two implementations over the C++ runtime:

- ``DistChannel`` over a torch.distributed ProcessGroup (one process per rank).
  A message is ONE packed buffer whatever the number of tensors, received into
  a buffer preallocated from its layout. Layouts (dtypes, shapes) are exchanged
  once per *step signature* and cached, because a receiver can only preallocate
  what it knows; a shape change under a known signature is an error on the
  sender, never a silent misread on the receiver (Gloo aborts the receiving
  process when a message is larger than the posted buffer).
- ``LocalChannel`` over a ``LocalHub`` (one thread per rank, one process):
  tensors are handed over; across CUDA devices the copy runs on copy streams.

Every wait releases the GIL and raises ``ChannelTimeout`` (a ``TimeoutError``)
naming what it waited for, or ``ChannelError`` when a peer failed.
"""
from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict, deque
from typing import Hashable, Optional, Sequence, Union

import torch

from pipeline_ext._ext import _C
from pipeline_ext.runtime.tags import describe_tag, message_of

__all__ = [
    "ChannelError",
    "ChannelTimeout",
    "ChannelHandle",
    "DistChannel",
    "LocalHub",
    "LocalChannel",
    "describe_tag",
    "stable_hash",
]

ChannelError = _C.ChannelError
ChannelTimeout = _C.ChannelTimeout
Device = Union[str, torch.device]


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


def stable_hash(text: str) -> int:
    """62 bits of blake2b over ``text``: the same in every process (unlike ``hash``), fits an int64 word."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


class _DiscoveryRecv:
    """A receive in a discovery step: the layout message first, then the data.

    Receives from one peer post their messages strictly in the order
    layout_1, data_1, layout_2, data_2, ... (the order the sender sends them),
    because backends that ignore tags (NCCL) match messages by order alone.
    So only the oldest unresolved receive per peer has its layout posted.
    """

    def __init__(self, owner: "DistChannel", peer: int, tag: int, key: tuple) -> None:
        self.owner, self.peer, self.tag, self.key = owner, peer, tag, key
        self.layout_request: Optional[_C.Request] = None
        self.data_request: Optional[_C.Request] = None

    def post_layout(self) -> None:
        self.layout_request = self.owner._pg.recv_layout(self.peer, self.tag)

    def wait(self, timeout: Optional[float], what: str) -> list[torch.Tensor]:
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self.owner._resolve(self, deadline, what)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return self.data_request.wait(_ms(left), what)
        except ChannelTimeout:  # report the caller's whole timeout, not the last slice of it
            raise ChannelTimeout(f"{what}: timed out after {_ms(timeout)} ms") from None

    def is_completed(self) -> bool:
        return self.data_request is not None and self.data_request.is_completed()


class DistChannel:
    """Point-to-point channel over a torch.distributed group (Gloo on CPU, NCCL on GPU).

    ``group`` defaults to the default (WORLD) group; peers are ranks *in that
    group*. ``device`` is where receive buffers live (``"cuda:i"`` with NCCL).
    ``num_stages`` only makes error messages name stage and microbatch.

    Call ``begin_step(signature)`` before a step and ``end_step()`` after it.
    The signature (any hashable) must be the same on every rank for the same
    step shape and the same plan (e.g. derived from batch size, microbatch
    count and training vs forward-only); without ``begin_step`` every message
    carries its layout (correct, one extra small message each). The layouts of
    the ``max_signatures`` (default 64) most recently used signatures are kept.
    """

    def __init__(self, group: Optional["torch.distributed.ProcessGroup"] = None, device: Device = "cpu",
                 num_stages: Optional[int] = None, max_signatures: int = 64) -> None:
        import torch.distributed as dist

        if group is None:
            if not dist.is_initialized():
                raise RuntimeError("DistChannel: torch.distributed is not initialised (call init_process_group)")
            group = dist.group.WORLD
        self._pg = _C.ProcessGroupChannel(group, torch.device(device))
        self.num_stages = num_stages
        if max_signatures < 1:
            raise ValueError(f"max_signatures must be at least 1, got {max_signatures}")
        # signature -> {(direction, peer, tag): layout}, least recently used first
        self._cache: OrderedDict[Hashable, dict[tuple, "_C.PackLayout"]] = OrderedDict()
        self.max_signatures = max_signatures
        self._seen: dict[tuple, "_C.PackLayout"] = {}  # layouts of the current discovery step
        self._signature: Optional[Hashable] = None
        self._discovery = True
        self._unresolved: dict[int, deque[_DiscoveryRecv]] = {}
        self._digest = 0

    @property
    def rank(self) -> int:
        return self._pg.rank

    @property
    def device(self) -> torch.device:
        return self._pg.device

    # -- steps -----------------------------------------------------------------------------
    @property
    def known_digest(self) -> int:
        """A digest of the signatures whose layouts are cached: equal on two ranks when their caches are."""
        return self._digest

    def begin_step(self, signature: Hashable, force_discovery: bool = False) -> bool:
        """Start a step; returns True if it is a discovery step (signature never completed, or forced)."""
        self._signature = signature
        self._discovery = force_discovery or signature not in self._cache
        if signature in self._cache:
            self._cache.move_to_end(signature)
        self._seen = {}
        self._unresolved = {}  # receives a failed step never waited on must not block this one
        return self._discovery

    def end_step(self) -> None:
        """Commit the layouts a discovery step saw, so later steps preallocate from them.

        At most ``max_signatures`` signatures are kept (least recently used
        goes first). Ranks that evict differently still agree on every step:
        the step agreement compares ``known_digest`` and makes every rank
        rediscover when the caches differ.
        """
        if self._signature is not None and self._discovery:
            if self._signature not in self._cache:
                self._digest ^= stable_hash(repr(self._signature))
            self._cache[self._signature] = self._seen
            self._cache.move_to_end(self._signature)
            while len(self._cache) > self.max_signatures:
                old, _ = self._cache.popitem(last=False)
                self._digest ^= stable_hash(repr(old))
        self._seen = {}
        self._signature = None
        self._discovery = True

    # -- messages --------------------------------------------------------------------------
    @property
    def cached_layouts(self) -> int:
        """How many message layouts are cached, over every kept signature."""
        return sum(len(layouts) for layouts in self._cache.values())

    def _key(self, direction: str, peer: int, tag: int) -> tuple:
        # The same message in every step of a signature has the same layout, whatever the step bits.
        return (direction, peer, message_of(tag))

    def _cached(self, key: tuple) -> "_C.PackLayout":
        try:
            return self._cache[self._signature][key]
        except KeyError:
            raise ChannelError(
                f"rank {self.rank}: no layout was exchanged for {key[0]} with rank {key[1]}, "
                f"{describe_tag(key[2], self.num_stages)}, under step signature {self._signature}: a known step "
                "must exchange the same messages as its discovery step"
            ) from None

    def send(self, tensors: Sequence[torch.Tensor], peer: int, tag: int) -> ChannelHandle:
        """Pack and send at once; the handle keeps the buffer alive until the send completes."""
        key = self._key("send", peer, tag)
        expected = None if self._discovery else self._cached(key)
        try:
            request, layout = self._pg.send(list(tensors), peer, tag, expected, self._discovery)
        except ChannelError as exc:
            raise ChannelError(
                f"rank {self.rank}: {describe_tag(tag, self.num_stages)} to rank {peer}: {exc}"
            ) from None
        if self._discovery:
            self._seen[key] = layout
        return ChannelHandle(request)

    def recv(self, peer: int, tag: int) -> Union[ChannelHandle, _DiscoveryRecv]:
        """Post a receive now; its data is waited on (and unpacked) by ``handle.wait``."""
        key = self._key("recv", peer, tag)
        if not self._discovery:
            return ChannelHandle(self._pg.recv(self._cached(key), peer, tag))
        handle = _DiscoveryRecv(self, peer, tag, key)
        queue = self._unresolved.setdefault(peer, deque())
        queue.append(handle)
        if len(queue) == 1:
            handle.post_layout()
        return handle

    def _resolve(self, handle: _DiscoveryRecv, deadline: Optional[float], what: str) -> None:
        """Receive layouts from handle's peer, oldest first, until handle's data is posted."""
        queue = self._unresolved.get(handle.peer, deque())
        while handle.data_request is None:
            head = queue[0]
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            suffix = "" if head is handle else f" (layout of the earlier {describe_tag(head.tag, self.num_stages)})"
            words = head.layout_request.wait(_ms(left), what + suffix)[0]
            layout = _C.PackLayout.from_tensor(words)
            head.data_request = self._pg.recv(layout, head.peer, head.tag)
            self._seen[head.key] = layout
            queue.popleft()
            if queue:
                queue[0].post_layout()


class LocalChannel:
    """One rank's end of a ``LocalHub``: in-process, matched by (peer, tag)."""

    def __init__(self, hub: "LocalHub", rank: int) -> None:
        self.hub = hub
        self.rank = rank
        self._channel = _C.LocalChannel(hub._hub, rank)

    def begin_step(self, signature: Hashable) -> bool:
        """Nothing to discover in process (tensors travel as they are); always False."""
        return False

    def end_step(self) -> None:
        """Nothing to commit in process."""

    def send(self, tensors: Sequence[torch.Tensor], peer: int, tag: int) -> ChannelHandle:
        """Hand tensors (detached) to ``peer``; blocks only while the hub's bound is full."""
        return ChannelHandle(self._channel.send(list(tensors), peer, tag))

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
