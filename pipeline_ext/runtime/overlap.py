"""Run an overlapped pair (``OVERLAP_F_B``) as two threads that pass a baton: one computes while the other waits.

DualPipe's point is that a rank runs the forward of one microbatch and the
backward of another at the same time, so that one half's communication (expert
all-to-all, tensor-parallel collectives, FSDP all-gathers) hides behind the
other half's compute. ``run_overlapped`` is the executor's function for such a
pair (``Executor.run(..., custom={OVERLAP_F_B: OVERLAPPED})``): the F half
and the B (or I) half each run in their own thread, and a *baton* says which
one may compute.

[Note: the second half's thread]
The pair's first action (in the schedule) runs in the caller's thread. The
second's thread, a pooled one, is started by the first half at its first
handover, the first moment the two can run at once; a pair whose first half
never hands over (a model without collectives or declared waits) runs its
second action after it in the caller's thread: exactly ``overlap=False``, no
thread started, no thread switch (starting the other thread up front cost
0.3 ms per pair on an idle host, twice that loaded).
Only the *first* half's handover starts it, and only while the first half
runs: the starter is dropped when the first half finishes (returns, raises
or is stopped). A second half that runs in the caller's thread because the
first never handed over may well hand over itself (DualPipeV's B first,
then an F whose forward calls a collective or waits in ``comm_region()``):
its handovers are no-ops (the first is finished, every turn is the
second's) and must not start the pooled thread, which would run the second
action again, on a thread nothing waits for (red-team issue 54: data
consumed twice, ranks disagreeing on whether the step happened, dropout
drawn twice). So each half runs exactly once in every case: neither hands
over (both in the caller's thread); the first hands over, whether or not the
second does (the second in the pool, waited for before the pair returns);
only the second does (both in the caller's thread); the first raises before
any handover (the second never runs, as sequentially); the first raises
after one, or the second raises (the other is stopped at its next
handover, or runs to its end; either way it has ended when the pair
returns).

The baton
---------
[Note: the baton's fixed turns]
Exactly one half holds it at a time. A half gives it up only at a *handover
point*, i.e. while it waits on communication, and takes it back when that
communication is done and it is its turn. Turns strictly alternate (F, B, F,
B, ...; once a half is finished the other has every turn), starting with the
pair's first action in the schedule (DualPipeV's pairs are B then F).
Why strict turns and not "whoever is ready first": the order in which the two
halves *issue* collectives on one process group must be the same on every rank
of that group (collectives are matched by their order). With fixed turns the
sequence of compute segments, and so the order of issued collectives, is a
function of the program alone, never of timing: every rank of an
expert-parallel group issues them in the same order.
The cost: a half whose wait is over waits for its turn. Letting a ready half
compute out of turn and holding back only its *wrapped* collectives would not
do: a collective the baton does not see (a functional collective, a
``broadcast``, a point-to-point send) would then be issued in an order that
depends on timing, and ranks that match different collectives of the same
shape compute a wrong result without an error.

Handover points
---------------
- The ``torch.distributed`` collectives a model calls while the pair runs
  (``all_to_all``, ``all_to_all_single``, ``all_gather``,
  ``all_gather_into_tensor``, ``reduce_scatter``, ``reduce_scatter_tensor``,
  ``all_reduce``), looked up as ``torch.distributed.<name>`` at call time:
  the wrapper issues the collective with ``async_op=True`` *while still
  holding the baton* (so the issue order is the fixed one), hands the baton
  over, waits, and takes it back. Only calls from a pair's own threads are
  touched; every other thread gets the original function. A call that asks
  for ``async_op=True`` itself is passed through (it is not a wait).
- ``comm_region()``: a context manager a model wraps around a wait of its own
  (a ``Work.wait()``, a socket, the ``sleep`` standing for a slow network in
  the benchmark). Its body runs *without* the baton, concurrently with the
  other half's compute, so it must only wait: issue collectives before it
  (``async_op=True``) and wait inside. Outside a pair it does nothing.
- ``overlap_point()``: gives the turn to the other half and takes it back at
  the next turn (a yield with nothing to wait on).

- The wait of a functional collective (``torch.distributed._functional_collectives``,
  which DTensor uses too): it is issued when called, with the baton, and
  waited on by ``wait_tensor`` when its result is first used (or in its
  backward function); that wait runs without the baton.

What is not covered: collectives imported by name before the pair runs
(``from torch.distributed import all_to_all_single``), and waits inside
torch's C++ (a functional collective's backward on a torch whose backward is
C++): wrap those waits in ``comm_region()``; without a handover a half keeps
the baton through its wait, which is the sequential run.
Nor streams on a GPU: the halves are threads on the same stream, and on CUDA
autograd runs a backward on its own device thread, which the handover does not
follow yet.

What a model needs for the overlap to pay: waits that are handover points, and
compute on both sides of every wait, in both halves, at least as long as the
wait: the first wait of F hides behind B's first segment, the last wait of B
behind F's last.

Exactness
---------
Only one half computes at a time and each half runs its own ops in its own
order, so each floating-point result is that of running the pair one after
the other, in the schedule's order (``overlap=False``). The second half's
thread is a pooled one (kept between pairs: starting a thread per pair costs
milliseconds on a loaded host). F does not touch ``.grad``; B accumulates into its
stage's ``.grad`` in its own order, as before. Torch's CPU autograd engine
runs a backward on the calling thread, so the B half's ``backward`` (and the
backward of a model's autograd.Function that issues a collective) runs in the
B half's thread and sees its handover points. Thread-local torch state that the
step runs under (grad mode, autocast, the innermost ``saved_tensors_hooks``
such as ``save_on_cpu``) is entered in both halves, whichever thread runs
them; other thread-local state set around ``step()`` (a ``TorchDispatchMode``)
is seen by a half only in the caller's thread (the first always, the second
when the first never handed over), and a
model whose F and B both draw from the global RNG across a
handover (dropout in an activation-checkpointing recompute that issues a
collective) would see its draws in another order.

No deadlock
-----------
[Note: the halves never wait on each other]
The halves never wait on each other's messages. Each half waits on its own
action's receives (holding the baton) and posts its own action's sends as
soon as that action ran (``GroupRun`` runs the messages the lowering put
between the two actions with them: a ``PairRunner``, ``OVERLAPPED``), and the validator
checks that a pair completes as one unit: neither action's input needs what
the other completes, on this rank or any other. So a half waits only on
messages that come without the other half, on collectives that the same half
on the other ranks issues in the same order, or on its own waits. Run without
handovers, a pair is the two actions one after the other, messages included:
the first's output leaves before the second runs, as the simulator counts.
A half that waits without a handover point (a skip message, a blocking call
not wrapped) simply keeps the baton: that is the sequential run, not a hang.

Failures
--------
When a half raises, the other half is stopped at its next handover (it would
have not run at all in the sequential order if F failed first); the first
exception is re-raised, its type kept, with a note naming the pair and the
half that failed.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from pipeline_ext.runtime.group_run import PairRunner
from pipeline_ext.schedules import Action, ActionKind

__all__ = ["run_overlapped", "release_pair_threads", "OVERLAPPED", "comm_region", "overlap_point", "in_overlap",
           "handover_count", "PAIR_COLLECTIVES"]

#: the torch.distributed collectives that are handover points while a pair runs
PAIR_COLLECTIVES = ("all_to_all", "all_to_all_single", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                    "reduce_scatter_tensor", "all_reduce")

_tls = threading.local()
_handovers = [0]  # in this process, since it started: tests check that a model's waits did hand over


def handover_count() -> int:
    """How many times a pair half has handed the baton over at a wait in this process (for tests and tools)."""
    return _handovers[0]


class _Stopped(BaseException):
    """Raised inside a half at its handover when the other half failed: unwinds it without being an error."""


class _Baton:
    """Who of the two halves (0: F, 1: B) may compute; turns alternate, a finished half passes every turn."""

    def __init__(self, first: int, start_second: Callable[[], None]) -> None:
        self.cond = threading.Condition()
        self.first = self.turn = first
        self.finished = [False, False]
        self.failed = False
        #: starts the second half's thread; called at most once, by the first half at its first handover (it holds
        #: the baton: no race), so a pair that never hands over never starts a thread; dropped when the first half
        #: finishes, so a second half running in the caller's thread cannot start a copy of itself
        #: ([Note: the second half's thread])
        self.start_second: Optional[Callable[[], None]] = start_second

    def acquire(self, h: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.failed or self.turn == h or self.finished[1 - h])
            if self.failed:
                raise _Stopped()

    def release(self, h: int) -> None:
        if h == self.first:  # the second half's handovers never start a thread: it is that thread, or it runs
            start, self.start_second = self.start_second, None  # after the first in the caller's
            if start is not None:
                start()
        with self.cond:
            if not self.finished[1 - h]:
                self.turn = 1 - h
            self.cond.notify_all()

    def finish(self, h: int, failed: bool) -> None:
        with self.cond:
            if h == self.first:  # from here on the second half is started (or run) by the caller only
                self.start_second = None
            self.finished[h] = True
            self.failed = self.failed or failed
            self.turn = 1 - h
            self.cond.notify_all()


class _Half:
    """The thread-local face of a pair half: its baton, its index, whether it holds the baton now."""

    def __init__(self, baton: _Baton, h: int) -> None:
        self.baton, self.h, self.holding = baton, h, False

    def take(self) -> None:
        self.baton.acquire(self.h)
        self.holding = True

    def give(self) -> None:
        _handovers[0] += 1  # only the baton's holder gets here: no race
        self.holding = False
        self.baton.release(self.h)


def _current() -> Optional[_Half]:
    """The calling thread's half when it holds the baton (a handover applies), else None."""
    half = getattr(_tls, "half", None)
    return half if half is not None and half.holding else None


