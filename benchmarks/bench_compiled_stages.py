"""Compiled vs eager stages on a transformer stack: step time and bubble under 1F1B and ZB-H1.

Does ``torch.compile`` on the stages pay inside a pipeline, and what happens
to the zero-bubble schedule when it does? The model is the demo's GPT
(``pipeline_ext.demo.model``: token embedding, pre-norm causal self-attention
and MLP blocks, LM head), cut into two stages on two Gloo ranks (127.0.0.1, one
intra-op thread each). Every stage runs as

- ``eager``: the plain module;
- ``inductor``: ``torch.compile(module)``. Its backward is one opaque node, so
  ZB-H1 falls back to a whole backward at I (W does nothing,
  ``UnsplitBackwardWarning``): exact, but the bubbles W should fill stay empty;
- ``split_backend``: ``torch.compile(module, backend=pipeline_ext.split_backend)``,
  whose compiled backward ZB-H1 splits into I and W. Under 1F1B (no I/W
  split) it runs the same whole compiled backward as inductor, so it is only
  run under ZB-H1.

All variants run in the same processes, alternating, in interleaved repeats
(these machines are shared and noisy: only ratios taken side by side mean
anything). Printed per (schedule, stages): median step time, its ratio to
eager stages under the same schedule, and the bubble the tracer measured on
those same timed steps (median over steps of the mean over ranks of idle /
step; the simulator's bubble at the measured action costs next to it).

A number must not hide a wrong result: the first step of every variant is
checked against eager stages under the same schedule (same weights, same
batch): loss and every gradient equal within float tolerance, and the
``UnsplitBackwardWarning`` raised exactly where the fallback is expected
(inductor under ZB-H1, on the stages that have input grads to split off).
A mismatch stops the benchmark; the table shows the largest relative error of
a microbatch's loss and the largest absolute error of a gradient element.

    PYTHONPATH=. python benchmarks/bench_compiled_stages.py [--d 128] [--seq 128] [--layers 4] [--batch 32] [--microbatches 8] [--repeats 7] [--summaries]
"""
from __future__ import annotations

import argparse
import statistics
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

WORLD = 2
SCHEDULES = {"1f1b": ("eager", "inductor"), "zb_h1": ("eager", "inductor", "split_backend")}
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-3, 1e-5  # compiled kernels reorder float sums; this is roundoff


@dataclass
class Run:
    """One (schedule, stages) variant on this rank: its schedule, step and what its first step produced."""

    schedule: str
    stages: str
    sched: Any
    step: Callable[[], None]
    params: list[nn.Parameter]
    losses: list[torch.Tensor]
    fell_back: bool = False  # the first step raised UnsplitBackwardWarning


def compile_stage(module: nn.Module, stages: str) -> nn.Module:
    """``module`` as the variant ``stages`` runs it (eager, inductor or split_backend)."""
    import pipeline_ext as pe

    backends: dict[str, Any] = {"inductor": "inductor", "split_backend": pe.split_backend}
    return module if stages == "eager" else torch.compile(module, backend=backends[stages])


def make_run(schedule: str, stages: str, module: nn.Module, rank: int, args: argparse.Namespace,
             batch: tuple[torch.Tensor, torch.Tensor]) -> Run:
    """A training step of ``module`` (this rank's stage) under ``schedule``; grads cleared at each step."""
    import pipeline_ext as pe
    from pipeline_ext.demo.model import lm_loss

    stage = pe.PipelineStage(module, rank, WORLD, "cpu")
    sched = pe.PipelineSchedule(stage, schedule, args.microbatches, loss_fn=lm_loss, timeout=args.timeout)
    params = list(module.parameters())
    losses: list[torch.Tensor] = []
    first, last = rank == 0, rank == WORLD - 1
    x, y = batch

    def step() -> None:
        for p in params:
            p.grad = None
        sched.step(*((x,) if first else ()), target=y if last else None, losses=losses if last else None)

    return Run(schedule, stages, sched, step, params, losses)


def first_step(run: Run) -> None:
    """Run a step (the first of a compiled module compiles it) and note whether I fell back to a whole backward."""
    import pipeline_ext as pe

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", pe.UnsplitBackwardWarning)
        run.step()
    run.fell_back = any(issubclass(w.category, pe.UnsplitBackwardWarning) for w in caught)


def check_against(run: Run, eager: Run, rank: int) -> dict[str, float]:
    """Loss and grads of ``run``'s last step vs eager stages' (same schedule); raises on a mismatch.

    The fallback is expected for inductor under ZB-H1 on every stage but the
    first: the first stage's inputs are token ids, so its I has no input grad
    to compute and W runs the whole (compiled) backward, nothing to split.
    """
    grad_err = max(float((p.grad - q.grad).abs().max()) for p, q in zip(run.params, eager.params))
    for p, q in zip(run.params, eager.params):
        torch.testing.assert_close(p.grad, q.grad, rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                   msg=lambda m: f"{run.schedule}/{run.stages}: gradient differs from eager's: {m}")
    loss_err = 0.0
    if run.losses:
        loss, ref = torch.stack(run.losses), torch.stack(eager.losses)  # per microbatch
        loss_err = float(((loss - ref).abs() / ref.abs()).max())
        if loss_err > LOSS_RTOL:
            raise AssertionError(f"{run.schedule}/{run.stages}: losses {loss.tolist()} vs eager's {ref.tolist()}")
    expected_fallback = run.stages == "inductor" and run.schedule == "zb_h1" and rank > 0
    if run.fell_back != expected_fallback:
        raise AssertionError(f"{run.schedule}/{run.stages}: UnsplitBackwardWarning "
                             f"{'raised' if run.fell_back else 'not raised'}, expected the opposite")
    return {"loss_err": loss_err, "grad_err": grad_err}


