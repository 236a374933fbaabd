"""What every channel shares: the protocols the executor sees, the handle, errors and timeouts.

The executor is handed a ``StepContext`` per step; its ``open()`` returns the
step's ``Messages``, matched by (peer, tag), each ``send``/``recv`` returning a
``Handle`` whose ``wait(timeout, what)`` blocks with the GIL released. Two implementations:
``runtime/local.LocalStep`` between the worker threads of one process
(``Pipe``), and ``comm/session.Step`` between processes. Both end in the C++
runtime's ``Request`` (wrapped by ``ChannelHandle``).

Every wait releases the GIL and raises ``ChannelTimeout`` (a ``TimeoutError``)
naming what it waited for, or ``ChannelError`` when a peer failed.
"""
from __future__ import annotations

import functools
import math
import signal
import threading
from typing import Any, ContextManager, Optional, Protocol, Sequence, Union

import torch

from pipeline_ext.runtime._ext import _C

__all__ = ["ChannelError", "ChannelTimeout", "ChannelHandle", "Handle", "Messages", "StepContext", "check_timeout",
           "watch_signals"]

ChannelError = _C.ChannelError
ChannelTimeout = _C.ChannelTimeout


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


@functools.lru_cache(maxsize=16)  # called per wait with the executor's one timeout: a lookup, not the arithmetic
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


class Handle(Protocol):
    """An operation in flight. ``wait`` blocks (GIL released) up to ``timeout`` seconds."""

    def wait(self, timeout: Optional[float], what: str) -> list[torch.Tensor]: ...

    def is_completed(self) -> bool: ...


class Messages(Protocol):
    """One settled step's sends and receives (what ``StepContext.open()`` returns).

    ``send`` owns its bytes when it returns, unless the tensors are ``owned``:
    the pipeline's own (gradients autograd computed), which no one else can
    write ([Note: a send owns its bytes] in csrc/runtime/channel.h).
    ``batch()`` groups back-to-back sends into one launch where the transport can.
    """

    def send(self, tensors: Sequence[torch.Tensor], peer: int, tag: int, owned: bool = False) -> Handle: ...

    def recv(self, peer: int, tag: int) -> Handle: ...

    def batch(self) -> ContextManager[None]: ...


class StepContext(Protocol):
    """One step, as the executor sees it: everything the step needs besides the compute.

    ``number`` (the step's number) is part of every message's tag (``runtime/tags.py``). ``open()``
    is called once, by the executor alone (``Executor._open_due``): right
    before the step's first message or the first F/B/I of one of its
    ``skip_stages``, else after its last action. It returns the ``Messages``
    the executor sends and receives through: what messages need is settled
    there (across processes, the ranks' agreement and the transport), so its
    errors are the step's own, not a failed send's. ``skip_stages`` are this
    rank's stages that declare skip connections; ``skip_routes()`` says where
    their skips go (what ``open()`` settled: asked only after it).
    ``loss_weights()`` is each microbatch's weight in the loss (read on the
    last stage).
    """

    number: int
    skip_stages: frozenset

    def open(self) -> Messages: ...

    def skip_routes(self) -> Any: ...

    def loss_weights(self) -> Sequence[Union[float, torch.Tensor]]: ...
