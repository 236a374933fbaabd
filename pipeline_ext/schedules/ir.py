"""The schedule IR: what one rank does, in order, written as data.

Everything else in this package (generators, lowering, validation, simulation,
rendering) and the runtime consume a :class:`Schedule`, so this module is the
contract between them. It is deliberately tiny and has no dependencies: a
schedule can be written by hand, stored as text and exchanged with
``torch.distributed.pipelining``, which spells actions the same way
(``2F0``, ``1I3``, ``0SEND_F5``, ``0UNSHARD``).

Text format (see docs/schedules.md)::

    # schedule name=1f1b n_microbatches=2 stage_to_rank=0,1
    0F0 0F1 0B0 0B1
    1F0 1B0 1F1 1B1

The ``#`` header is optional. Without it the stage-to-rank map is inferred from
the rank lines (each stage must then appear on exactly one rank), the number of
microbatches is the largest microbatch index plus one and the name is
``custom``. Every other non-blank line is one rank, in rank order.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import NamedTuple


class ScheduleError(ValueError):
    """A schedule is malformed, violates a constraint, or cannot run.

    Messages name the rank, the position in that rank's list and the action
    wherever those exist, because the person reading it has to find the line.
    """


#: the key under which an overlapped pair (``Schedule.overlapped``) is named: torch's spelling
OVERLAP_F_B = "OVERLAP_F_B"


class ActionKind(str, Enum):
    """What an action does. Values are the spellings used in the text format."""

    F = "F"  #: forward of one microbatch through one stage
    B = "B"  #: full backward (input grad and weight grad together)
    I = "I"  #: input-grad half of the backward (on the critical path)  # noqa: E741
    W = "W"  #: weight-grad half of the backward (can be deferred to fill bubbles)
    SEND_F = "SEND_F"  #: send this stage's output to the next stage's rank
    RECV_F = "RECV_F"  #: receive this stage's input from the previous stage's rank
    SEND_B = "SEND_B"  #: send the grad w.r.t. this stage's input to the previous stage's rank
    RECV_B = "RECV_B"  #: receive the grad w.r.t. this stage's output from the next stage's rank
    UNSHARD = "UNSHARD"  #: start all-gathering this FSDP-sharded stage's parameters (the next compute of it waits)
    RESHARD = "RESHARD"  #: free this stage's gathered parameters (its unsharded gradients stay)
    #: reduce-scatter this stage's gradients of the step and free them (once, after its last B/W)
    REDUCE_GRAD = "REDUCE_GRAD"

    def __str__(self) -> str:
        return self.value


COMPUTE_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W})
COMM_KINDS = frozenset({ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B})
#: Parameter placement of an FSDP-sharded stage (see :mod:`.fsdp`): neither compute nor pipeline messages. They are
#: rank-local (the all-gather and reduce-scatter run among the stage's data-parallel replicas, which all run the
#: same list), so lowering, FIFO and deadlock checking pass them through; they name a stage and no microbatch.
FSDP_KINDS = frozenset({ActionKind.UNSHARD, ActionKind.RESHARD, ActionKind.REDUCE_GRAD})
#: The ``microbatch`` of an FSDP action: it acts on the stage for the whole step, so it has none. A NamedTuple
#: field keeps an int (sorting, ``max`` over microbatches and hashing stay plain); -1 never names a microbatch.
#: Written without it (``0UNSHARD``, torch's spelling).
NO_MICROBATCH = -1
# Longest spellings first so that "SEND_F" is never read as "SEND_" + "F".
_KIND_PATTERN = "|".join(sorted((k.value for k in ActionKind), key=len, reverse=True))
_ACTION_RE = re.compile(rf"([0-9]+)({_KIND_PATTERN})([0-9]*)")
#: Largest stage, microbatch or rank count a schedule may name: far beyond any real pipeline (a step's
#: message tags hold 2^19 messages), small enough that a typo cannot make validation run out of memory.
MAX_INDEX = 1 << 16


class Action(NamedTuple):
    """One step of one rank: ``kind`` applied to ``microbatch`` on ``stage``.

    A NamedTuple so it is immutable, hashable (used as a dict key throughout)
    and cheap; ``str`` gives the text spelling.
    """

    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        if self.kind in FSDP_KINDS and self.microbatch == NO_MICROBATCH:
            return f"{self.stage}{self.kind.value}"
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def fsdp(cls, stage: int, kind: ActionKind) -> "Action":
        """An UNSHARD, RESHARD or REDUCE_GRAD of ``stage`` (microbatch :data:`NO_MICROBATCH`)."""
        if kind not in FSDP_KINDS:
            raise ScheduleError(f"Action.fsdp({stage}, {kind}): {kind} is not one of UNSHARD, RESHARD, REDUCE_GRAD")
        return cls(stage, kind, NO_MICROBATCH)

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Read ``{stage}{kind}{microbatch}``, e.g. ``1I3`` or ``0SEND_F5``; FSDP kinds without one (``0UNSHARD``)."""
        match = _ACTION_RE.fullmatch(text.strip())
        if match is None:
            raise ScheduleError(
                f"cannot parse action {text!r}: expected {{stage}}{{kind}}{{microbatch}} with kind one of "
                f"{', '.join(k.value for k in ActionKind)} (e.g. 2F0, 1I3, 0SEND_F5; 0UNSHARD has no microbatch)"
            )
        kind = ActionKind(match.group(2))
        if kind in FSDP_KINDS:
            if match.group(3):
                raise ScheduleError(f"cannot parse action {text.strip()!r}: {kind} acts on a stage for the whole "
                                    f"step and takes no microbatch (write {match.group(1)}{kind})")
            microbatch = NO_MICROBATCH
        elif not match.group(3):
            raise ScheduleError(f"cannot parse action {text.strip()!r}: {kind} needs a microbatch "
                                f"(e.g. {match.group(1)}{kind}0)")
        else:
            microbatch = int(match.group(3))
        stage = int(match.group(1))
        if max(stage, microbatch) >= MAX_INDEX:
            raise ScheduleError(f"action {text.strip()!r}: stage and microbatch indices must be below {MAX_INDEX}")
        return cls(stage, kind, microbatch)

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    @property
    def is_fsdp(self) -> bool:
        return self.kind in FSDP_KINDS


