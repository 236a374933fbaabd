"""Command line: ``python -m pipeline_ext.schedules show|compare ...``.

Choosing a schedule means looking at bubbles and memory for *your* p, m and
costs; this puts the generators, the simulator and the renderers one command
away, without torch or devices::

    python -m pipeline_ext.schedules show zb_h1 --ranks 4 --microbatches 8 [--png f.png] [--trace t.json]
    python -m pipeline_ext.schedules compare --ranks 4 --microbatches 8 [--costs 1,1,1,0]
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional, Sequence

from pipeline_ext.schedules.builtin import available, build
from pipeline_ext.schedules.ir import ScheduleError
from pipeline_ext.schedules.lowering import lower
from pipeline_ext.schedules.render import LEGEND, render_ascii, render_png, to_chrome_trace
from pipeline_ext.schedules.simulate import Costs, SimResult, simulate
from pipeline_ext.schedules.validate import validate

# Bounds of the command line: a simulation is O(ranks x stages x microbatches), so larger values would run
# for minutes before printing anything.
MAX_RANKS, MAX_MICROBATCHES, MAX_STAGES_PER_RANK = 1024, 4096, 64


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


def _costs_text(costs: Costs) -> str:
    return f"f={costs.f:g} b={costs.b:g} w={costs.w:g} comm={costs.comm:g}"


def _run(name: str, ranks: int, microbatches: int, stages_per_rank: Optional[int], costs: Costs) -> SimResult:
    schedule = build(name, ranks, microbatches, stages_per_rank)
    validate(lower(schedule))  # what the runtime would execute: deadlock- and FIFO-checked
    return simulate(schedule, costs)


def show(args: argparse.Namespace) -> int:
    res = _run(args.name, args.ranks, args.microbatches, args.stages_per_rank, args.costs)
    sched = res.schedule
    print(f"{sched.name}: {sched.num_ranks} ranks, {sched.num_stages} stages, "
          f"{sched.n_microbatches} microbatches, costs {_costs_text(args.costs)}")
    print(render_ascii(res), end="")
    print(f"({LEGEND})")
    print(f"makespan {res.makespan:g}, bubble rate {res.bubble_rate:.4f}")
    for rank in range(sched.num_ranks):
        print(f"rank {rank}: bubble {res.bubble_rate_per_rank[rank]:.4f}, "
              f"peak activations {res.peak_activations[rank]}")
    if args.png:
        render_png(res, args.png)
        print(f"wrote {args.png}")
    if args.trace:
        to_chrome_trace(res, args.trace)
        print(f"wrote {args.trace}")
    return 0


def compare(args: argparse.Namespace) -> int:
    """One row per built-in at equal model cost: a schedule with v stages per rank runs each stage at cost/v."""
    print(f"{args.ranks} ranks, {args.microbatches} microbatches, costs per rank's share of the model "
          f"{_costs_text(args.costs)}")
    print("(schedules with v stages per rank run each stage at 1/v of the cost; memory is in units of one "
          "microbatch's activations of a rank's whole share)")
    header = f"{'schedule':<18}{'stages':>7}{'makespan':>10}{'bubble':>9}{'peak memory rank 0 / max':>27}"
    print(header)
    print("-" * len(header))
    for name in available():
        try:
            stages_per_rank = len(build(name, args.ranks, args.microbatches).stages_of(0))
            res = _run(name, args.ranks, args.microbatches, None, args.costs.per_stage_of(stages_per_rank))
        except ScheduleError as exc:
            print(f"{name:<18}  n/a: {exc}")
            continue
        peak = f"{res.peak_activations[0] / stages_per_rank:g} / {max(res.peak_activations) / stages_per_rank:g}"
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
