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

[Note: partition order within a cycle]
torchgpipe starts the tasks of a cycle in partition order, on threads that
run them at once, and raises a failure only after every task of its cycle
has run. Ours run at once only where nothing serialises them: a seeded
forward (``recompute.CallRng``: checkpointing, dropout) holds the process's
RNG lock for the whole forward, so a cycle's forwards ran one after the
other in whichever order their threads reached the lock. Their side effects
came in a different order from run to run (torchgpipe's
``test_forward_lockstep`` failed 4 runs in 5), and a failure could cancel an
earlier partition's forward of its own cycle before it started (stage 3
failing beside stage 2's forward: torchgpipe's counter of 2 came out 1). So
in a seeded call the clock is *serial*: forwards run one at a time in
(cycle, partition) order, each after every forward before it has returned.
The lock serialised their module calls already; serial adds only the stage
runner's host work around them (inputs made leaves, the last stage's loss).
The order within a cycle is then partition order in every run, and a failure
stops everything after it: the earlier partitions of its cycle have run, as
in torchgpipe; the later ones, which torchgpipe would still run, do not
start. Unseeded, a cycle's forwards still run at once, in whatever order
they take, and a failure may cancel a forward of its own cycle that had not
started yet (never one of a later cycle). Serial needs each rank's forwards
in (cycle, partition) order too, else a forward would wait for one its own
rank runs later: where a schedule's are not (the V schedules put two stages
of one rank in one cycle, the later stage first), the clock keeps cycles only.
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
    """One call's clock: a forward waits for its previous cycle, or, serial, for every forward before it."""

    def __init__(self, schedule: S.Schedule, serial: bool = False) -> None:
        keys = sorted(_key(a) for actions in schedule.actions for a in actions if a.kind == S.ActionKind.F)
        self._total = Counter(cycle for cycle, _ in keys)
        self._done: Counter = Counter()
        #: serial (see the module's note): (cycle, stage) -> how many forwards come before it
        self._turn: Optional[dict[tuple[int, int], int]] = {k: i for i, k in enumerate(keys)} if serial else None
        self._finished = 0
        self._closed: Optional[str] = None
        self._cond = threading.Condition()

    @classmethod
    def of(cls, schedule: S.Schedule, serial: bool = False) -> Optional["Lockstep"]:
        """A clock for ``schedule``, or None where its ranks' order of forwards does not allow one.

        ``serial``: one forward at a time in (cycle, partition) order, where every rank's forwards come in
        that order (else cycles only).
        """
        ordered = True
        for actions in schedule.actions:
            cycle, backward, last = -1, False, None
            for a in actions:
                if a.kind not in _FORWARD_KINDS:
                    backward = True
                    continue
                if a.kind == S.ActionKind.SEND_F:
                    continue  # a send does not wait (the hub holds far more messages than a step sends)
                if backward or a.stage + a.microbatch < cycle:
                    return None
                cycle = a.stage + a.microbatch
                if a.kind == S.ActionKind.F:
                    ordered = ordered and (last is None or _key(a) > last)
                    last = _key(a)
        return cls(schedule, serial and ordered)

    @property
    def serial(self) -> bool:
        return self._turn is not None

    def _ready(self, stage: int, mb: int) -> bool:
        if self._turn is not None:
            return self._finished >= self._turn[(stage + mb, stage)]
        before = stage + mb - 1
        return self._done[before] >= self._total[before]

    def wait(self, stage: int, mb: int) -> None:
        """Block until (stage, mb)'s turn: its previous cycle (serial: every forward before it) has finished."""
        with self._cond:
            while self._closed is None and not self._ready(stage, mb):
                self._cond.wait()
            if self._closed is not None:
                raise StepCancelled(f"step cancelled: {self._closed}")

    def finished(self, stage: int, mb: int) -> None:
        with self._cond:
            self._done[stage + mb] += 1
            self._finished += 1
            self._cond.notify_all()

    def close(self, reason: str) -> None:
        """The step was cancelled: every waiting forward raises ``StepCancelled`` (a failed forward never finishes)."""
        with self._cond:
            if self._closed is None:
                self._closed = reason
            self._cond.notify_all()


def _key(action: S.Action) -> tuple[int, int]:
    """A forward's place in torchgpipe's order: (clock cycle, partition)."""
    return action.stage + action.microbatch, action.stage


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