@dataclass
class Schedule:
    """Per-rank action lists plus the stage-to-rank map.

    ``actions[r]`` is rank ``r``'s list in execution order; ``stage_to_rank[s]``
    is the rank that holds stage ``s``. A schedule is *lowered* once it contains
    SEND/RECV actions (see :mod:`.lowering`); generators return unlowered ones.
    """

    actions: list[list[Action]]
    stage_to_rank: list[int]
    n_microbatches: int
    name: str = "custom"
    #: overlapped pairs (torch's ``OVERLAP_F_B``): two compute actions of one rank, next to each other in
    #: its compute order, in execution order. Running them one after the other is always correct; a function
    #: registered for OVERLAP_F_B (``register_custom_function``) gets both at once and may interleave them.
    #: Lowering places a pair's messages as for any two actions; a function that runs the pair as one unit has
    #: both actions' receives waited on before it and their sends after it (``check_deadlock`` checks that
    #: order). Kept by every transformation that keeps the compute order (``with_actions``) and by the CSV
    #: round trip; ``forward_only`` and the text format drop it, and it is left out of ``==``: the order is the
    #: same with or without it.
    overlapped: tuple[tuple[Action, Action], ...] = field(default=(), compare=False)
    #: sequence pieces (Seq1F1B, :mod:`.pieces`): each microbatch index is a unit, piece ``u % pieces`` of
    #: sequence ``u // pieces``, so ``n_microbatches`` counts pieces; 1: whole microbatches. The schedule says
    #: what it runs, so every consumer asks it: ``validate`` checks the pieces' order, a front end that runs
    #: whole microbatches only (the ``Pipe``) refuses it, and the multi-process schedules cut each microbatch
    #: into this many pieces. Kept by every transformation of the schedule (``with_actions``); the text and CSV
    #: formats do not hold it (a schedule read from them is over whole microbatches, unless given again).
    pieces: int = 1

    def with_actions(self, actions: list[list[Action]], **changes: object) -> "Schedule":
        """The same schedule (placement, microbatches, name, pairs, pieces) with other per-rank lists: what every
        transformation returns, so none of them drops what the schedule says about itself."""
        return replace(self, actions=actions, stage_to_rank=list(self.stage_to_rank), **changes)

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    def stages_of(self, rank: int) -> list[int]:
        """The stages held by ``rank``, lowest first."""
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    @property
    def lowered(self) -> bool:
        return any(a.is_comm for acts in self.actions for a in acts)

    @property
    def has_fsdp(self) -> bool:
        """Whether any rank's list places parameters (UNSHARD / RESHARD / REDUCE_GRAD, :mod:`.fsdp`)."""
        return any(a.is_fsdp for acts in self.actions for a in acts)

    def compute_only(self) -> "Schedule":
        """The same schedule with every SEND/RECV and FSDP action dropped (the compute order; pairs kept)."""
        return self.with_actions([[a for a in acts if a.is_compute] for acts in self.actions])

    def to_text(self) -> str:
        """Header line plus one line per rank; :meth:`from_text` reads it back exactly."""
        if not self.name or any(c.isspace() for c in self.name):
            raise ScheduleError(f"schedule name {self.name!r} must be one word to be written as text")
        header = (
            f"# schedule name={self.name} n_microbatches={self.n_microbatches} "
            f"stage_to_rank={','.join(str(r) for r in self.stage_to_rank)}"
        )
        lines = [header] + [" ".join(str(a) for a in acts) for acts in self.actions]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> "Schedule":
        """Parse the text format; raises :class:`ScheduleError` on any malformed input."""
        meta: dict[str, str] = {}
        rank_lines: list[str] = []
        for lineno, raw in enumerate(text.splitlines(), start=1):
            line = raw.strip()
            if line.startswith("#"):
                if line[1:].split()[:1] == ["schedule"]:
                    meta.update(_parse_header(line, lineno))
                continue
            rank_lines.append(line)
        while rank_lines and not rank_lines[-1]:
            rank_lines.pop()
        while rank_lines and not rank_lines[0]:
            rank_lines.pop(0)
        actions: list[list[Action]] = []
        for rank, line in enumerate(rank_lines):
            row = []
            for pos, token in enumerate(line.split()):
                try:
                    row.append(Action.parse(token))
                except ScheduleError as exc:
                    raise ScheduleError(f"rank {rank}, position {pos}: {exc}") from None
            actions.append(row)
        if not actions:
            raise ScheduleError("schedule text has no rank lines")
        stage_to_rank = _header_ints(meta, "stage_to_rank") if "stage_to_rank" in meta else _infer_stages(actions)
        if "n_microbatches" in meta:
            (n_mb,) = _header_ints(meta, "n_microbatches")
        else:
            n_mb = 1 + max((a.microbatch for acts in actions for a in acts), default=-1)
        return cls(actions, stage_to_rank, n_mb, meta.get("name", "custom"))


