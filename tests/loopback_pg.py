"""A pretend two-rank process group for testing the multi-process channel inside one process.

``Loopback`` is rank 0 of a group whose peer sends back whatever it receives,
under the same tag. Its works are complete at once and record the timeout
each ``wait`` was given, so a test can see how the channel waits: with a
timeout on host-side backends (Gloo), without one (device-side) on CUDA, where
NCCL would otherwise spin the host until the GPU finished.
"""
from __future__ import annotations

import datetime

import torch.distributed as dist

__all__ = ["Loopback"]


class _Work(dist._Work):
    def __init__(self, waits: list) -> None:
        super().__init__()
        self.waits = waits

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        self.waits.append(timeout)
        return True

    def is_completed(self) -> bool:
        return True


class Loopback(dist.ProcessGroup):
    """Copies run on the current stream (as NCCL's stream is fenced with it): nothing here
    touches the host, so any synchronisation a test sees is the channel's."""

    def __init__(self) -> None:
        super().__init__(0, 2)
        self.wire: dict[int, list] = {}
        #: the timeout of every Work.wait, in order (timedelta(0) is c10d's "no timeout")
        self.waits: list[datetime.timedelta] = []
        #: every tensor given to send, as given (a test can see whether the channel copied it)
        self.sent: list = []

    def getBackendName(self) -> str:
        return "loopback"

    def send(self, tensors, dst, tag):
        self.sent.append(tensors[0])
        self.wire.setdefault(tag, []).append(tensors[0].clone())
        return _Work(self.waits)

    def recv(self, tensors, src, tag):
        tensors[0].copy_(self.wire[tag].pop(0))
        return _Work(self.waits)
