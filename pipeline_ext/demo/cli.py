"""``python -m pipeline_ext.demo``: watch a pipeline train a small GPT on your CPU.

One command, no ``torchrun``: it starts its own worker processes (one per
pipeline rank, Gloo on 127.0.0.1, a free port, timeouts, clean shutdown),
trains a small GPT-style model (``demo/model.py``) on synthetic arithmetic token
sequences under the chosen schedule, and shows what a user wants to see: a
progress bar, the loss of every step (it falls), tokens/s, the bubble measured
by the tracer next to the simulator's prediction at the measured costs, and a
timeline PNG of a measured step.

    python -m pipeline_ext.demo --schedule 1f1b --stages 2 --microbatches 4 --steps 30 --png demo.png
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Optional

import torch

from pipeline_ext.demo.model import GPTConfig, gpt_stages, lm_loss, synthetic_batch

__all__ = ["main", "train"]

def train(rank: int, world: int, opts: dict[str, Any]) -> Optional[dict[str, Any]]:
    """One worker rank: build its stages, train, trace the last steps; the last stage's rank reports."""
    import pipeline_ext as pe
    from pipeline_ext import schedules as S

    cfg = GPTConfig(layers=opts["layers"])
    name, m, steps = opts["schedule"], opts["microbatches"], opts["steps"]
    v = S.default_stages_per_rank(name)
    placement = S.build(name, world, m, stages_per_rank=v).stage_to_rank
    modules = gpt_stages(cfg, len(placement))
    mine = [s for s, r in enumerate(placement) if r == rank]
    stages = [pe.PipelineStage(modules[s], s, len(placement), "cpu") for s in mine]
    sched = pe.PipelineSchedule(stages, name, m, loss_fn=lm_loss)
    opt = torch.optim.Adam([p for s in mine for p in modules[s].parameters()], lr=opts["lr"])
    first, last = 0 in mine, len(placement) - 1 in mine
    bar = _progress(steps) if last else None
    losses_per_step: list[float] = []
    traced_from = max(1, steps - opts["trace_steps"])  # step 0 exchanges shapes: leave it out
    timed_from = min(1, steps - 1)
    t_start = time.perf_counter()
    for step in range(steps):
        if step == timed_from:
            t_start = time.perf_counter()
        if step == traced_from:
            sched.enable_tracing()
        x, y = synthetic_batch(cfg, opts["batch"], step)
        losses: list[torch.Tensor] = []
        opt.zero_grad(set_to_none=True)
        sched.step(*((x,) if first else ()), target=y if last else None, losses=losses if last else None)
        opt.step()
        if bar is not None:
            loss = float(torch.stack(losses).mean())
            losses_per_step.append(loss)
            bar.write(f"step {step + 1:3d}/{steps}  loss {loss:.4f}")
            bar.set_postfix(loss=f"{loss:.3f}")
            bar.update(1)
    elapsed = time.perf_counter() - t_start
    if bar is not None:
        bar.close()
    report = sched.trace_report(dst=placement[-1]) if traced_from < steps else None
    if not last:
        return None
    out = {"losses": losses_per_step, "tokens_per_s": opts["batch"] * cfg.seq_len * (steps - timed_from) / elapsed,
           "report": None}
    if report is not None:
        out["report"] = report.summary()
        out["measured_bubble"], out["simulated_bubble"] = report.measured_bubble, report.simulated_bubble
        if opts["png"]:
            report.write_png(opts["png"])
        if opts["trace_json"]:
            report.write_chrome_trace(opts["trace_json"])
    return out


class _PlainProgress:
    """Stand-in for tqdm when it is not installed: the loss lines still show progress."""

    def __init__(self, total: int) -> None:
        self.total = total

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **kwargs: Any) -> None:
        pass

    def write(self, line: str) -> None:
        print(line, flush=True)

    def close(self) -> None:
        pass


def _progress(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        print("(no progress bar: `pip install tqdm`, or install with the [demo] extra)", flush=True)
        return _PlainProgress(total)
    return tqdm(total=total, desc="training", unit="step", file=sys.stdout, dynamic_ncols=True, leave=True)


def _can_plot() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("(no timeline PNG: `pip install matplotlib`, or install with the [demo] extra)", flush=True)
        return False
    return True


def _args(argv: Optional[list[str]]) -> argparse.Namespace:
    from pipeline_ext import schedules as S

    ap = argparse.ArgumentParser(prog="python -m pipeline_ext.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedule", default="1f1b", choices=S.available())
    ap.add_argument("--stages", type=int, default=2, help="pipeline ranks = worker processes (default 2)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=32, help="sequences per step")
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--trace-steps", type=int, default=5, help="trace the last N steps (measured bubble, PNG)")
    ap.add_argument("--png", default="pipeline_demo.png", help="timeline PNG of a measured step ('' for none)")
    ap.add_argument("--trace-json", default="", help="also write a Chrome trace of the traced steps here")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before the workers are killed")
    args = ap.parse_args(argv)
    if args.png and not _can_plot():
        args.png = ""
    v = S.default_stages_per_rank(args.schedule)
    try:
        S.build(args.schedule, args.stages, args.microbatches, stages_per_rank=v)
    except S.ScheduleError as exc:
        ap.error(str(exc))
    if args.layers < args.stages * v:
        ap.error(f"--layers {args.layers} is fewer than the {args.stages * v} model stages of {args.schedule}")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    from pipeline_ext import schedules as S
    from pipeline_ext.comm.launch import spawn

    args = _args(argv)
    v = S.default_stages_per_rank(args.schedule)
    cfg = GPTConfig(layers=args.layers)
    print(f"pipeline_ext demo: GPT ({args.layers} blocks, d_model {cfg.d_model}, vocab {cfg.vocab}, seq {cfg.seq_len}) "
          f"on {args.stages} worker processes ({args.stages * v} stages), schedule {args.schedule}, "
          f"{args.microbatches} microbatches of {args.batch} sequences per step; Gloo on 127.0.0.1", flush=True)
    opts = {k: getattr(args, k) for k in ("schedule", "microbatches", "steps", "batch", "layers", "lr", "trace_steps",
                                         "png", "trace_json")}
    t0 = time.perf_counter()
    results = spawn(train, args.stages, opts, timeout=args.timeout, threads=1)
    out = next(v for _, v in results.values() if v is not None)
    losses = out["losses"]
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps "
          f"({'fell' if losses[-1] < losses[0] else 'did NOT fall'})")
    print(f"throughput: {out['tokens_per_s']:.0f} tokens/s")
    if out["report"] is not None:
        print(f"bubble: measured {out['measured_bubble']:.3f} vs simulated {out['simulated_bubble']:.3f} "
              "(simulator at the measured costs)")
        print(out["report"])
        if args.png:
            print(f"timeline: {args.png}")
        if args.trace_json:
            print(f"chrome trace: {args.trace_json}")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