def _parse_header(line: str, lineno: int) -> dict[str, str]:
    out = {}
    for item in line[1:].split()[1:]:
        key, sep, value = item.partition("=")
        if not sep or key not in ("name", "n_microbatches", "stage_to_rank"):
            raise ScheduleError(f"line {lineno}: bad header item {item!r} (expected name=, n_microbatches=, stage_to_rank=)")
        out[key] = value
    return out


def _header_ints(meta: dict[str, str], key: str) -> list[int]:
    try:
        values = [int(v) for v in meta[key].split(",")]
    except ValueError:
        raise ScheduleError(f"header {key}={meta[key]!r} is not a comma-separated list of integers") from None
    if any(v < 0 for v in values):
        raise ScheduleError(f"header {key}={meta[key]!r} has a negative value")
    if len(values) > MAX_INDEX or any(v > MAX_INDEX for v in values):
        raise ScheduleError(f"header {key}={meta[key][:40]!r}: values and lengths must be at most {MAX_INDEX}")
    return values


def _infer_stages(actions: list[list[Action]]) -> list[int]:
    """Stage-to-rank map from where stages appear; each stage must be on one rank."""
    owner: dict[int, int] = {}
    for rank, acts in enumerate(actions):
        for pos, action in enumerate(acts):
            if owner.setdefault(action.stage, rank) != rank:
                raise ScheduleError(
                    f"rank {rank}, position {pos}: action {action} puts stage {action.stage} on rank {rank}, "
                    f"but it already appears on rank {owner[action.stage]}; a stage lives on exactly one rank"
                )
    n_stages = 1 + max(owner, default=-1)
    missing = [s for s in range(n_stages) if s not in owner]
    if missing:
        raise ScheduleError(f"stages {missing} appear on no rank (stages must be numbered 0..{n_stages - 1})")
    return [owner[s] for s in range(n_stages)]


def done_key(action: Action) -> Action:
    """The event an action completes, as other actions name it.

    A B and an I both complete "the input grad of (stage, microbatch)", so both
    map to the B key; consumers do not care whether the producer split its
    backward.
    """
    kind = ActionKind.B if action.kind is ActionKind.I else action.kind
    return Action(action.stage, kind, action.microbatch)


