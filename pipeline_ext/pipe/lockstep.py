"""Forwards in clock-cycle order, as torchgpipe runs them.

torchgpipe runs the forward of microbatch ``i`` on partition ``j`` in clock
cycle ``i + j``, and a cycle starts only when every forward of the previous one
has finished. Users rely on that order (side effects of forwards, logs, counters,
hooks: their order is the same in every run), and ``pipe(x)`` is torchgpipe's
call. Our executors are driven by the data alone: a rank runs its next forward
as soon as its input is there, so stage 0 runs ahead through its microbatches
while stage 1 is still on its first. ``Lockstep`` adds torchgpipe's barrier
between the worker threads: a forward of cycle ``c`` waits until every forward
of cycle ``c - 1`` has returned.

It holds only for schedules whose every rank runs (and receives for) its
forwards in cycle order, all before its first backward: GPipe's step, and the
fill-drain forward of ``pipe(x)`` under every schedule whose forward order
allows it (``Lockstep.of`` says None otherwise: a barrier there could wait for
a forward that its own rank runs later, a deadlock). The barrier costs what
torchgpipe's does: a cycle lasts as long as its slowest forward.
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Optional

from pipeline_ext import schedules as S
from pipeline_ext.pipe.threads import StepCancelled

__all__ = ["Lockstep", "LockstepRunner"]

_FORWARD_KINDS = (S.ActionKind.F, S.ActionKind.RECV_F, S.ActionKind.SEND_F)


class Lockstep:
    """One call's clock: counts the finished forwards of each cycle; a forward waits for its previous cycle."""

    def __init__(self, schedule: S.Schedule) -> None:
        self._total = Counter(a.stage + a.microbatch for actions in schedule.actions for a in actions
                              if a.kind == S.ActionKind.F)
        self._done: Counter = Counter()
        self._closed: Optional[str] = None
        self._cond = threading.Condition()

    @classmethod
    def of(cls, schedule: S.Schedule) -> Optional["Lockstep"]:
        """A clock for ``schedule``, or None where its ranks' order of forwards does not allow one."""
        for actions in schedule.actions:
            cycle, backward = -1, False
            for a in actions:
                if a.kind not in _FORWARD_KINDS:
                    backward = True
                    continue
                if a.kind == S.ActionKind.SEND_F:
                    continue  # a send does not wait (the hub holds far more messages than a step sends)
                if backward or a.stage + a.microbatch < cycle:
                    return None
                cycle = a.stage + a.microbatch
        return cls(schedule)

    def wait(self, stage: int, mb: int) -> None:
        """Block until every forward of the cycle before (stage, mb)'s has finished; raise once closed."""
        before = stage + mb - 1
        with self._cond:
            while self._closed is None and self._done[before] < self._total[before]:
                self._cond.wait()
            if self._closed is not None:
                raise StepCancelled(f"step cancelled: {self._closed}")

    def finished(self, stage: int, mb: int) -> None:
        with self._cond:
            self._done[stage + mb] += 1
            self._cond.notify_all()

    def close(self, reason: str) -> None:
        """The step was cancelled: every waiting forward raises ``StepCancelled`` (a failed forward never finishes)."""
        with self._cond:
            if self._closed is None:
                self._closed = reason
            self._cond.notify_all()


class LockstepRunner:
    """A stage runner whose forwards keep the clock; the executor reads everything else from the wrapped runner."""

    def __init__(self, runner: Any, clock: Lockstep) -> None:
        self.runner = runner
        self.clock = clock

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def forward(self, mb: int, *args: Any, **kwargs: Any) -> Any:
        stage = self.runner.stage_index
        self.clock.wait(stage, mb)
        out = self.runner.forward(mb, *args, **kwargs)
        self.clock.finished(stage, mb)
        return out
