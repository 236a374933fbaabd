"""Where a stashed skip tensor waits for its pop: the skip tracker of the running forward.

A skippable layer does not know whether it runs in a plain ``model(x)``, in a
``Pipe`` stage, or in one process of a multi-process pipeline; it saves and
loads its skips through the *current* tracker (thread-local, because a Pipe runs
one worker thread per device). Outside any pipeline that is the thread's
default tracker, so the unsplit model runs as it is. A pipeline stage installs
a fresh tracker per (stage, microbatch) forward, pre-filled with the skips
that arrived from earlier stages; what is left in it afterwards is what this
stage sends on.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator, NamedTuple, Optional, TypeVar

import torch

__all__ = ["SkipKey", "SkipTracker", "current_skip_tracker", "use_skip_tracker", "call_with_skips"]

T = TypeVar("T")


class SkipKey(NamedTuple):
    """A skip's identity: ``(namespace id or None, name)``; the same on every rank."""

    namespace: Optional[str]
    name: str

    def __str__(self) -> str:
        return repr(self.name) if self.namespace is None else f"{self.name!r} (namespace {self.namespace!r})"

    @property
    def order(self) -> tuple[str, str]:
        """A total order (None sorts first): every rank packs a message's skips in this order."""
        return (self.namespace or "", self.name)


class SkipTracker:
    """Skip tensors stashed and not yet popped, by key.

    A later stash under the same key replaces the earlier one (a forward that
    failed between its stash and its pop must not poison the retry).
    """

    def __init__(self, tensors: Optional[dict[SkipKey, Optional[torch.Tensor]]] = None) -> None:
        self.tensors: dict[SkipKey, Optional[torch.Tensor]] = dict(tensors or {})

    def save(self, key: SkipKey, tensor: Optional[torch.Tensor]) -> None:
        self.tensors[key] = tensor

    def load(self, key: SkipKey) -> Optional[torch.Tensor]:
        """Take the skip out (KeyError when it was never stashed)."""
        return self.tensors.pop(key)


_local = threading.local()


def current_skip_tracker() -> SkipTracker:
    """The tracker of the forward running on this thread (the thread's default one outside pipelines)."""
    tracker = getattr(_local, "tracker", None)
    if tracker is None:
        tracker = _local.default = getattr(_local, "default", None) or SkipTracker()
    return tracker


@contextmanager
def use_skip_tracker(tracker: SkipTracker) -> Iterator[SkipTracker]:
    """Make ``tracker`` current on this thread for the duration of the block (nests)."""
    previous = getattr(_local, "tracker", None)
    _local.tracker = tracker
    try:
        yield tracker
    finally:
        _local.tracker = previous


def call_with_skips(fn: Callable[[], T], popped: dict[SkipKey, Optional[torch.Tensor]]) -> tuple[T, dict]:
    """One stage forward: ``fn()`` under a fresh tracker holding ``popped``; returns its result and the leftovers.

    The leftovers are what the stage stashed for later stages. (A plain
    function, not ``use_skip_tracker``: it runs once per stage and microbatch.)
    """
    tracker = SkipTracker(popped)
    previous = getattr(_local, "tracker", None)
    _local.tracker = tracker
    try:
        out = fn()
    finally:
        _local.tracker = previous
    return out, tracker.tensors