def dependencies(action: Action, num_stages: int) -> tuple[Action, ...]:
    """The :func:`done_key` events a compute action needs before it can start.

    F needs the previous stage's F of the same microbatch; B or I needs this
    stage's F and the next stage's input grad (the last stage starts from its
    own F); W needs its own I.
    """
    s, kind, j = action
    if kind is ActionKind.F:
        return (Action(s - 1, ActionKind.F, j),) if s > 0 else ()
    if kind is ActionKind.W:
        return (Action(s, ActionKind.B, j),)
    own_forward = Action(s, ActionKind.F, j)
    return (own_forward, Action(s + 1, ActionKind.B, j)) if s < num_stages - 1 else (own_forward,)


def check_structure(schedule: Schedule) -> None:
    """The structural checks every consumer relies on before indexing by stage or rank.

    Lowering and simulation run these too, so malformed input always ends in a
    :class:`ScheduleError` rather than an IndexError deep inside.
    """
    n_ranks, placement = schedule.num_ranks, schedule.stage_to_rank
    if n_ranks == 0 or not placement:
        raise ScheduleError("a schedule needs at least one rank and one stage")
    if schedule.n_microbatches < 1:
        raise ScheduleError(f"n_microbatches must be >= 1 (got {schedule.n_microbatches})")
    for stage, rank in enumerate(placement):
        if not 0 <= rank < n_ranks:
            raise ScheduleError(f"stage {stage} is placed on rank {rank}, but there are ranks 0..{n_ranks - 1}")
    empty = sorted(set(range(n_ranks)) - set(placement))
    if empty:
        raise ScheduleError(f"rank {empty[0]} holds no stage (stage_to_rank={placement})")
    n_stages, n_mb = len(placement), schedule.n_microbatches
    for rank, acts in enumerate(schedule.actions):
        for pos, action in enumerate(acts):
            stage, kind, j = action
            fsdp = kind in FSDP_KINDS
            j_ok = j == NO_MICROBATCH if fsdp else 0 <= j < n_mb
            if 0 <= stage < n_stages and j_ok and placement[stage] == rank:
                continue
            where = f"rank {rank}, position {pos}: action {action}"
            if not 0 <= stage < n_stages:
                raise ScheduleError(f"{where} names stage {stage}, but stages are 0..{n_stages - 1}")
            if fsdp and not j_ok:
                raise ScheduleError(f"{where} names microbatch {j}, but {kind} acts on the whole step: its "
                                    f"microbatch must be NO_MICROBATCH ({NO_MICROBATCH}; Action.fsdp makes one)")
            if not j_ok:
                raise ScheduleError(f"{where} names microbatch {j}, but microbatches are 0..{n_mb - 1}")
            raise ScheduleError(f"{where} belongs on rank {placement[stage]}, which holds stage {stage}")
    check_pairs(schedule)


def check_pairs(schedule: Schedule) -> None:
    """Each overlapped pair: two independent compute actions of one rank, next to each other in its compute order.

    Independent: the second must not need what the first completes (``F(s,j)`` then ``B(s,j)``, ``F(s,j)`` then
    ``F(s+1,j)`` of the same rank, ``I(s,j)`` then ``W(s,j)``). The two halves of a pair run at the same time, so
    the second would read a result the first has not produced yet. A dependency that goes through another rank
    needs a message that leaves only after the pair when it runs as one unit, which :func:`check_deadlock` reports.
    """
    in_pair: set[Action] = set()
    n_stages = len(schedule.stage_to_rank)
    for first, second in schedule.overlapped:
        rows = [r for r, acts in enumerate(schedule.actions) if first in acts]
        row = [a for a in schedule.actions[rows[0]] if a.is_compute] if rows else []
        if not (first.is_compute and second.is_compute and first in row and second in row
                and row.index(second) == row.index(first) + 1):
            raise ScheduleError(f"overlapped pair ({first};{second}): the two must be compute actions of one rank, "
                                "the second right after the first")
        if first in in_pair or second in in_pair:
            raise ScheduleError(f"overlapped pair ({first};{second}): an action is in two pairs")
        if done_key(first) in dependencies(second, n_stages):
            raise ScheduleError(f"overlapped pair ({first};{second}): {second} needs what {first} completes, but the "
                                "two halves of a pair run at the same time; pair actions that do not depend on each "
                                "other")
        in_pair.update((first, second))
