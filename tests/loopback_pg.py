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
    """Done at once on the host; on CUDA, ``wait`` makes the current stream wait for the stream the
    operation ran on (as NCCL's does), so a consumer on another stream reads the copy only after it."""

    def __init__(self, waits: list, tensor) -> None:
        super().__init__()
        self.waits = waits
        self.event = None
        if tensor.is_cuda:
            import torch

            self.event = torch.cuda.Event()
            self.event.record()  # on the stream current when the operation was issued

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        self.waits.append(timeout)
        if self.event is not None:
            import torch

            torch.cuda.current_stream().wait_event(self.event)
        return True

    def is_completed(self) -> bool:
        return True


class Loopback(dist.ProcessGroup):
    """Copies run on the current stream (as NCCL's stream is fenced with it): nothing here
    touches the host, so any synchronisation a test sees is the channel's. ``streams`` records
    the stream each send or receive was issued on (CUDA only)."""

    def __init__(self) -> None:
        super().__init__(0, 2)
        self.wire: dict[int, list] = {}
        #: the timeout of every Work.wait, in order (timedelta(0) is c10d's "no timeout")
        self.waits: list[datetime.timedelta] = []
        #: every tensor given to send, as given (a test can see whether the channel copied it)
        self.sent: list = []
        self.streams: list = []
        self._cloned: dict = {}  # (tag, index on the wire) -> event after the clone (CUDA)

    def getBackendName(self) -> str:
        return "loopback"

    def _note_stream(self, tensor) -> None:
        if tensor.is_cuda:
            import torch

            self.streams.append(torch.cuda.current_stream())

    def send(self, tensors, dst, tag):
        self._note_stream(tensors[0])
        self.sent.append(tensors[0])
        self.wire.setdefault(tag, []).append(tensors[0].clone())
        work = _Work(self.waits, tensors[0])
        if work.event is not None:  # the receive's copy waits for this clone, wherever it runs
            self._cloned[(tag, len(self.wire[tag]) - 1)] = work.event
        return work

    def recv(self, tensors, src, tag):
        self._note_stream(tensors[0])
        cloned = self._cloned.pop((tag, 0), None)
        self._cloned = {(t, i - (t == tag)): e for (t, i), e in self._cloned.items()}
        if cloned is not None:
            import torch

            torch.cuda.current_stream().wait_event(cloned)
        tensors[0].copy_(self.wire[tag].pop(0))
        return _Work(self.waits, tensors[0])
