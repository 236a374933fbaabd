"""One single-process step on worker threads, cancelled as a whole when anything goes wrong.

``Pipe`` runs every rank's executor on its own thread. A step that fails must
not keep running behind the caller's back: a worker that keeps computing after
the caller saw the exception (a stage error on another rank, Ctrl-C in the
caller, the step's deadline) would keep writing ``.grad``, and a
``zero_grad()`` and retry would silently add its partial gradients to the new
step's. So the first failure, wherever it happens, *cancels the step*:

- the ``CancelToken`` is set: every stage runner is wrapped in a
  ``GuardedRunner`` that checks it before each action, so a worker stops at its
  next action (an action in progress, a forward or a backward, cannot be
  interrupted and finishes);
- ``on_cancel`` runs (``Pipe`` closes the in-process hub there, which wakes
  every worker blocked on a message at once);
- the caller waits a short grace period for the workers to stop, then raises.
  A worker still inside an action after the grace period is *abandoned*
  (threads are daemons, so it never holds up interpreter exit) and named in the
  error with the action it is stuck in; ``StepOutcome.abandoned`` lets the
  owner refuse new work until it has returned.

``timeout`` bounds the whole step, measured in the caller: a stage that stalls
makes the step raise ``ChannelTimeout`` within ``timeout`` seconds (the
grace period is its last part), not when the stall ends.
"""
from __future__ import annotations

import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from pipeline_ext.runtime.channel import ChannelError
from pipeline_ext.runtime.channel import ChannelTimeout

__all__ = ["CancelToken", "StepCancelled", "Activity", "GuardedRunner", "StepOutcome", "run_step_threads"]

#: how often the waiting caller wakes up to notice Ctrl-C and the deadline
_POLL_S = 0.05


class StepCancelled(RuntimeError):
    """Raised in a worker at its next action once the step was cancelled (the reason is the message)."""


class CancelToken:
    """Set once, by whoever fails first; read by every worker before each action."""

    def __init__(self) -> None:
        self._reason: Optional[str] = None
        self._lock = threading.Lock()

    def cancel(self, reason: str) -> bool:
        """Cancel with ``reason``; False when it was already cancelled (the first reason is kept)."""
        with self._lock:
            if self._reason is not None:
                return False
            self._reason = reason
            return True

    @property
    def cancelled(self) -> bool:
        return self._reason is not None

    def check(self) -> None:
        if self._reason is not None:
            raise StepCancelled(f"step cancelled: {self._reason}")


@dataclass
class Activity:
    """What one rank's worker is doing, for the error that names a stuck worker."""

    rank: int
    current: Optional[str] = None  # "F of stage 1, microbatch 0" while a runner action runs
    since: float = 0.0
    ran_backward: bool = False  # a B, I or W started: parameters' .grad may have been written

    def describe(self, now: float) -> str:
        if self.current is None:
            return f"worker {self.rank} (waiting for a message)"
        return f"worker {self.rank} in {self.current} (for {now - self.since:.1f} s)"


