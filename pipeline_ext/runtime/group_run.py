"""What a registered custom function gets to run the actions it was handed: ``GroupRun``.

torch's ``register_custom_function`` lets a user replace how a compute action
(F, B, I, W, or an overlapped F/B pair) runs. The executor calls such a
function with the action(s) and a ``GroupRun``; the function decides *when*
each action's compute runs, and the ``GroupRun`` runs it exactly as the
executor would have (same inputs, same hand-over of the result, each action
once), keeping each action's own span for the trace. Its own module because
it is the one object the runtime hands to user code: what that code may do
(``run``, ``ready``, only while the function runs) is stated here, apart from
the action loop. Why the messages cannot change: [Note: custom functions
change when, not what] in ``executor.py``, which also checks, after the
function returns, that every action it was handed ran.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

from pipeline_ext.runtime.stage import StageError
from pipeline_ext.schedules import Action, ActionKind

__all__ = ["GroupRun", "CustomFunction", "PairRunner"]


class GroupRun:
    """What a registered function gets to run the action(s) it was handed, in the executor's step.

    ``run(action)`` runs one of them (each once) as the executor would have:
    its input is the step's microbatch, a received or handed-over value, and
    its result goes where the schedule's next actions expect it. It returns
    what the stage produced: an F's outputs (on the last stage, the stage's
    output), a B's or I's input gradients, None for W. ``ready(action)`` says
    whether the input of a not-yet-run F, B or I is here (received or handed
    over). Valid only while the function runs.

    ``run`` may be called from other threads (an overlapped pair's halves,
    ``runtime/overlap.py``) as long as only one of them runs an action's
    code at a time; ``spans`` keeps each action's own measured start and end
    for the trace, so overlapped actions show as overlapping.

    Made by the ``Executor`` (``executor``) for one step (``st``, its
    ``_StepState``); typed ``Any`` here because executor.py imports this
    module, not the other way round.
    """

    def __init__(self, executor: Any, group: tuple[Action, ...], st: Any,
                 before: Optional[dict[Action, tuple[Action, ...]]] = None,
                 after: Optional[dict[Action, tuple[Action, ...]]] = None) -> None:
        self._executor, self._st = executor, st
        self.actions = group
        self.done: dict[Action, Any] = {}
        self.spans: dict[Action, tuple[float, float]] = {}
        self.closed = False
        #: messages run with an action, by whichever thread runs it (a pair's, see ``Executor._custom``): the
        #: receives due right before it, the sends right after it
        self._before, self._after = before or {}, after or {}

    def message(self, action: Action) -> None:
        """Run one SEND or RECV action of the step, keeping its span for the trace."""
        start = time.perf_counter()
        self._executor._message(action, self._st)
        self.spans[action] = (start, time.perf_counter())

    def ready(self, action: Action) -> bool:
        key = (action.stage, action.microbatch)
        if action.kind == ActionKind.F:
            return action.stage == 0 or key in self._st.activations
        return self._executor.runners[action.stage].is_last or key in self._st.grads

    def __call__(self, action: Action) -> Any:
        if self.closed:
            raise RuntimeError(f"{action} was run after the function registered for it returned")
        if action not in self.actions:
            raise ValueError(f"{action} is not among the actions handed to this function: "
                             f"{' '.join(map(str, self.actions))}")
        if action in self.done:
            raise StageError(f"{action} ran twice in one step")
        for m in self._before.get(action, ()):
            self.message(m)
        start = time.perf_counter()
        self.done[action] = self._executor._dispatch[action.kind](action, self._st)
        self.spans[action] = (start, time.perf_counter())
        for m in self._after.get(action, ()):
            self.message(m)
        return self.done[action]


CustomFunction = Callable[[tuple[Action, ...], GroupRun], None]


class PairRunner:
    """A function for an overlapped pair that runs the messages lowered between its two actions itself.

    Any other function given for ``OVERLAP_F_B`` runs the pair as one unit,
    as torch's runtime does: the executor waits on those receives before it
    and posts those sends after it. A ``PairRunner`` is the one exception
    ([Note: custom functions change when, not what] in ``executor.py``):
    ``GroupRun`` runs the first action's sends right after it and the
    receives due before the second right before that one, so each half posts
    and waits on its own messages and a pair that never hands over runs as the
    two actions one after the other (``runtime/overlap.py``: [Note: the halves
    never wait on each other]). A class, not a mark on the function, so that
    what the executor does differently is said by a type it checks.
    """

    __slots__ = ("fn",)

    def __init__(self, fn: CustomFunction) -> None:
        self.fn = fn

    def __call__(self, actions: tuple[Action, ...], run: GroupRun) -> None:
        self.fn(actions, run)

    def __repr__(self) -> str:
        return f"PairRunner({getattr(self.fn, '__name__', self.fn)!r})"
