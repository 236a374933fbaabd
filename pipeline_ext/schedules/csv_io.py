"""Schedules in torch.distributed.pipelining's CSV format (its ``_dump_csv`` / ``_load_csv``).

One row per rank, one action per cell, spelled as torch spells them (``0F1``,
``1I0``, ``2W3``, ``0SEND_F1``, ``0UNSHARD``: the same spelling as our text
format). An empty cell is torch's idle slot. torch's FSDP actions (UNSHARD,
RESHARD, REDUCE_GRAD) are read as ours (:mod:`.fsdp`) and written back in
``compute_comms``, the format of a rank's whole list; ``compute_only``
writes the compute actions alone, since torch's loader places its own FSDP
actions and messages around those. An
overlapped pair ``(0F1;1B0)OVERLAP_F_B`` becomes its actions in order, and is
kept as a pair (``Schedule.overlapped``): a function registered for
OVERLAP_F_B gets both at once, and writing the schedule back spells the pair
as torch does.
"""
from __future__ import annotations

import csv
from typing import Any, Optional, Sequence

from pipeline_ext.schedules.ir import OVERLAP_F_B, Action, Schedule, ScheduleError, check_pairs
from pipeline_ext.schedules.lowering import as_units

__all__ = ["dump_csv", "load_csv", "from_cells", "torch_order", "torch_action", "FORMATS"]

FORMATS = ("compute_only", "compute_comms")


def _grouped(schedule: Schedule, acts: Sequence[Action]) -> list[tuple[Action, ...]]:
    """A rank's actions, each overlapped pair as one group (its two actions), every other action alone."""
    second_of = dict(schedule.overlapped)
    out: list[tuple[Action, ...]] = []
    for a in acts:
        if out and second_of.get(out[-1][0]) == a and len(out[-1]) == 1:
            out[-1] = (out[-1][0], a)
        else:
            out.append((a,))
    return out


def dump_csv(schedule: Schedule, path: str, format: str = "compute_only") -> None:
    """Write torch's CSV (pairs as ``(a;b)OVERLAP_F_B``): every rank's compute actions (``compute_only``), or
    its whole list, messages and FSDP actions included (``compute_comms``).

    In ``compute_comms`` a pair is one cell, as torch runs it, so the messages lowered between its halves are
    written around it (``lowering.as_units``: receives before, sends after); reading the file back gives that
    order, which is the lowered one wherever no message lies between a pair's halves.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    rows = as_units(schedule).actions if format == "compute_comms" else schedule.actions
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        for acts in rows:
            groups = _grouped(schedule, [a for a in acts if a.is_compute or format == "compute_comms"])
            writer.writerow([str(g[0]) if len(g) == 1 else f"({g[0]};{g[1]}){OVERLAP_F_B}" for g in groups])


def torch_action(group: Sequence[Action]) -> Any:
    """torch's ``_Action`` for an action, or for an overlapped pair (stage -1, forward first, as torch has it).

    The spelling is shared, so each action is converted through its string.
    """
    from torch.distributed.pipelining.schedules import OVERLAP_F_B as TORCH_OVERLAP_F_B, _Action

    if len(group) == 1:
        return _Action.from_str(str(group[0]))
    # torch's pair: stage -1, no microbatch, the forward first (torch's sub-action order)
    subs = sorted((_Action.from_str(str(a)) for a in group), key=lambda a: not str(a).endswith(f"F{a.microbatch_index}"))
    return _Action(-1, TORCH_OVERLAP_F_B, None, tuple(subs))


def torch_order(schedule: Schedule, compute_only: bool = True) -> dict[int, list[Any]]:
    """Every rank's compute actions (or all its actions) as torch's ``_Action`` objects (torch's ``pipeline_order``).

    torch code reads an order with ``action.computation_type`` and compares
    it with ``_Action(stage, F, mb)`` (``torch_action`` makes each).
    """
    return {r: [torch_action(g) for g in _grouped(schedule, [a for a in acts if a.is_compute or not compute_only])]
            for r, acts in enumerate(schedule.actions)}


def _cell(text: str, rank: int, col: int, pairs: Optional[list] = None) -> list[Action]:
    text = text.strip()
    if not text or text == "None":
        return []
    if text.startswith("("):
        inner, _, kind = text[1:].partition(")")
        if kind != OVERLAP_F_B:
            raise ScheduleError(f"rank {rank}, column {col}: unknown grouped action {text!r}")
        acts = [a for part in inner.split(";") for a in _cell(part, rank, col)]
        if pairs is not None and len(acts) == 2:
            pairs.append((acts[0], acts[1]))
        return acts
    try:
        return [Action.parse(text)]
    except ScheduleError as exc:
        raise ScheduleError(f"rank {rank}, column {col}: {exc}") from None


def load_csv(path: str, format: str = "compute_only", n_microbatches: Optional[int] = None,
             name: str = "csv") -> Schedule:
    """Read torch's CSV into a ``Schedule`` (stage placement inferred from where each stage appears).

    ``compute_only`` rows hold no messages (the sends and receives are added
    by lowering; FSDP actions are allowed, they are rank-local);
    ``compute_comms`` rows hold every action, and are used as given.
    """
    with open(path, newline="") as f:
        rows = [row for row in csv.reader(f)]
    return from_cells(rows, format, n_microbatches, name, where=str(path))


def from_cells(rows: Sequence[Sequence[Any]], format: str = "compute_only", n_microbatches: Optional[int] = None,
               name: str = "custom", where: str = "pipeline_order") -> Schedule:
    """A ``Schedule`` from per-rank cells: torch's action strings, torch's ``_Action`` objects, ours, or None.

    What torch's CSV and a torch-style ``pipeline_order`` assignment both give.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    pairs: list[tuple[Action, Action]] = []
    actions = [[a for col, cell in enumerate(row) for a in _cell("" if cell is None else str(cell), rank, col, pairs)]
               for rank, row in enumerate(rows)]
    while actions and not actions[-1]:
        actions.pop()
    if not actions:
        raise ScheduleError(f"{where}: no actions")
    if format == "compute_only":
        comm = [(r, str(a)) for r, acts in enumerate(actions) for a in acts if a.is_comm]
        if comm:
            raise ScheduleError(f"{where}: format 'compute_only' but rank {comm[0][0]} has {comm[0][1]}; "
                                "use format='compute_comms'")
    text = "\n".join(" ".join(str(a) for a in acts) for acts in actions)
    schedule = Schedule.from_text(text)
    found = schedule.n_microbatches
    if n_microbatches is not None and found != n_microbatches:
        raise ScheduleError(f"{where} has {found} microbatches, the schedule is for n_microbatches={n_microbatches}")
    result = schedule.with_actions(schedule.actions, name=name, overlapped=tuple(pairs))
    check_pairs(result)
    return result
