"""Sequence pieces as scheduling units (Seq1F1B): each microbatch cut into K pieces along its sequence.

Why: a long-context microbatch is one long sequence, so there are few of
them, a large bubble, and every microbatch in flight holds a whole sequence
of activations. Cut into K pieces that the pipeline schedules one by one,
the bubble is that of K times as many (smaller) units and a rank holds
activations of pieces, not sequences: 1F1B's rank 0 holds p sequences,
Seq1F1B's (p + K - 1) pieces, (p + K - 1) / (p K) of it.

Units: piece k of microbatch j is unit ``j * K + k`` in the schedule's
microbatch index (``Schedule.n_microbatches`` counts units, so message tags,
step signatures and the memory promise count pieces). Causal attention makes
piece k read the keys and values of pieces 0..k-1 of the same sequence
(``pipeline_ext.seqchunks``), so on every stage the forwards of a sequence's
pieces run in piece order and its backwards (B or I) in reverse piece order:
piece k's backward adds the gradients that later pieces sent back to its keys
and values, which exist only once those pieces' backwards ran. A W has no
such order (it needs only its own piece's graph).

The orders: 1F1B and ZB-H1 with ``p - 1 - r + K - 1`` warm-up forwards on
rank r (the last rank must have all K pieces of the first sequence forwarded
before that sequence's last piece can start its backward), interleaved 1F1B
with the same K - 1 more; every other schedule is refused by name.
"""
from __future__ import annotations

from pipeline_ext.schedules.ir import Action, ActionKind, Schedule, ScheduleError
from pipeline_ext.schedules.lowering import loop_placement
from pipeline_ext.schedules.orders import depth_first, interleaved_rounds, pipeline_order, split_backward_of

__all__ = ["PIECE_SCHEDULES", "build_pieces", "piece_of", "unit_of", "check_piece_order"]

F, B = ActionKind.F, ActionKind.B

#: the built-in schedules that run sequence pieces, and the stages per rank each uses by default
PIECE_SCHEDULES = {"1f1b": 1, "zb_h1": 1, "interleaved_1f1b": 2}


def unit_of(microbatch: int, piece: int, pieces: int) -> int:
    """The schedule's microbatch index of ``piece`` of ``microbatch`` (K = ``pieces``)."""
    return microbatch * pieces + piece


def piece_of(unit: int, pieces: int) -> tuple[int, int]:
    """(microbatch, piece) of a unit of a schedule over ``pieces`` pieces per microbatch."""
    return divmod(unit, pieces)


def _backward_units(units: list[tuple[int, int]], pieces: int) -> list[tuple[int, int]]:
    """A backward order over (stage, unit), with each sequence's pieces reversed in place: the slots a base order
    gives sequence j on a stage are taken by its pieces last to first."""
    return [(s, u - u % pieces + (pieces - 1 - u % pieces)) for s, u in units]


def build_pieces(name: str, num_ranks: int, n_microbatches: int, pieces: int,
                 stages_per_rank: int | None = None) -> Schedule:
    """The built-in ``name`` over ``n_microbatches`` sequences of ``pieces`` pieces each (unlowered).

    ``n_microbatches`` counts sequences; the schedule's ``n_microbatches`` is
    their pieces (``n_microbatches * pieces``). ``pieces=1`` gives the
    built-in itself, in the same order.
    """
    if name not in PIECE_SCHEDULES:
        raise ScheduleError(f"schedule {name!r} does not run sequence pieces (seq_chunks); those that do: "
                            f"{', '.join(sorted(PIECE_SCHEDULES))}")
    if isinstance(pieces, bool) or not isinstance(pieces, int) or pieces < 1:
        raise ScheduleError(f"seq_chunks must be a positive int, got {pieces!r}")
    p, m, k = num_ranks, n_microbatches, pieces
    v = PIECE_SCHEDULES[name] if stages_per_rank is None else stages_per_rank
    if name != "interleaved_1f1b" and v != 1:
        raise ScheduleError(f"{name} with seq_chunks needs stages_per_rank == 1 (got {v})")
    if m < p and name != "interleaved_1f1b":
        raise ScheduleError(f"{name} needs n_microbatches >= num_ranks (got n_microbatches={m}, num_ranks={p})")
    n = m * k
    label = f"{name}[seq_chunks={k}]" if k > 1 else name

    if name == "interleaved_1f1b":
        rounds, g = interleaved_rounds(p, m)
        if m % rounds:
            raise ScheduleError(f"interleaved_1f1b needs n_microbatches to be a multiple of its rounds, "
                                f"max(1, n_microbatches // num_ranks) (got n_microbatches={m}, num_ranks={p})")

        def rank(r: int) -> list[Action]:
            fwd = [Action(s, F, u) for s, u in depth_first(r, p, v, n, reverse=False, group=g * k)]
            order = _backward_units(list(depth_first(r, p, v, n, reverse=True, group=g * k)), k)
            return pipeline_order(fwd, [[Action(s, B, u)] for s, u in order],
                                  warmup=min((p - 1 - r) * 2 + (v - 1) * g * k + k - 1, n * v))

        return Schedule([rank(r) for r in range(p)], loop_placement(p, v), n, label)

    def single(r: int) -> list[Action]:
        fwd = [Action(r, F, u) for u in range(n)]
        order = _backward_units([(r, u) for u in range(n)], k)
        bwd = split_backward_of(order, lag=r) if name == "zb_h1" else [[Action(s, B, u)] for s, u in order]
        return pipeline_order(fwd, bwd, warmup=p - 1 - r + k - 1)

    return Schedule([single(r) for r in range(p)], loop_placement(p, 1), n, label)


def check_piece_order(schedule: Schedule, pieces: int) -> None:
    """Raise :class:`ScheduleError` where a stage runs a sequence's forwards out of piece order or its backwards
    (B or I) out of reverse piece order (the carried keys and values need both)."""
    if pieces <= 1:
        return
    if schedule.n_microbatches % pieces:
        raise ScheduleError(f"schedule {schedule.name!r} has {schedule.n_microbatches} units, not a multiple of "
                            f"seq_chunks={pieces}")
    for rank, acts in enumerate(schedule.actions):
        last: dict[tuple[int, str, int], tuple[int, int]] = {}
        for pos, a in enumerate(acts):
            if a.kind not in (ActionKind.F, ActionKind.B, ActionKind.I):
                continue
            kind = "F" if a.kind == ActionKind.F else "B"
            seq, piece = piece_of(a.microbatch, pieces)
            key = (a.stage, kind, seq)
            want = (piece - 1) if kind == "F" else (piece + 1)
            seen = last.get(key)
            expected_first = 0 if kind == "F" else pieces - 1
            if (seen is None and piece != expected_first) or (seen is not None and seen[0] != want):
                order = "in piece order" if kind == "F" else "in reverse piece order"
                before = "none" if seen is None else f"piece {seen[0]} at position {seen[1]}"
                raise ScheduleError(
                    f"schedule {schedule.name!r}, rank {rank}, position {pos} ({a}): sequence {seq}'s "
                    f"{'forwards' if kind == 'F' else 'backwards'} on stage {a.stage} must run {order} (piece "
                    f"{piece} after {before}): causal attention carries keys and values between pieces")
            last[key] = (piece, pos)
