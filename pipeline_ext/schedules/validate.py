"""Validation: is this schedule something the runtime can execute correctly?

Schedules can be written by hand, read from text or produced by a heuristic,
and the runtime trusts what it is given, so every check (docs/schedules.md, "Validation")
lives here and each error says where to look: rank, position and action.

Checks, cheapest first: the stage-to-rank map is sane; every action names an
existing stage and microbatch on the rank that holds that stage; every
(stage, microbatch) has exactly one F and either one B or one I and one W;
on each stage F comes before its B/I and I before its W; cross-stage
dependencies can be satisfied when every rank runs in order, each overlapped
pair completing as one unit (its halves are independent). For lowered
schedules additionally: every SEND/RECV is needed, present once and matched by
its peer, receives precede their consumers and sends follow their producers,
pairs of ranks exchange messages in FIFO order, and blocking receives never
deadlock.
"""
from __future__ import annotations

from collections import Counter

from pipeline_ext.schedules.inorder import run_in_order
from pipeline_ext.schedules.ir import Action, ActionKind, Schedule, ScheduleError, check_structure, dependencies, done_key
from pipeline_ext.schedules.lowering import check_deadlock, check_fifo, counterpart, receives_for, sends_for

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` describing the first problem found; return None if valid."""
    check_structure(schedule)
    positions = _positions(schedule)
    _check_completeness(schedule, positions)
    _check_stage_order(positions, schedule.stage_to_rank)
    _check_dependencies(schedule.compute_only())
    if schedule.lowered:
        _check_messages(schedule, positions)
        check_fifo(schedule)
        check_deadlock(schedule)


def _positions(schedule: Schedule) -> dict[Action, int]:
    """Position of each action in its rank's list; duplicates are an error."""
    seen: dict[Action, int] = {}
    for rank, acts in enumerate(schedule.actions):
        for pos, action in enumerate(acts):
            if action in seen:
                raise ScheduleError(
                    f"rank {rank}, position {pos}: duplicate action {action} (already at position {seen[action]})"
                )
            seen[action] = pos
    return seen


def _check_completeness(schedule: Schedule, positions: dict[Action, int]) -> None:
    for stage, rank in enumerate(schedule.stage_to_rank):
        for j in range(schedule.n_microbatches):
            has = {kind: Action(stage, kind, j) in positions for kind in (F, B, I, W)}
            where = f"rank {rank}"
            if not has[F]:
                raise ScheduleError(f"{where}: missing action {Action(stage, F, j)}")
            if has[B] and (has[I] or has[W]):
                raise ScheduleError(
                    f"{where}, position {positions[Action(stage, B, j)]}: action {Action(stage, B, j)} duplicates the "
                    f"split backward of stage {stage} microbatch {j}; use either B or I and W"
                )
            if not has[B] and not (has[I] and has[W]):
                missing = [Action(stage, k, j) for k in (I, W) if not has[k]] if (has[I] or has[W]) else [
                    Action(stage, B, j)]
                raise ScheduleError(f"{where}: missing action {' and '.join(map(str, missing))}")


def _check_stage_order(positions: dict[Action, int], placement: list[int]) -> None:
    for action, pos in positions.items():
        before = {B: F, I: F, W: I}.get(action.kind)
        if before is None:
            continue
        earlier = Action(action.stage, before, action.microbatch)
        if positions[earlier] > pos:
            raise ScheduleError(
                f"rank {placement[action.stage]}, position {pos}: action {action} comes before {earlier} "
                f"(position {positions[earlier]}); on a stage F must precede its B or I, and I its W"
            )


def _check_dependencies(plain: Schedule) -> None:
    """Every rank runs its actions in order; an overlapped pair completes as one unit.

    The halves of a pair run at the same time, so what the first completes is
    done only when the second is: neither half, nor any rank waiting on the
    first's result, may need it earlier.
    """
    done: set[Action] = set()
    n_stages = plain.num_stages
    second_of = dict(plain.overlapped)
    held: dict[Action, Action] = {}  # a pair's second -> its first, which completes with it

    def blocked_on(rank: int, action: Action):
        for dep in dependencies(action, n_stages):
            if dep not in done:
                return dep
        return None

    def run(rank: int, action: Action) -> None:
        if action in second_of:
            held[second_of[action]] = action
            return
        done.add(done_key(action))
        if action in held:
            done.add(done_key(held.pop(action)))

    run_in_order(plain.actions, blocked_on, run, "cross-stage dependencies cannot be satisfied")


def _check_messages(schedule: Schedule, positions: dict[Action, int]) -> None:
    placement = schedule.stage_to_rank
    needed: Counter = Counter()
    for rank, acts in enumerate(schedule.actions):
        for action in acts:
            if action.is_compute:
                for recv in receives_for(action, placement):
                    needed[recv] += 1
                    _require_order(rank, recv, action, positions, before=True)
                for send in sends_for(action, placement):
                    needed[send] += 1
                    _require_order(rank, send, action, positions, before=False)
    for rank, acts in enumerate(schedule.actions):
        for pos, action in enumerate(acts):
            if action.is_comm and not needed[action]:
                raise ScheduleError(f"rank {rank}, position {pos}: action {action} is not needed by any compute action")
            if action.is_comm:
                peer, other = counterpart(action, placement)
                if other not in positions:
                    raise ScheduleError(f"rank {rank}, position {pos}: action {action} has no matching {other} on rank {peer}")


def _require_order(rank: int, comm: Action, compute: Action, positions: dict[Action, int], before: bool) -> None:
    where = f"rank {rank}, position {positions[compute]}: action {compute}"
    if comm not in positions:
        raise ScheduleError(f"{where} needs {comm}, which is missing")
    if (positions[comm] < positions[compute]) != before:
        rel = "before" if before else "after"
        raise ScheduleError(f"{where} needs {comm} {rel} it, but it is at position {positions[comm]}")
