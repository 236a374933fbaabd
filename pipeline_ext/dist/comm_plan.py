"""Communication plans: the layout of every message one rank moves in a step, learnt once, then reused.

A receiver can only post a buffer of a size it knows, and Gloo aborts the
receiving process when a message is larger than the posted buffer. So the first
step of a new *step signature* is a **discovery** step: every message is
preceded by its layout (a fixed-size int64 message under ``tag |
LAYOUT_TAG_BIT``), and both ends record it. Once that step has completed on
this rank, its layouts form the signature's :class:`CommPlan`; later steps with
that signature are **known** steps: receives are preallocated from the plan at
once, and a sender whose tensors no longer match the plan fails by name before
anything is sent.

Who owns what: each executor (one lowered schedule, so training and
forward-only steps never share plans) owns a :class:`PlanCache`; the channel
(``DistChannel``) keeps no state and only moves bytes; :class:`StepMessages` is
one step's view of the two, and what the executor sends and receives through.

Ordering rule of discovery: receives from one peer post their messages
strictly in the order layout_1, data_1, layout_2, data_2, ... (the order the
sender sends them), because backends that ignore tags (NCCL) match messages by
order alone. So only the oldest unresolved receive per peer has its layout
posted. Skip messages (``pipeline_ext.skip``, Gloo only) keep their own queue
per peer: they are received when needed, not in the schedule's receive order,
and must not wait behind an activation's layout.
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from typing import ContextManager, Hashable, Optional, Sequence, Union

import torch

from pipeline_ext.runtime._ext import _C
from pipeline_ext.dist.channels import DistChannel
from pipeline_ext.runtime.channel import ChannelError, ChannelHandle, ChannelTimeout, _ms
from pipeline_ext.dist.identity import stable_hash
from pipeline_ext.runtime.tags import SKIP_LANE, describe_tag, message_of

__all__ = ["CommPlan", "PlanCache", "StepMessages", "DEFAULT_MAX_PLANS"]

#: Plans kept per executor (least recently used goes first). A plan holds one
#: small layout per message, plus one reused send buffer per packed message.
DEFAULT_MAX_PLANS = 64


class CommPlan:
    """Every message of one step signature on this rank: ``(direction, peer, message) -> layout``.

    ``send_buffers`` are the reused pack buffers of the messages the channel
    packs (``DistChannel.packs_single``: on shared memory a single contiguous
    tensor is copied into the ring directly). A buffer is reused only
    after the previous step's send of it completed (the executor waits for
    every send before a step ends); a failed step drops them (see ``drop_buffers``).
    """

    __slots__ = ("signature", "layouts", "send_buffers")

    def __init__(self, signature: Hashable) -> None:
        self.signature = signature
        self.layouts: dict[tuple, "_C.PackLayout"] = {}
        self.send_buffers: dict[tuple, torch.Tensor] = {}

    def drop_buffers(self) -> None:
        """Forget the send buffers: after a failed step a send may still be reading one."""
        self.send_buffers.clear()


class PlanCache:
    """The plans of one executor, keyed by step signature, least recently used evicted first.

    ``digest`` is equal on two ranks when their caches hold the same signatures:
    the step agreement compares it, and every rank rediscovers when they differ
    (a step that failed on one rank after the other had committed its layouts,
    or different evictions).
    """

    def __init__(self, max_plans: int = DEFAULT_MAX_PLANS) -> None:
        if max_plans < 1:
            raise ValueError(f"max_plans must be at least 1, got {max_plans}")
        self.max_plans = max_plans
        self._plans: OrderedDict[Hashable, CommPlan] = OrderedDict()
        self._digest = 0

    def __len__(self) -> int:
        return len(self._plans)

    def __contains__(self, signature: Hashable) -> bool:
        return signature in self._plans

    @property
    def digest(self) -> int:
        return self._digest

    @property
    def cached_layouts(self) -> int:
        """How many message layouts are kept, over every plan."""
        return sum(len(p.layouts) for p in self._plans.values())

    def step(self, channel: DistChannel, signature: Optional[Hashable], rediscover: bool = False) -> StepMessages:
        """One step's messages: known when ``signature`` has a plan (and not ``rediscover``), else discovery.

        ``signature=None`` makes a discovery step that is never committed: every
        message carries its layout (correct, one extra small message each).
        """
        plan = None if (rediscover or signature is None) else self._plans.get(signature)
        if plan is not None:
            self._plans.move_to_end(signature)
        return StepMessages(channel, plan if plan is not None else CommPlan(signature), known=plan is not None)

    def commit(self, messages: StepMessages) -> None:
        """After a step completed on this rank: keep the layouts a discovery step learnt."""
        plan = messages.plan
        if messages.known or plan.signature is None:
            return
        if plan.signature not in self._plans:
            self._digest ^= stable_hash(repr(plan.signature))
        self._plans[plan.signature] = plan
        self._plans.move_to_end(plan.signature)
        while len(self._plans) > self.max_plans:
            old, _ = self._plans.popitem(last=False)
            self._digest ^= stable_hash(repr(old))

    def abandon(self, messages: StepMessages) -> None:
        """After a step failed on this rank: its plan's send buffers may still be in flight."""
        messages.plan.drop_buffers()


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
    """The sends and receives of one step, through a stateless channel, following or learning a plan.

    It is the executor's channel for the step (``send(tensors, peer, tag)``,
    ``recv(peer, tag)``); commit it to the cache when the step completes.
    """

    def __init__(self, channel: DistChannel, plan: CommPlan, known: bool) -> None:
        self.channel, self.plan, self.known = channel, plan, known
        self._unresolved: dict[tuple[int, int], deque[_DiscoveryRecv]] = {}  # by (peer, lane)

    @staticmethod
    def _key(direction: str, peer: int, tag: int) -> tuple:
        # The same message in every step of a signature has the same layout, whatever the step bits.
        return (direction, peer, message_of(tag))

    def _layout(self, key: tuple) -> "_C.PackLayout":
        try:
            return self.plan.layouts[key]
        except KeyError:
            raise ChannelError(
                f"rank {self.channel.rank}: no layout was exchanged for {key[0]} with rank {key[1]}, "
                f"{describe_tag(key[2], self.channel.num_stages)}, under step signature {self.plan.signature}: "
                "a known step must exchange the same messages as its discovery step"
            ) from None

    def send(self, tensors: Sequence[torch.Tensor], peer: int, tag: int, owned: bool = False) -> ChannelHandle:
        key = self._key("send", peer, tag)
        if not self.known:
            handle, layout = self.channel.send(tensors, peer, tag, with_layout=True, owned=owned)
            self.plan.layouts[key] = layout
            return handle
        layout = self._layout(key)
        out = None
        if len(tensors) > 1 or (tensors and self.channel.packs_single):
            out = self.plan.send_buffers.get(key)
            if out is None:
                out = torch.empty(layout.nbytes, dtype=torch.uint8, device=tensors[0].device)
                self.plan.send_buffers[key] = out
        return self.channel.send(tensors, peer, tag, expected=layout, out=out, owned=owned)[0]

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
            self.plan.layouts[head.key] = layout
            queue.popleft()
            if queue:
                queue[0].post_layout()
