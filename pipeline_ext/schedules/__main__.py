"""Command line: ``python -m pipeline_ext.schedules show|compare ...``.

Choosing a schedule means looking at bubbles and memory for *your* p, m and
costs; this puts the generators, the simulator and the renderers one command
away, without torch or devices::

    python -m pipeline_ext.schedules show zb_h1 --ranks 4 --microbatches 8 [--png f.png] [--trace t.json]
    python -m pipeline_ext.schedules compare --ranks 4 --microbatches 8 [--costs 1,1,1,0]
    python -m pipeline_ext.schedules show 1f1b -p 4 -m 8 --seq-chunks 4 [--seq-split 0.6] [--attention-share 0.6]

``--seq-chunks K`` (Seq1F1B, ``pieces.py``) cuts each microbatch into K
pieces along its sequence, so that the bubble and the memory of the cut can
be seen before a run: the schedule is built over pieces, validated with
their order constraints and simulated with each piece's cost under the cost
model (``--costs`` stay those of a whole microbatch, a piece costs its
share of them).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Callable, Optional, Sequence, Union

from pipeline_ext.schedules.builtin import available, build
from pipeline_ext.schedules.ir import Schedule, ScheduleError
from pipeline_ext.schedules.lowering import lower
from pipeline_ext.schedules.pieces import (PIECE_SCHEDULES, attention_share, build_pieces, piece_costs,
                                           piece_lengths, piece_sizes)
from pipeline_ext.schedules.render import LEGEND, render_ascii, render_png, to_chrome_trace
from pipeline_ext.schedules.simulate import Costs, SimResult, simulate
from pipeline_ext.schedules.validate import validate

# Bounds of the command line: a simulation is O(ranks x stages x microbatches), so larger values would run
# for minutes before printing anything.
MAX_RANKS, MAX_MICROBATCHES, MAX_STAGES_PER_RANK = 1024, 4096, 64
#: sequence pieces per microbatch; microbatches x pieces (the units simulated) is held to MAX_MICROBATCHES too
MAX_SEQ_CHUNKS = 64
#: the length the cut is taken at: the command line has no sequence length, and a real one only rounds the cut
_CUT_RESOLUTION = 1_000_000


def _count(most: int) -> "Callable[[str], int]":
    """An argparse type: an integer from 1 to ``most`` (a huge value would run for minutes, not fail)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not 1 <= value <= most:
            raise argparse.ArgumentTypeError(f"{value} is not between 1 and {most}")
        return value
    return parse


def _costs(text: str) -> Costs:
    """An argparse type: four finite, non-negative costs."""
    try:
        return Costs.parse(text)
    except ScheduleError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seq_split(text: str) -> Union[str, float]:
    """An argparse type: a seq_split, "equal", "balanced" or causal attention's share of the cost, in [0, 1]."""
    split: Union[str, float] = text
    if text not in ("equal", "balanced"):
        try:
            split = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not 'equal', 'balanced' or a number in [0, 1]") from None
    try:
        attention_share(split)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return split


