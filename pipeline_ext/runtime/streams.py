"""Streams and events without device branches.

Per device there is one compute stream (the current one) and one copy stream
per direction, so copies between stages never queue behind compute. On CPU
every call here is a no-op and every event is already complete: the Pipe and
the executor call the same functions whatever the device.
"""
from __future__ import annotations

from typing import Union

import torch

from pipeline_ext.runtime._ext import _C

__all__ = ["Stream", "Event", "current_stream", "copy_stream", "use_stream", "record_stream"]

Stream = _C.Stream
Event = _C.Event
Device = Union[str, torch.device]


def current_stream(device: Device) -> "_C.Stream":
    """The stream work on ``device`` is issued to by this thread (its compute stream)."""
    return _C.Stream.current(torch.device(device))


def copy_stream(device: Device, direction: str = "to_device") -> "_C.Stream":
    """The dedicated copy stream of ``device`` for ``"to_device"`` or ``"from_device"``."""
    return _C.Stream.copy(torch.device(device), direction)


def use_stream(stream: "_C.Stream") -> "_C.StreamContext":
    """``with use_stream(s):`` makes ``s`` current on its device for the block."""
    return stream.use()


def record_stream(tensor: torch.Tensor, stream: "_C.Stream") -> None:
    """Keep the caching allocator from reusing ``tensor``'s memory before ``stream`` is done with it."""
    _C.record_stream(tensor, stream)
