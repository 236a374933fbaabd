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
A schedule over pieces says so (``Schedule.pieces``); ``check_piece_order``
(also ``validate``) checks the order constraints of any schedule over pieces.

The cut and its costs: later pieces attend to more keys, so equal lengths
are unequal costs, and in a pipeline the most expensive piece sets the pace.
``piece_lengths`` cuts a sequence into equal lengths or into lengths of equal
cost under the model: the cost of positions 0..x (x a fraction of the
length) is ``a x^2 + (1 - a) x``, where ``a`` is causal attention's share of
the cost of the whole sequence and the rest (matrix products, norms) grows
with the length. For a transformer whose layers have ``P`` weights in matrix
products and attention ``w`` wide (query heads x head size), the forward's
multiply-adds are ``L^2 w`` in causal attention (two products over the
``L^2 / 2`` causal pairs) and ``L P`` in the rest: ``a = L w / (L w + P)``
(``attention_share``). ``piece_costs`` gives the simulator each piece's
cost under the same model (``Costs.pieces``); a traced step measures them
(``runtime/trace.measure_costs``).
"""
from __future__ import annotations

import math
from typing import Sequence, Union

from pipeline_ext.schedules.ir import Action, ActionKind, Schedule, ScheduleError
from pipeline_ext.schedules.lowering import loop_placement
from pipeline_ext.schedules.orders import depth_first, interleaved_rounds, pipeline_order, split_backward_of

__all__ = ["PIECE_SCHEDULES", "build_pieces", "piece_of", "unit_of", "check_piece_order",
           "attention_share", "piece_lengths", "piece_costs", "piece_sizes"]

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
    their pieces (``n_microbatches * pieces``), and its ``pieces`` is ``pieces``. ``pieces=1`` gives the
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
    label = f"{name}[seq_chunks={k}]" if k > 1 else name  # for people; the schedule's ``pieces`` says it

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

        return Schedule([rank(r) for r in range(p)], loop_placement(p, v), n, label, pieces=k)

    def single(r: int) -> list[Action]:
        fwd = [Action(r, F, u) for u in range(n)]
        order = _backward_units([(r, u) for u in range(n)], k)
        bwd = split_backward_of(order, lag=r) if name == "zb_h1" else [[Action(s, B, u)] for s, u in order]
        return pipeline_order(fwd, bwd, warmup=p - 1 - r + k - 1)

    return Schedule([single(r) for r in range(p)], loop_placement(p, 1), n, label, pieces=k)


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


def attention_share(split: Union[str, float, None] = None, *, length: int = 0, width: int = 0,
                    matmul_params: int = 0) -> float:
    """Causal attention's share ``a`` of the cost of a whole sequence (module doc).

    Of a ``seq_split``: "equal" is 0, "balanced" 1 (attention alone), a float
    in [0, 1] itself. Or of a transformer: ``length`` positions, attention
    ``width`` wide (query heads x head size) and ``matmul_params`` weights in
    each layer's matrix products: ``length * width / (length * width +
    matmul_params)``.
    """
    if split is None:
        if length <= 0 or width <= 0 or matmul_params < 0:
            raise ValueError(f"attention_share needs a seq_split, or length > 0, width > 0 and matmul_params >= 0 "
                             f"(got length={length}, width={width}, matmul_params={matmul_params})")
        return length * width / (length * width + matmul_params)
    if isinstance(split, str) and split in ("equal", "balanced"):
        return 0.0 if split == "equal" else 1.0
    if isinstance(split, bool) or not isinstance(split, (int, float)) or not 0.0 <= split <= 1.0:
        raise ValueError(f"seq_split must be 'equal', 'balanced' or causal attention's share of the cost of a "
                         f"whole sequence, a float in [0, 1]; got {split!r}")
    return float(split)


def piece_lengths(length: int, pieces: int, split: Union[str, float] = "equal") -> list[int]:
    """The K lengths a sequence of ``length`` is cut into (``split``: "equal", "balanced" or attention's share
    of the cost, module doc)."""
    a = attention_share(split)
    if length < pieces:
        raise ValueError(f"a sequence of {length} positions cannot be cut into seq_chunks={pieces} pieces")

    def position(t: float) -> float:  # x in [0, 1] where a x^2 + (1 - a) x = t
        return t if a == 0.0 else (-(1.0 - a) + math.sqrt((1.0 - a) ** 2 + 4.0 * a * t)) / (2.0 * a)

    ends = [round(length * position((k + 1) / pieces)) for k in range(pieces)]
    lengths, start = [], 0
    for k, end in enumerate(ends):
        end = max(end, start + 1)
        end = min(end, length - (pieces - 1 - k))  # every later piece keeps at least one position
        lengths.append(end - start)
        start = end
    return lengths


def _check_lengths(lengths: Sequence[int]) -> None:
    if not lengths or any(n <= 0 for n in lengths):
        raise ValueError(f"piece lengths must be positive, got {list(lengths)}")


def _cost(x: float, a: float) -> float:
    """The cost of positions 0..x (x a fraction of the sequence) under the model of the module doc."""
    return a * x * x + (1.0 - a) * x


def piece_costs(lengths: Sequence[int], split: Union[str, float] = "equal") -> list[float]:
    """Each piece's compute cost relative to the mean piece's (mean 1), under the cost model with attention's
    share ``split`` (as ``attention_share`` takes it): what ``Costs.pieces`` charges piece k's F, B, I and W."""
    a = attention_share(split)
    _check_lengths(lengths)
    total = sum(lengths)
    ends = [sum(lengths[:k + 1]) / total for k in range(len(lengths))]
    costs = [_cost(e, a) - _cost(e - n / total, a) for e, n in zip(ends, lengths)]
    return [c * len(costs) / sum(costs) for c in costs]


def piece_sizes(lengths: Sequence[int]) -> list[float]:
    """Each piece's activations relative to the mean piece's (mean 1): activations grow with the positions (the
    piece attention saves q, k, v, its output and the log-sum-exp, no positions x keys matrix)."""
    _check_lengths(lengths)
    return [n * len(lengths) / sum(lengths) for n in lengths]
