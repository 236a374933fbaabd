"""Walking per-rank action lists strictly in order: the loop every checker shares.

The timed simulator, validation's cross-stage dependency check and the deadlock
check of lowered schedules all ask one question: if every rank executes its
list in order and an action may only start once certain other actions have
run, does every rank reach its end, and if not, where is each one stuck? They
differ only in what an action waits for and what running it records, so those
are the two callables passed in; the loop and the error message live here once.
"""
from __future__ import annotations

from typing import Callable, Optional

from pipeline_ext.schedules.ir import Action, ScheduleError

#: Returns ``None`` when the action may run now, else what it still waits for
#: (anything whose ``str`` reads well in the error message; built lazily, since
#: blocked ranks are asked again and again).
Blocker = Callable[[int, Action], Optional[object]]
Runner = Callable[[int, Action], None]


def run_in_order(actions: list[list[Action]], blocked_on: Blocker, run: Runner, problem: str) -> None:
    """Run each rank's list in order, interleaving ranks as dependencies allow.

    Results do not depend on the interleaving the loop happens to pick, because
    each action's effect (e.g. its start time) depends only on the effects of
    the actions it waits for and on the previous action of its own rank.

    Raises :class:`ScheduleError` starting with ``problem`` and naming every
    stuck rank, its position, its action and what that action waits for.
    """
    pos = [0] * len(actions)
    progress = True
    while progress:
        progress = False
        for rank, acts in enumerate(actions):
            while pos[rank] < len(acts) and blocked_on(rank, acts[pos[rank]]) is None:
                run(rank, acts[pos[rank]])
                pos[rank] += 1
                progress = True
    stuck = [
        f"rank {rank} stuck at position {pos[rank]} on {acts[pos[rank]]} waiting for {blocked_on(rank, acts[pos[rank]])}"
        for rank, acts in enumerate(actions)
        if pos[rank] < len(acts)
    ]
    if stuck:
        raise ScheduleError(f"{problem}: " + "; ".join(stuck))
