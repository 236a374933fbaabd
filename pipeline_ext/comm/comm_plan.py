"""Communication plans: the layout of every message one rank moves in a step, learnt once, then reused.

[Note: known and discovery steps]
A receiver can only post a buffer of a size it knows, and Gloo aborts the
receiving process when a message is larger than the posted buffer. So a step
with a microbatch whose layouts this rank has not seen is a **discovery** step:
every message is preceded by its layout (a fixed-size int64 message under
``tag | LAYOUT_TAG_BIT``), and both ends record it. Once that step has
completed on this rank, its layouts are kept per *microbatch signature* (the
microbatch's input shapes, dtypes and plain values: ``StepAgreement``); a later
step whose every microbatch has a known signature is a **known** step, in any
order and mix of microbatches: receives are preallocated from the cache at
once, and a sender whose tensors no longer match fails by name before anything
is sent. The step agreement carries every microbatch's signature to every
rank, so a rank without stage 0 knows each message's layout before it arrives.

Who owns what: the session holds one :class:`PlanCache` per step kind
(training and forward-only steps never share layouts); the channel
(``DistChannel``) keeps no state and only moves bytes; :class:`StepMessages` is
one step's view of the two, and what the executor sends and receives through.

[Note: discovery order]
Ordering rule of discovery: receives from one peer post their messages
strictly in the order layout_1, data_1, layout_2, data_2, ... (the order the
sender sends them), because backends that ignore tags (NCCL) match messages by
order alone. So only the oldest unresolved receive per peer has its layout
posted, and a step is known or discovery as a whole (a known receive posted
behind an unresolved one would be matched to its layout). Skip messages
(``pipeline_ext.skip``, Gloo only) keep their own queue per peer: they are
received when needed, not in the schedule's receive order, and must not wait
behind an activation's layout.
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from typing import Callable, ContextManager, Hashable, Optional, Sequence, Union

import torch

from pipeline_ext.runtime._ext import _C
from pipeline_ext.comm.transport.channels import DistChannel
from pipeline_ext.runtime.channel import ChannelError, ChannelHandle, ChannelTimeout, _ms
from pipeline_ext.comm.identity import stable_hash
from pipeline_ext.runtime.tags import SKIP_LANE, describe_tag, message_of, split_microbatch

__all__ = ["PlanCache", "StepMessages", "DEFAULT_MAX_SIGNATURES"]

#: Microbatch signatures whose layouts are kept per step kind (least recently used goes first). Each holds
#: one small layout per message this rank moves for a microbatch.
DEFAULT_MAX_SIGNATURES = 256

Layouts = dict  # (direction, peer, message without its microbatch) -> _C.PackLayout


class PlanCache:
    """The layouts of one step kind, keyed by microbatch signature, least recently used evicted first.

    ``digest`` is equal on two ranks when their caches hold the same
    signatures: the step agreement compares it, and every rank rediscovers when
    they differ (a step that failed on one rank after the other had committed
    its layouts). Every rank commits the same signatures in the same order, so
    evictions agree too.

    [Note: reused send buffers]
    ``send_buffers``: one reused pack buffer per message (``DistChannel.packs_single``:
    shared memory copies a single contiguous tensor into its ring directly),
    grown to the largest layout it carried. A buffer is reused only after the
    previous step's send of it completed (the executor waits for every send
    before a step ends); a failed step drops them all (``abandon``).
    """

    def __init__(self, max_signatures: int = DEFAULT_MAX_SIGNATURES) -> None:
        if max_signatures < 1:
            raise ValueError(f"max_signatures must be at least 1, got {max_signatures}")
        self.max_signatures = max_signatures
        self._known: OrderedDict[Hashable, Layouts] = OrderedDict()
        self.send_buffers: dict[tuple, torch.Tensor] = {}
        self._digest = 0

    def __len__(self) -> int:
        return len(self._known)

    def __contains__(self, signature: Hashable) -> bool:
        return signature in self._known

    @property
    def digest(self) -> int:
        return self._digest

    @property
    def cached_layouts(self) -> int:
        """How many message layouts are kept, over every microbatch signature."""
        return sum(len(layouts) for layouts in self._known.values())

    def step(self, channel: DistChannel, microbatches: Optional[Sequence[Hashable]],
             rediscover: bool = False, explain: Optional[Callable[[Hashable], str]] = None) -> "StepMessages":
        """One step's messages: known when every microbatch's signature is cached (and not ``rediscover``).

        ``microbatches``: each microbatch's signature, in microbatch order.
        None makes a discovery step that is never committed: every message
        carries its layout (correct, one extra small message each).
        ``explain``: what a signature's arguments are, said when a send does
        not match its cached layout (``StepAgreement.counted_by_value``).
        """
        known = (microbatches is not None and not rediscover
                 and all(sig in self._known for sig in microbatches))
        if known:
            for sig in dict.fromkeys(microbatches):
                self._known.move_to_end(sig)
        return StepMessages(channel, self, microbatches, known, explain)

    def layout(self, signature: Hashable, part: tuple) -> Optional["_C.PackLayout"]:
        return self._known[signature].get(part)

    def send_buffer(self, key: tuple, nbytes: int, device: torch.device) -> torch.Tensor:
        """The reused pack buffer of message ``key``, ``nbytes`` long (grown when a larger layout needs it)."""
        out = self.send_buffers.get(key)
        if out is None or out.numel() < nbytes or out.device != device:
            out = self.send_buffers[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return out if out.numel() == nbytes else out[:nbytes]

    def commit(self, messages: "StepMessages") -> None:
        """After a step completed on this rank: keep the layouts a discovery step learnt, per microbatch signature."""
        microbatches = messages.microbatches
        if messages.known or microbatches is None:
            return
        num_stages = messages.channel.num_stages
        learnt: dict[Hashable, Layouts] = {sig: {} for sig in microbatches}
        for (direction, peer, message), layout in messages.layouts.items():
            mb, part = split_microbatch(message, num_stages)
            learnt[microbatches[mb]][(direction, peer, part)] = layout
        for sig, layouts in learnt.items():
            if sig not in self._known:
                self._digest ^= stable_hash(repr(sig))
            self._known[sig] = layouts
            self._known.move_to_end(sig)
        while len(self._known) > self.max_signatures:
            old, _ = self._known.popitem(last=False)
            self._digest ^= stable_hash(repr(old))

    def abandon(self, messages: "StepMessages") -> None:
        """After a step failed on this rank: a send may still be reading one of the reused buffers."""
        self.send_buffers.clear()


class _DiscoveryRecv:
    """A receive in a discovery step: the layout message first, then the data (see the module doc)."""

    def __init__(self, owner: StepMessages, peer: int, tag: int, key: tuple) -> None:
        self.owner, self.peer, self.tag, self.key = owner, peer, tag, key
        self.layout_request: Optional[ChannelHandle] = None
        self.data_request: Optional[ChannelHandle] = None

    def post_layout(self) -> None:
        self.layout_request = self.owner.channel.recv_layout(self.peer, self.tag)

    def wait(self, timeout: Optional[float], what: str) -> list[torch.Tensor]:
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self.owner._resolve(self, deadline, what)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return self.data_request.wait(left, what)
        except ChannelTimeout:  # report the caller's whole timeout, not the last slice of it
            raise ChannelTimeout(f"{what}: timed out after {_ms(timeout)} ms") from None

    def is_completed(self) -> bool:
        return self.data_request is not None and self.data_request.is_completed()


class StepMessages:
    """The sends and receives of one step, through a stateless channel, following or learning layouts.

    It is the executor's channel for the step (``send(tensors, peer, tag)``,
    ``recv(peer, tag)``); commit it to its cache when the step completes.
    """

    def __init__(self, channel: DistChannel, cache: PlanCache, microbatches: Optional[Sequence[Hashable]],
                 known: bool, explain: Optional[Callable[[Hashable], str]] = None) -> None:
        self.channel, self.cache, self.known, self._explain = channel, cache, known, explain
        self.microbatches = None if microbatches is None else list(microbatches)
        #: what a discovery step learnt: (direction, peer, message) -> layout
        self.layouts: dict[tuple, "_C.PackLayout"] = {}
        self._unresolved: dict[tuple[int, int], deque[_DiscoveryRecv]] = {}  # by (peer, lane)

    @staticmethod
    def _key(direction: str, peer: int, tag: int) -> tuple:
        # The same message in every step has the same layout when its microbatch does, whatever the step bits.
        return (direction, peer, message_of(tag))

    def _layout(self, key: tuple) -> "_C.PackLayout":
        direction, peer, message = key
        num_stages = self.channel.num_stages
        mb, part = split_microbatch(message, num_stages)
        layout = self.cache.layout(self.microbatches[mb], (direction, peer, part))
        if layout is None:
            raise ChannelError(
                f"rank {self.channel.rank}: no layout was exchanged for {direction} with rank {peer}, "
                f"{describe_tag(message, num_stages)}, under microbatch signature {self.microbatches[mb]}: "
                "a known step must exchange the same messages as the discovery step of its microbatches"
            )
        return layout

    def send(self, tensors: Sequence[torch.Tensor], peer: int, tag: int, owned: bool = False) -> ChannelHandle:
        key = self._key("send", peer, tag)
        if not self.known:
            handle, layout = self.channel.send(tensors, peer, tag, with_layout=True, owned=owned)
            self.layouts[key] = layout
            return handle
        layout = self._layout(key)
        out = None
        if len(tensors) > 1 or (tensors and self.channel.packs_single(peer)):
            out = self.cache.send_buffer(key, layout.nbytes, tensors[0].device)
        try:
            return self.channel.send(tensors, peer, tag, expected=layout, out=out, owned=owned)[0]
        except ChannelError as exc:
            said = self._explain(self._signature(key)) if self._explain is not None else ""
            if not said:
                raise
            raise ChannelError(f"{exc}. {said}") from None

    def _signature(self, key: tuple) -> Hashable:
        mb, _ = split_microbatch(key[2], self.channel.num_stages)
        return self.microbatches[mb]

    def batch(self) -> ContextManager[None]:
        """The channel's batch (``DistChannel.batch``)."""
        return self.channel.batch()

    def recv(self, peer: int, tag: int) -> Union[ChannelHandle, _DiscoveryRecv]:
        """Post a receive now; its data is waited on (and unpacked) by ``handle.wait``."""
        key = self._key("recv", peer, tag)
        if self.known:
            return self.channel.recv(self._layout(key), peer, tag)
        handle = _DiscoveryRecv(self, peer, tag, key)
        queue = self._unresolved.setdefault((peer, tag & SKIP_LANE), deque())
        queue.append(handle)
        if len(queue) == 1:
            handle.post_layout()
        return handle

    def _resolve(self, handle: _DiscoveryRecv, deadline: Optional[float], what: str) -> None:
        """Receive layouts from handle's peer, oldest first, until handle's data is posted."""
        queue = self._unresolved.get((handle.peer, handle.tag & SKIP_LANE), deque())
        num_stages = self.channel.num_stages
        while handle.data_request is None:
            head = queue[0]
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            suffix = "" if head is handle else f" (layout of the earlier {describe_tag(head.tag, num_stages)})"
            words = head.layout_request.wait(left, what + suffix)[0]
            layout = _C.PackLayout.from_tensor(words)
            head.data_request = self.channel.recv(layout, head.peer, head.tag)
            self.layouts[head.key] = layout
            queue.popleft()
            if queue:
                queue[0].post_layout()