def _fraction(text: str) -> float:
    """An argparse type: causal attention's share of the cost of a whole sequence, a number in [0, 1]."""
    try:
        return attention_share(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number in [0, 1]") from None


def _costs_text(costs: Costs) -> str:
    return f"f={costs.f:g} b={costs.b:g} w={costs.w:g} comm={costs.comm:g}"


class _Pieces:
    """The sequence pieces of a run: K, how the sequence is cut (``seq_split``) and what the model's attention
    costs (``attention_share``, by default what the cut assumes, so pieces of equal cost).

    A piece's costs are the microbatch's ``costs`` times its weight / K (``piece_costs``, mean 1): a run over
    pieces does the work of the same microbatches, so its makespan compares with the run without pieces.
    Transfers keep their cost, as they do across stages (``Costs.per_stage_of``).
    """

    def __init__(self, k: int, split: Union[str, float], share: Optional[float]) -> None:
        self.k, self.split = k, split
        self.share = attention_share(split) if share is None else share
        lengths = piece_lengths(_CUT_RESOLUTION, k, split)
        #: each piece's share of the sequence's length, and its cost and activations relative to the mean piece's
        self.lengths = [n / _CUT_RESOLUTION for n in lengths]
        self.costs, self.sizes = piece_costs(lengths, self.share), piece_sizes(lengths)

    def of(self, costs: Costs) -> Costs:
        return costs if self.k == 1 else replace(costs.per_stage_of(self.k), pieces=self.costs)

    def text(self) -> str:
        return (f"seq_chunks={self.k}, seq_split={self.split}, attention share {self.share:g}: piece lengths "
                f"{' '.join(f'{x:.3f}' for x in self.lengths)}, costs {' '.join(f'{x:.3f}' for x in self.costs)} "
                f"(x f,b,w / {self.k})")

    def sequences(self, res: SimResult) -> list[float]:
        """Per rank, the most activations alive at once in whole microbatches (sequences)."""
        return res.peak_bytes(1.0 / self.k, self.sizes)


def _build(name: str, ranks: int, microbatches: int, stages_per_rank: Optional[int], k: int) -> Schedule:
    if k == 1:
        return build(name, ranks, microbatches, stages_per_rank)
    if microbatches * k > MAX_MICROBATCHES:
        raise ScheduleError(f"{microbatches} microbatches x seq_chunks={k} is {microbatches * k} pieces to "
                            f"simulate, more than {MAX_MICROBATCHES}")
    return build_pieces(name, ranks, microbatches, k, stages_per_rank)


def _run(name: str, ranks: int, microbatches: int, stages_per_rank: Optional[int], costs: Costs,
         pieces: _Pieces) -> SimResult:
    schedule = _build(name, ranks, microbatches, stages_per_rank, pieces.k)
    # what the runtime would execute: deadlock- and FIFO-checked, and over pieces their order
    validate(lower(schedule), pieces=pieces.k)
    return simulate(schedule, pieces.of(costs))


def _pieces(args: argparse.Namespace) -> _Pieces:
    if args.seq_chunks == 1 and (args.seq_split != "equal" or args.attention_share is not None):
        raise ScheduleError("--seq-split and --attention-share describe sequence pieces: give --seq-chunks K > 1")
    return _Pieces(args.seq_chunks, args.seq_split, args.attention_share)


def show(args: argparse.Namespace) -> int:
    pieces = _pieces(args)
    res = _run(args.name, args.ranks, args.microbatches, args.stages_per_rank, args.costs, pieces)
    sched = res.schedule
    if pieces.k == 1:
        print(f"{sched.name}: {sched.num_ranks} ranks, {sched.num_stages} stages, "
              f"{sched.n_microbatches} microbatches, costs {_costs_text(args.costs)}")
    else:
        print(f"{sched.name}: {sched.num_ranks} ranks, {sched.num_stages} stages, {args.microbatches} "
              f"microbatches of {pieces.k} pieces (unit u is piece u % {pieces.k}), costs per microbatch "
              f"{_costs_text(args.costs)}")
        print(pieces.text())
    print(render_ascii(res), end="")
    print(f"({LEGEND})")
    print(f"makespan {res.makespan:g}, bubble rate {res.bubble_rate:.4f}")
    sequences = pieces.sequences(res) if pieces.k > 1 else []
    for rank in range(sched.num_ranks):
        peak = (f"{res.peak_activations[rank]}" if pieces.k == 1 else
                f"{res.peak_activations[rank]} pieces, {round(sequences[rank], 3):g} microbatches")
        print(f"rank {rank}: bubble {res.bubble_rate_per_rank[rank]:.4f}, peak activations {peak}")
    if args.png:
        render_png(res, args.png)
        print(f"wrote {args.png}")
    if args.trace:
        to_chrome_trace(res, args.trace)
        print(f"wrote {args.trace}")
    return 0


def compare(args: argparse.Namespace) -> int:
    """One row per built-in at equal model cost: a schedule with v stages per rank runs each stage at cost/v.

    With ``--seq-chunks K``, one row per built-in that runs pieces (the others cannot)."""
    pieces = _pieces(args)
    print(f"{args.ranks} ranks, {args.microbatches} microbatches, costs per rank's share of the model "
          f"{_costs_text(args.costs)}")
    if pieces.k > 1:
        print(f"{pieces.text()}; the schedules that run pieces")
    print("(schedules with v stages per rank run each stage at 1/v of the cost; memory is in units of one "
          "microbatch's activations of a rank's whole share)")
    header = f"{'schedule':<18}{'stages':>7}{'makespan':>10}{'bubble':>9}{'peak memory rank 0 / max':>27}"
    print(header)
    print("-" * len(header))
    for name in available():
        if pieces.k > 1 and name not in PIECE_SCHEDULES:
            continue
        try:
            stages_per_rank = len(_build(name, args.ranks, args.microbatches, None, pieces.k).stages_of(0))
            res = _run(name, args.ranks, args.microbatches, None, args.costs.per_stage_of(stages_per_rank), pieces)
        except ScheduleError as exc:
            print(f"{name:<18}  n/a: {exc}")
            continue
        held = [float(n) for n in res.peak_activations] if pieces.k == 1 else pieces.sequences(res)
        peak = f"{round(held[0] / stages_per_rank, 3):g} / {round(max(held) / stages_per_rank, 3):g}"
        print(f"{name:<18}{res.schedule.num_stages:>7}{res.makespan:>10g}{res.bubble_rate:>9.4f}{peak:>27}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline_ext.schedules",
                                     description="Generate, simulate and draw pipeline schedules.")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--ranks", "-p", type=_count(MAX_RANKS), required=True, help="pipeline ranks (devices)")
        p.add_argument("--microbatches", "-m", type=_count(MAX_MICROBATCHES), required=True,
                       help="microbatches per step")
        p.add_argument("--costs", type=_costs, default=Costs(), metavar="F,B,W,C",
                       help="per-stage cost of F, B (input grad), W (weight grad) and one transfer; default 1,1,1,0")
        p.add_argument("--seq-chunks", "-k", type=_count(MAX_SEQ_CHUNKS), default=1, metavar="K",
                       help=f"cut each microbatch into K sequence pieces (Seq1F1B: {', '.join(sorted(PIECE_SCHEDULES))})"
                            "; a piece costs its share of --costs")
        p.add_argument("--seq-split", type=_seq_split, default="equal", metavar="SPLIT",
                       help="how the sequence is cut: equal (lengths), balanced (cost, attention alone) or "
                            "attention's share of the cost in [0, 1]; default equal")
        p.add_argument("--attention-share", type=_fraction, default=None, metavar="A",
                       help="causal attention's share of the cost of a whole sequence in the model, which prices "
                            "each piece; default: the share --seq-split cuts for")

    s = sub.add_parser("show", help="timeline, bubble rate and peak memory of one schedule")
    s.add_argument("name", choices=available())
    common(s)
    s.add_argument("--stages-per-rank", "-v", type=_count(MAX_STAGES_PER_RANK), default=None,
                   help="for interleaved/looped schedules")
    s.add_argument("--png", help="also draw the timeline to this PNG file (needs matplotlib)")
    s.add_argument("--trace", help="also write a Chrome trace (open in Perfetto)")
    s.set_defaults(func=show)
    c = sub.add_parser("compare", help="one row per built-in schedule")
    common(c)
    c.set_defaults(func=compare)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except ScheduleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