def in_overlap() -> bool:
    """Whether the caller is a half of an overlapped pair holding the baton (its waits are handover points)."""
    return _current() is not None


@contextlib.contextmanager
def comm_region() -> Iterator[None]:
    """Declare a wait: inside a pair, the other half computes while the body runs (see the module doc).

    The body must only wait (no compute, no collective that the other half
    could also issue): it runs without the baton. Outside a pair, nothing.
    """
    half = _current()
    if half is None:
        yield
        return
    half.give()
    try:
        yield
    finally:
        half.take()


def overlap_point() -> None:
    """Give the turn to the other half of the pair and take it back at the next turn (no-op outside a pair)."""
    with comm_region():
        pass


_wrappers: dict[Any, Callable[..., Any]] = {}


def _wrapper(original: Callable[..., Any], make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Any:
    """The wrapper of ``original``, made once: a pair installs the wrappers around every run, and making one
    (``inspect.signature``, ``functools.wraps``) costs tens of microseconds, per pair, on the step's path."""
    wrapped = _wrappers.get(original)
    if wrapped is None:
        wrapped = _wrappers[original] = make(original)
    return wrapped


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """A collective that, called from a pair half, is issued with the baton and waited on without it."""
    import inspect

    try:
        async_index: Optional[int] = list(inspect.signature(original).parameters).index("async_op")
    except (ValueError, TypeError):
        async_index = None

    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        half = _current()
        asked_async = kwargs.get("async_op", False) or (async_index is not None and len(args) > async_index
                                                       and bool(args[async_index]))
        if half is None or asked_async:
            return original(*args, **kwargs)
        if async_index is not None and len(args) > async_index:
            args = args[:async_index] + (True,) + args[async_index + 1:]
        else:
            kwargs["async_op"] = True
        work = original(*args, **kwargs)  # issued holding the baton: the issue order is the fixed one
        if work is None:  # not a member of the group: nothing to wait on
            return None
        with comm_region():  # the wait runs without the baton
            work.wait()
        return None

    collective.__pipeline_ext_original__ = original  # type: ignore[attr-defined]
    return collective


def _wrap_wait(original: Callable[..., Any]) -> Callable[..., Any]:
    """A functional collective's wait (``wait_tensor``), called from a pair half: waited on without the baton.

    The collective itself was issued earlier, with the baton (functional
    collectives are issued when called and waited on when their result is
    first used), so only the wait moves.
    """

    @functools.wraps(original)
    def wait_tensor(*args: Any, **kwargs: Any) -> Any:
        with comm_region():  # outside a pair, nothing
            return original(*args, **kwargs)

    wait_tensor.__pipeline_ext_original__ = original  # type: ignore[attr-defined]
    return wait_tensor


_patch_lock = threading.Lock()
_patch_users = 0
_patched: dict[tuple[Any, str], Any] = {}


@contextlib.contextmanager
def _collectives_wrapped() -> Iterator[None]:
    """While any pair runs in this process: torch.distributed's collectives are handover points in pair threads.

    Counted, so pairs of several executors (one process running several
    ranks on threads) share one patch, removed when the last pair ends.
    """
    global _patch_users
    import torch.distributed as dist

    with _patch_lock:
        if _patch_users == 0 and dist.is_available():
            from torch.distributed import distributed_c10d as c10d

            for name in PAIR_COLLECTIVES:
                original = getattr(c10d, name, None)
                if original is None:
                    continue
                wrapped = _wrapper(original, functools.partial(_wrap, name))
                for module in (dist, c10d):
                    if getattr(module, name, None) is original:
                        _patched[(module, name)] = original
                        setattr(module, name, wrapped)
            # functional collectives (DTensor's too) wait through this module's ``wait_tensor``, looked up at
            # call time: by an AsyncCollectiveTensor's first use, and by their backward functions. Only a model
            # that uses them has imported the module.
            funcol = sys.modules.get("torch.distributed._functional_collectives")
            original = getattr(funcol, "wait_tensor", None)
            if original is not None:
                _patched[(funcol, "wait_tensor")] = original
                funcol.wait_tensor = _wrapper(original, _wrap_wait)
        _patch_users += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                for (module, name), original in _patched.items():
                    setattr(module, name, original)
                _patched.clear()


def _thread_state() -> Callable[[], contextlib.ExitStack]:
    """The caller's thread-local torch state that a step runs under (grad mode, autocast, the innermost
    ``saved_tensors_hooks``, e.g. ``save_on_cpu``), to enter in a half: the same in whichever thread it runs."""
    grad = torch.is_grad_enabled()
    top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top_hooks(False) if top_hooks is not None else None  # only the innermost pair applies
    autocasts = []
    for device in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(device):
                autocasts.append((device, torch.get_autocast_dtype(device)))
        except (RuntimeError, TypeError, AttributeError):  # an older torch or a device type it lacks
            pass

    def enter() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.set_grad_enabled(grad))
        if hooks is not None:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*hooks))
        for device, dtype in autocasts:
            stack.enter_context(torch.autocast(device, dtype=dtype))
        return stack

    return enter


