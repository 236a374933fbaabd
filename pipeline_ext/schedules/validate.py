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
deadlock. A schedule that places FSDP parameters (UNSHARD, RESHARD,
REDUCE_GRAD; :mod:`.fsdp`) additionally has every rank's list walked for
them (:func:`check_fsdp`); they are rank-local, so the dependency, FIFO and
deadlock checks pass over them.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence, Union

from pipeline_ext.schedules.fsdp import GRADIENT_KINDS, Budget
from pipeline_ext.schedules.inorder import run_in_order
from pipeline_ext.schedules.ir import Action, ActionKind, Schedule, ScheduleError, check_structure, dependencies, done_key
from pipeline_ext.schedules.lowering import check_deadlock, check_fifo, counterpart, receives_for, sends_for
from pipeline_ext.schedules.pieces import check_piece_order

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W
UNSHARD, RESHARD, REDUCE_GRAD = ActionKind.UNSHARD, ActionKind.RESHARD, ActionKind.REDUCE_GRAD


def validate(schedule: Schedule, *, max_active_stages: Optional[int] = None,
             max_unsharded_bytes: Optional[float] = None,
             stage_bytes: Union[None, float, Sequence[float]] = None, pieces: Optional[int] = None) -> None:
    """Raise :class:`ScheduleError` describing the first problem found; return None if valid.

    The budget arguments (as :func:`.fsdp.plan_fsdp` takes them) are checked against the schedule's
    UNSHARD/RESHARD placement; a schedule without FSDP actions given a budget fails, since it computes on
    stages it never unshards. Over sequence pieces (``schedule.pieces``, or ``pieces`` for a schedule that does
    not say it, as one read from text), unit u being piece u % pieces of a sequence (:mod:`.pieces`), each
    stage must run a sequence's forwards in piece order and its backwards in reverse piece order.
    """
    check_structure(schedule)
    positions = _positions(schedule)
    _check_completeness(schedule, positions)
    _check_stage_order(positions, schedule.stage_to_rank)
    if pieces is not None and schedule.pieces not in (1, pieces):
        raise ScheduleError(f"schedule {schedule.name!r} is over seq_chunks={schedule.pieces} pieces, not {pieces}")
    check_piece_order(schedule, schedule.pieces if pieces is None else pieces)
    budget = Budget.of(schedule, max_active_stages, max_unsharded_bytes, stage_bytes)
    if schedule.has_fsdp or budget.limited:
        check_fsdp(schedule, budget)
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
            if action.is_fsdp:  # one per stage and placement, repeated by design: check_fsdp walks them
                continue
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


def check_fsdp(schedule: Schedule, budget: Budget = Budget()) -> None:
    """Walk every rank's list for its parameter placement; raise naming rank, position and action.

    Every stage of a schedule with FSDP actions is sharded: a compute action needs its stage active (from
    an UNSHARD to the next RESHARD; the runtime waits for the all-gather before the compute), an UNSHARD
    needs it sharded and a RESHARD active; the active stages stay within ``budget`` (counted at each UNSHARD,
    an all-gather in flight included); no FSDP action sits between the halves of an overlapped pair, which
    run as one unit; a stage with a B or W on the rank has exactly one REDUCE_GRAD, after its last B or W, and
    a stage without none; the step ends with every stage resharded, the state the next step starts from.
    """
    pair_firsts = {first for first, _ in schedule.overlapped}
    for rank, acts in enumerate(schedule.actions):
        last_grad = {a.stage: pos for pos, a in enumerate(acts) if a.kind in GRADIENT_KINDS}
        unsharded_at: dict[int, int] = {}  # active stage -> position of its UNSHARD
        resharded_at: dict[int, int] = {}
        reduced_at: dict[int, int] = {}
        in_pair = False
        for pos, a in enumerate(acts):
            where = f"rank {rank}, position {pos}: action {a}"
            s = a.stage
            if a.is_compute:
                in_pair = a in pair_firsts  # until the pair's second half, the next compute action
                if s not in unsharded_at:
                    was = (f"resharded at position {resharded_at[s]}" if s in resharded_at
                           else "never unsharded before it")
                    raise ScheduleError(f"{where} computes on stage {s}, whose parameters are sharded here ({was}); "
                                        f"put {s}{UNSHARD} before it")
                continue
            if not a.is_fsdp:
                continue
            if in_pair:
                raise ScheduleError(f"{where} sits between the two halves of an overlapped pair, which run as one "
                                    "unit; place it before or after the pair")
            if a.kind is UNSHARD:
                if s in unsharded_at:
                    raise ScheduleError(f"{where} unshards stage {s}, which is already unsharded (since position "
                                        f"{unsharded_at[s]})")
                unsharded_at[s] = pos
                if not budget.fits(unsharded_at):
                    raise ScheduleError(f"{where} makes stages {sorted(unsharded_at)} unsharded at once, over the "
                                        f"budget ({budget})")
            elif a.kind is RESHARD:
                if s not in unsharded_at:
                    raise ScheduleError(f"{where} reshards stage {s}, which is not unsharded here")
                del unsharded_at[s]
                resharded_at[s] = pos
            else:  # REDUCE_GRAD
                if s in reduced_at:
                    raise ScheduleError(f"{where} is a second REDUCE_GRAD of stage {s} in the step (the first at "
                                        f"position {reduced_at[s]})")
                if s not in last_grad:
                    raise ScheduleError(f"{where}: stage {s} has no B or W on rank {rank}, so no gradients to "
                                        "reduce")
                if last_grad[s] > pos:
                    raise ScheduleError(f"{where} comes before the stage's last gradient write "
                                        f"{acts[last_grad[s]]} at position {last_grad[s]}; it goes after it")
                reduced_at[s] = pos
        for s, pos in sorted(last_grad.items()):
            if s not in reduced_at:
                raise ScheduleError(f"rank {rank}: stage {s} writes gradients (last at position {pos}, "
                                    f"{acts[pos]}) but has no {s}{REDUCE_GRAD} after it")
        if unsharded_at:
            s, pos = min(unsharded_at.items())
            raise ScheduleError(f"rank {rank}: the step ends with stage {s} unsharded (since its {s}{UNSHARD} at "
                                f"position {pos}); a step ends with every stage resharded")


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