class GuardedRunner:
    """A stage runner whose every action first checks the step's ``CancelToken`` and records itself.

    The executor calls ``forward``/``backward``/``backward_input``/``backward_weight``
    and reads ``is_last``; everything else is the wrapped runner's.
    """

    def __init__(self, runner: Any, token: CancelToken, activity: Activity) -> None:
        self.runner = runner
        self.token = token
        self.activity = activity

    @property
    def is_last(self) -> bool:
        return self.runner.is_last

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def _act(self, kind: str, mb: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.token.check()
        a = self.activity
        a.current, a.since = f"{kind} of stage {self.runner.stage_index}, microbatch {mb}", time.monotonic()
        if kind != "F":
            a.ran_backward = True
        try:
            return fn(mb, *args, **kwargs)
        finally:
            a.current = None

    def forward(self, mb: int, *args: Any, **kwargs: Any) -> Any:
        return self._act("F", mb, self.runner.forward, *args, **kwargs)

    def backward(self, mb: int, *args: Any, **kwargs: Any) -> Any:
        return self._act("B", mb, self.runner.backward, *args, **kwargs)

    def backward_input(self, mb: int, *args: Any, **kwargs: Any) -> Any:
        return self._act("I", mb, self.runner.backward_input, *args, **kwargs)

    def backward_weight(self, mb: int, *args: Any, **kwargs: Any) -> Any:
        return self._act("W", mb, self.runner.backward_weight, *args, **kwargs)


@dataclass
class StepOutcome:
    """How a failed step ended (attached to the raised exception as ``pipeline_step``)."""

    reason: str
    activities: Sequence[Activity]
    abandoned: list[tuple[threading.Thread, Activity]] = field(default_factory=list)

    @property
    def ran_backward(self) -> bool:
        return any(a.ran_backward for a in self.activities)


def _join(threads: Sequence[threading.Thread]) -> None:
    """Threads that reported are past their work; joining them means none outlives the step."""
    for t in threads:
        if t.ident is not None:
            t.join()


def _note(exc: BaseException, text: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(text)


def run_step_threads(
    jobs: Sequence[Callable[[], None]],
    activities: Sequence[Activity],
    token: CancelToken,
    timeout: Optional[float],
    on_cancel: Callable[[str], None],
    on_failure: Callable[[StepOutcome], Optional[str]],
    grace: float,
    name: str = "pipe-worker",
) -> None:
    """Run ``jobs[r]`` on daemon thread r and wait; on any failure cancel all of them and raise.

    The call returns or raises within ``timeout`` seconds (None: no limit):
    the workers are cancelled ``grace`` seconds before it, so that they can stop.

    ``on_failure(outcome)`` runs after the workers stopped (or were abandoned),
    before the exception reaches the caller; a string it returns is added to the
    exception as a note (``Pipe`` discards partial gradients there).
    """
    done: "queue.Queue[tuple[int, Optional[BaseException]]]" = queue.Queue()

    def body(rank: int) -> None:
        try:
            jobs[rank]()
        except BaseException as exc:  # reported to the caller, never lost in the thread
            # Stop the others at once, not when the caller wakes up (torchgpipe's early stop). This
            # rank's report goes first: cancelling wakes the others with a consequence of this error
            # ("the channel hub was closed"), which must not reach the caller in its place.
            first = None
            if not isinstance(exc, StepCancelled):
                first = f"worker {rank} failed: {type(exc).__name__}: {exc}"
                if not token.cancel(first):
                    first = None
            done.put((rank, exc))
            if first is not None:
                on_cancel(first)
        else:
            done.put((rank, None))

    threads = [threading.Thread(target=body, args=(r,), name=f"{name}-{r}", daemon=True) for r in range(len(jobs))]
    deadline = math.inf if timeout is None else time.monotonic() + max(0.0, timeout - grace)
    running: set[int] = set()
    errors: list[tuple[int, BaseException]] = []
    raised: Optional[BaseException] = None
    reason = ""
    try:
        for r, t in enumerate(threads):
            running.add(r)  # before start: a Ctrl-C between the two must not lose a started thread
            t.start()
        while running and not errors:
            left = deadline - time.monotonic()
            if left <= 0:
                now = time.monotonic()
                busy = "; ".join(activities[r].describe(now) for r in sorted(running))
                raised = ChannelTimeout(f"the step did not finish within timeout={timeout:g} s (still running: {busy})")
                reason = f"timeout={timeout:g} s exceeded"
                break
            try:
                rank, exc = done.get(timeout=min(_POLL_S, left))
            except queue.Empty:
                continue
            running.discard(rank)
            if exc is not None:
                errors.append((rank, exc))
                reason = f"worker {rank} failed: {type(exc).__name__}: {exc}"
    except BaseException as exc:  # Ctrl-C (or anything else) while the caller waits
        raised = exc
        reason = f"{type(exc).__name__} in the calling thread"
    if not running and not errors and raised is None:
        _join(threads)
        return
    if errors and raised is None:
        raised = errors[0][1]
    assert raised is not None
    if token.cancel(reason):
        on_cancel(reason)
    # Let every worker reach its next action (they stop there) or wake from a closed channel.
    stop_by = time.monotonic() + grace
    try:
        while running and time.monotonic() < stop_by:
            try:
                rank, exc = done.get(timeout=min(_POLL_S, max(0.0, stop_by - time.monotonic())))
            except queue.Empty:
                continue
            running.discard(rank)
            if exc is not None and not isinstance(exc, StepCancelled):
                errors.append((rank, exc))
    except BaseException:  # a second Ctrl-C: stop waiting, abandon who is still running
        pass
    running = {r for r in running if threads[r].ident is not None}  # a Ctrl-C may have come before a start
    outcome = StepOutcome(reason, list(activities), [(threads[r], activities[r]) for r in sorted(running)])
    _join([t for r, t in enumerate(threads) if r not in running])
    now = time.monotonic()
    if outcome.abandoned:
        _note(
            raised,
            "pipeline_ext: the step was cancelled, but a worker thread is still inside an action and was abandoned: "
            + "; ".join(a.describe(now) for _, a in outcome.abandoned)
            + ". It stops before its next action; until it returns, the Pipe refuses new calls.",
        )
    # the others' errors, except the consequences of cancelling (a closed channel, a refused next action)
    others = [f"worker {r}: {type(e).__name__}: {e}" for r, e in errors if e is not raised and not isinstance(e, ChannelError) and "step cancelled: " not in str(e)]
    if others:
        _note(raised, "pipeline_ext: other workers failed too: " + " | ".join(others[:4]))
    note = on_failure(outcome)
    if note:
        _note(raised, note)
    try:
        raised.pipeline_step = outcome  # type: ignore[attr-defined]
    except AttributeError:
        pass
    raise raised