_pool_lock = threading.Lock()
_pool_executor: list = []


def _pool() -> Any:
    """Threads for B halves, kept between pairs (one per pair running at once in this process)."""
    with _pool_lock:
        if not _pool_executor:
            from concurrent.futures import ThreadPoolExecutor

            # a B half must start while its F runs (they alternate): never queue one behind another pair's
            _pool_executor.append(ThreadPoolExecutor(max_workers=256, thread_name_prefix="pipeline_ext-pair-B"))
        return _pool_executor[0]


def release_pair_threads() -> None:
    """Let the pooled threads go (after their work); the next pair starts fresh ones.

    A pooled thread keeps torch's thread-local state between steps, DTensor's
    sharding cache among it, and that cache is keyed by meshes that compare
    equal by value: a process that destroys its process groups and makes new
    ones (a test pool, an in-process restart) must clear it in every thread
    that ran DTensor ops, or a later DTensor op in a pooled thread reuses a
    mesh whose groups are gone. Call this then (the main thread's caches are
    torch's to clear: ``torch._C._clear_DTensor_sharding_propagator_cache``).
    """
    with _pool_lock:
        executors, _pool_executor[:] = list(_pool_executor), []
    for executor in executors:
        executor.shutdown(wait=True)


def _call_and_forget(box: list) -> None:
    """Call ``box[0](*box[1:])``, emptying ``box`` first.

    Why: a pool thread's work item keeps what it was submitted with until the thread takes its next item,
    which may come after the caller has the result; the half's function refers to the pair's ``run`` (every
    action's result), so it must be gone by the time the result is set.
    """
    fn, *args = box
    box.clear()
    fn(*args)


