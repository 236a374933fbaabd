"""In-process channels: the worker threads of one process (``Pipe``), one device per rank.

Tensors are handed over, not copied, except on the same device when the sender
could still write them (``owned=False``); across CUDA devices the copy runs on
copy streams. ``LocalStep`` is one step's view of a rank's ``LocalChannel``:
what the executor runs over in one process.
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Optional, Sequence, Union

import torch

from pipeline_ext.runtime._ext import _C
from pipeline_ext.runtime.channel import ChannelHandle, _ms
from pipeline_ext.runtime.ops import explain_unmovable, raise_named
from pipeline_ext.runtime.tags import describe_tag

__all__ = ["LocalHub", "LocalChannel", "LocalStep"]

Device = Union[str, torch.device]


class LocalChannel:
    """One rank's end of a ``LocalHub``: in-process, matched by (peer, tag)."""

    def __init__(self, hub: "LocalHub", rank: int) -> None:
        self.hub = hub
        self.rank = rank
        self._channel = _C.LocalChannel(hub._hub, rank)

    def send(self, tensors: Sequence[torch.Tensor], peer: int, tag: int, owned: bool = False) -> ChannelHandle:
        """Hand tensors (detached; copies on the same device unless ``owned``) to ``peer``; blocks only
        while the hub's bound is full."""
        try:
            return ChannelHandle(self._channel.send(list(tensors), peer, tag, owned))
        except TypeError as exc:  # the core refuses what it cannot read (check_readable): name it
            raise_named(exc, explain_unmovable(f"rank {self.rank}: {describe_tag(tag, self.hub.num_stages)} to "
                                               f"rank {peer}", tensors))

    def recv(self, peer: int, tag: int) -> ChannelHandle:
        """A handle whose ``wait`` blocks (GIL released) until ``peer``'s message arrives."""
        return ChannelHandle(self._channel.recv(peer, tag))


class LocalHub:
    """Mailboxes between the worker threads of one process, one device per rank.

    ``capacity`` bounds the messages waiting from one rank to another (a sender
    beyond it waits up to ``send_timeout`` seconds). ``close(reason)`` makes
    every wait fail with ``reason``: call it when a worker thread fails so the
    others stop at once instead of waiting out their timeouts.
    ``num_stages`` only makes error messages name stage and microbatch.
    ``copy_streams=False`` queues copies between devices on the compute
    streams instead of the copy streams: only the overlap benchmark's baseline.
    """

    def __init__(self, devices: Sequence[Device], capacity: int = 4096, send_timeout: Optional[float] = 300.0,
                 copy_streams: bool = True, num_stages: Optional[int] = None) -> None:
        self.devices = [torch.device(d) for d in devices]
        self.num_stages = num_stages  # only makes error messages name stage and microbatch
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


class LocalStep:
    """One step on a ``LocalChannel``: the in-process twin of ``comm.session.Step`` (everything known up front).

    There is nothing to agree on between threads of one process: the step
    number is 0, and the skip routes and loss weights are given.
    """

    number = 0

    def __init__(self, channel: LocalChannel, skip_routes: Any = None,
                 loss_weights: Sequence[Union[float, torch.Tensor]] = ()) -> None:
        self._channel = channel
        self._routes = skip_routes if skip_routes else None
        self._weights = list(loss_weights)
        self.skip_stages = frozenset() if self._routes is None else frozenset(self._routes.moving_stages())

    def open(self) -> "LocalStep":
        """Nothing to settle between threads: the step sends and receives through itself."""
        return self

    def send(self, tensors: Sequence[torch.Tensor], peer: int, tag: int, owned: bool = False) -> ChannelHandle:
        return self._channel.send(tensors, peer, tag, owned)

    def recv(self, peer: int, tag: int) -> ChannelHandle:
        return self._channel.recv(peer, tag)

    def batch(self) -> ContextManager[None]:
        batch = getattr(self._channel, "batch", None)  # in-process channels issue at once: no batches
        return batch() if batch is not None else contextlib.nullcontext()

    def skip_routes(self) -> Any:
        return self._routes

    def loss_weights(self) -> Sequence[Union[float, torch.Tensor]]:
        return self._weights