def bubble_of(run: Run) -> Optional[dict[str, Any]]:
    """Measured and simulated bubble over the steps traced so far (a collective; the numbers on rank 0)."""
    report = run.sched.trace_report(dst=0)
    if report is None:
        return None
    return {"bubble": report.measured_bubble, "sim_bubble": report.simulated_bubble, "summary": report.summary()}


def worker(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """This rank's part: first steps checked, then interleaved repeats, timed and traced (rows on rank 0)."""
    from bench_pipeline import timed  # benchmarks/ is on sys.path when run as a script

    from pipeline_ext.demo.model import GPTConfig, gpt_stages, synthetic_batch

    torch._dynamo.config.cache_size_limit = 64  # one stage class, compiled by two backends
    cfg = GPTConfig(seq_len=args.seq, d_model=args.d, heads=args.heads, layers=args.layers)
    batch = synthetic_batch(cfg, args.batch, step=0)
    # one module per kind of stage (same weights for all), shared by the schedules that run it
    modules = {s: compile_stage(gpt_stages(cfg, WORLD)[rank], s) for s in SCHEDULES["zb_h1"]}
    runs = [make_run(name, s, modules[s], rank, args, batch) for name, kinds in SCHEDULES.items() for s in kinds]
    checks = {}
    for run in runs:  # each compiled variant's first step, then its eager twin's, to compare the grads
        if run.stages != "eager":
            eager = next(r for r in runs if r.schedule == run.schedule and r.stages == "eager")
            first_step(run)
            first_step(eager)
            checks[run.schedule, run.stages] = check_against(run, eager, rank)
    for run in runs:  # warm-up (allocator, caches), then trace the timed steps: the bubble is interleaved too
        timed(run.step, 2)
        run.sched.enable_tracing()
    times: dict[tuple[str, str], list[float]] = {(r.schedule, r.stages): [] for r in runs}
    for _ in range(args.repeats):
        for run in runs:
            times[run.schedule, run.stages].append(timed(run.step, args.steps))
    bubbles = {(r.schedule, r.stages): bubble_of(r) for r in runs}
    if rank != 0:
        return {"checks": checks}
    rows = [{"schedule": r.schedule, "stages": r.stages, "step": statistics.median(times[r.schedule, r.stages]),
             **(bubbles[r.schedule, r.stages] or {})} for r in runs]
    return {"checks": checks, "rows": rows}


def print_table(rows: list[dict], checks: dict[tuple[str, str], dict[str, float]]) -> None:
    """One line per variant; ratios against eager stages under the same schedule."""
    eager = {r["schedule"]: r["step"] for r in rows if r["stages"] == "eager"}
    print(f"{'schedule':<9} {'stages':<14} {'step ms':>8} {'/ eager':>8} {'bubble':>7} {'sim. bubble':>11} "
          f"{'loss rel.err':>12} {'grad max err':>12}")
    for r in rows:
        c = checks.get((r["schedule"], r["stages"]))
        err = f"{c['loss_err']:>12.1e} {c['grad_err']:>12.1e}" if c else f"{'(reference)':>12} {'':>12}"
        print(f"{r['schedule']:<9} {r['stages']:<14} {r['step'] * 1e3:>8.1f} {r['step'] / eager[r['schedule']]:>8.2f} "
              f"{r['bubble']:>7.3f} {r['sim_bubble']:>11.3f} {err}")


def main() -> None:
    from pipeline_ext.comm.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=128, help="model width")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128, help="sequence length")
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks, split evenly over the 2 stages")
    ap.add_argument("--batch", type=int, default=32, help="sequences per step")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7, help="interleaved repeats; medians are reported")
    ap.add_argument("--steps", type=int, default=2, help="steps per timed repeat")
    ap.add_argument("--summaries", action="store_true", help="also print each variant's trace summary (F/I/W costs)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a rank may wait on its peer (compiles)")
    args = ap.parse_args()
    print(f"GPT (demo/model.py) {args.layers} blocks, d={args.d}, {args.heads} heads, seq {args.seq}, batch {args.batch}, "
          f"{args.microbatches} microbatches, {WORLD} ranks (Gloo), 1 thread/rank, torch {torch.__version__}; "
          f"medians of {args.repeats} interleaved repeats x {args.steps} steps, bubble: median over the same steps")
    out = spawn(worker, WORLD, args, timeout=3600, pg_timeout=args.timeout, threads=1)
    checks: dict[tuple[str, str], dict[str, float]] = {}
    for _, value in out.values():  # the worst error over the ranks
        for key, c in value["checks"].items():
            checks[key] = {k: max(v, checks.get(key, {}).get(k, 0.0)) for k, v in c.items()}
    rows = out[0][1]["rows"]
    print_table(rows, checks)
    if args.summaries:
        for r in rows:
            print(f"{r['schedule']}/{r['stages']}: {r['summary']}")


if __name__ == "__main__":
    main()