def describe_pair(actions: Sequence[Action]) -> str:
    return "overlapped pair " + " + ".join(
        f"{a.kind.value} of stage {a.stage} microbatch {a.microbatch}" for a in actions)


def run_overlapped(actions: Sequence[Action], run: Callable[[Action], Any]) -> None:
    """Run an overlapped pair's two actions concurrently on two threads under a baton (the module doc).

    ``run`` is the executor's ``GroupRun`` (runs each action once). A group
    that is not one F and one B or I runs one action after the other.
    """
    forwards = [a for a in actions if a.kind == ActionKind.F]
    backs = [a for a in actions if a.kind in (ActionKind.B, ActionKind.I)]
    if len(actions) != 2 or len(forwards) != 1 or len(backs) != 1:
        for a in actions:
            run(a)
        return
    halves = (forwards[0], backs[0])
    first = halves.index(actions[0])  # the schedule's order: what overlap=False runs
    second_done: list[Any] = []
    baton = _Baton(first, lambda: second_done.append(_pool().submit(_call_and_forget, [body, 1 - first])))
    errors: list[tuple[float, int, BaseException]] = []
    state = _thread_state()

    def body(h: int) -> None:
        half = _Half(baton, h)
        _tls.half = half
        failed = False
        try:
            half.take()
            with state():
                run(halves[h])
        except _Stopped:
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread below
            errors.append((time.perf_counter(), h, exc))
            failed = True
        finally:
            half.holding = False
            _tls.half = None
            baton.finish(h, failed)

    with _collectives_wrapped():
        try:
            body(first)  # the second half's thread starts at the first's first handover, if it hands over
            if second_done:  # final: only the first half starts the second, and it has finished
                second_done[0].result()
            elif not errors:  # no handover: the second runs after the first, in this thread, as overlap=False runs it
                body(1 - first)  # its own handovers start nothing (the baton dropped the starter at finish)
        finally:
            # the baton's starter refers to ``body``, which refers to the baton and to ``run`` (the actions'
            # results): a cycle that would keep those tensors alive until the garbage collector runs
            baton.start_second = None
    if errors:
        errors.sort(key=lambda e: e[0])
        _, h, exc = errors[0]
        note = (f"pipeline_ext: raised in the {halves[h].kind.value} half ({halves[h]}) of the "
                f"{describe_pair(halves)}, run overlapped")
        if hasattr(exc, "add_note"):
            exc.add_note(note)
            for _, h2, other in errors[1:]:
                exc.add_note(f"pipeline_ext: the {halves[h2].kind.value} half ({halves[h2]}) raised too: "
                             f"{type(other).__name__}: {other}")
        raise exc


#: what the schedule hands the executor for ``OVERLAP_F_B``: ``run_overlapped`` as a ``PairRunner``, so the executor
#: runs the messages lying between a pair's two actions with them (``GroupRun``), not around the pair
OVERLAPPED = PairRunner(run_overlapped)
