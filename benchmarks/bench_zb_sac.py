"""Zero-bubble schedules on transformer blocks under selective activation checkpointing (issue 40).

Before issue 40 a stage whose blocks ran under SAC (``checkpoint(...,
context_fn=create_selective_checkpoint_contexts(policy))``) could not split
its backward into I and W (SAC's cache hands each saved value out once, and
W recomputed the region a second time), so ZB-H1 and ZBV fell back to a
whole backward at I on every such stage and kept 1F1B's bubble. Now I and W
share one recomputation and I keeps what W reads ([Note: what I keeps for W]
in ``runtime/split/keep.py``). This benchmark shows what that buys, side by
side in one run:

- the model: ``--blocks`` pre-norm transformer blocks (causal attention with
  qkv and output projections, GELU MLP), each under SAC with a policy that
  saves the matmul outputs (mm/addmm/bmm) and recomputes the rest (``--no-sac``:
  the same blocks without checkpointing; ``--both``: both, interleaved in one
  run); the residual stream in, MSE on the last stage. ``--ranks`` 2 (one per
  core of a 2-core machine) or 4 (spawned, Gloo on 127.0.0.1, one intra-op
  thread each); 1F1B, ZB-H1 and ZB-H2 cut it into one stage per rank, ZBV and
  DualPipeV into two per rank (V placement);
- correctness first: every schedule's first step is compared with the
  unsplit model on the same batch (loss, every gradient of the rank's
  blocks), no ``UnsplitBackwardWarning`` may be raised, and the trace must
  say the split held on every stage. A mismatch stops the benchmark;
- memory: one step per schedule under ``ActivationMeter`` (forward inputs,
  outputs, what a checkpoint frame holds: its inputs and SAC's saved values;
  and what I keeps for W), its per-rank peak next to the promise: the
  simulator's ``peak_activations`` of the rank times the bytes one stage
  forward records for one microbatch (measured on rank 1);
- time: interleaved repeats of every schedule (these machines are shared
  and noisy: only numbers taken side by side mean anything), traced: the
  median step time and its spread over the repeats, the bubble the tracer
  measured on those steps, the simulator's bubble and step time at the
  measured per-stage F, I, W costs (its prediction for this run) and at unit
  costs, I + W against 1F1B's B, and where the median traced step's time went
  (``replay_gap``: compute variance, latency, the runtime's own time);
- the gains: one line per schedule, ``gain over 1F1B: NAME measured A.AAx
  simulated B.BBx (sac|plain)``, with the paired gain (1F1B's step over the
  schedule's in the same repeat, median over repeats), the fastest repeats' and
  a 90 % bootstrap interval of the measured gain;
  then ``select()``'s choice at the measured costs (ZB-H1's F, I, W and 1F1B's B
  as ``Costs.whole``) and why.

    PYTHONPATH=. python benchmarks/bench_zb_sac.py [--device cpu|cuda] [--ranks 2] [--d 64] [--seq 32] [--blocks 8]
        [--microbatches 8] [--rows 2] [--repeats 3] [--steps 2] [--no-sac | --both] [--trace PREFIX]
        [--schedules 1f1b zb_h1 zb_h2 zbv dualpipev]

docs/performance.md ("Zero bubble on transformer blocks") has the tables at d = 512 and 1024.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import warnings
from typing import Any

import torch
from torch import nn

SCHEDULES = ["1f1b", "zb_h1", "zb_h2", "zbv", "dualpipev"]
ZB = ("zb_h1", "zb_h2", "zbv", "dualpipev")  # the schedules that run I and W
VARIANTS = {"sac": "every block under SAC (matmuls saved)", "plain": "no checkpointing"}


def _policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    keep = func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def sac_context() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_policy)


class Block(nn.Module):
    """Pre-norm causal self-attention and GELU MLP with residuals; the whole block under SAC when ``sac``."""

    def __init__(self, d: int, heads: int, sac: bool) -> None:
        super().__init__()
        self.heads, self.sac = heads, sac
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.down(nn.functional.gelu(self.up(self.ln2(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sac:
            return self.inner(x)
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, x, use_reentrant=False, context_fn=sac_context)


def blocks(args: argparse.Namespace, sac: bool) -> list[Block]:
    torch.manual_seed(0)
    return [Block(args.d, args.heads, sac) for _ in range(args.blocks)]


def modes(args: argparse.Namespace) -> list[str]:
    """The model variants the run compares: "sac" (every block under SAC), "plain" (no checkpointing), or both."""
    return ["sac", "plain"] if args.both else ["plain"] if args.no_sac else ["sac"]


def pin_to_own_core(rank: int, world: int) -> str:
    """Put every thread of this rank (Gloo's included) on a core of its own, when there is one per rank.

    Why: on a machine with one core per rank the scheduler still moves a rank's threads between cores and lets
    one rank's threads run on the other's core while it computes; each such moment stretches a compute and
    1F1B's idle time is taken by the other rank, which blurs the bubble the schedules differ in.
    """
    import os

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < world:
        return f"not pinned ({len(cores)} cores for {world} ranks)"
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {cores[rank]})
    return "each rank pinned to a core of its own"


def worker(rank: int, world: int, args: argparse.Namespace) -> dict[tuple[str, str], Any]:
    import time

    import torch.distributed as dist

    import pipeline_ext as pe
    from pipeline_ext import schedules as S
    from pipeline_ext.runtime.memory import ActivationMeter
    from pipeline_ext.runtime.overlap import handover_count
    from pipeline_ext.runtime.trace import replay_gap

    pinned = pin_to_own_core(rank, world) if args.pin else "not pinned"
    m = args.microbatches
    dev = torch.device(args.device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m * args.rows, args.seq, args.d, generator=g).to(dev)
    y = torch.randn(m * args.rows, args.seq, args.d, generator=g).to(dev)
    # on a GPU the unsplit model sums its microbatches in another order (other kernels): fp32 rounding apart
    tol = {} if dev.type == "cpu" else {"rtol": 1e-4, "atol": 1e-5}
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    steps: dict[tuple[str, str], Any] = {}
    for mode in modes(args):
        ref = nn.Sequential(*blocks(args, mode == "sac")).to(dev)  # the unsplit model, for the first step's check
        ref_loss = nn.functional.mse_loss(ref(x), y)
        ref_loss.backward()
        for name in args.schedules:
            v = S.default_stages_per_rank(name)
            n = world * v
            ir = S.build(name, world, m, stages_per_rank=v)
            mine = [s for s, r in enumerate(ir.stage_to_rank) if r == rank]
            per = args.blocks // n
            all_blocks = [b.to(dev) for b in blocks(args, mode == "sac")]
            modules = [nn.Sequential(*all_blocks[s * per:(s + 1) * per]) for s in range(n)]
            stages = [pe.PipelineStage(modules[s], s, n, dev) for s in mine]
            sched = pe.get_schedule_class(name)(stages if v > 1 else stages[0], m, loss_fn=nn.functional.mse_loss)
            # first step: measured memory, checked against the unsplit model
            meter = ActivationMeter()
            watched = [meter.watch(r, inputs=s > 0) for s, r in sched._runners.items()]
            watched.append(sched.register_action_hook(meter.on_action))  # a sample after every action
            losses: list[torch.Tensor] = []
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                sched.step(x if 0 in mine else None, target=y if n - 1 in mine else None, losses=losses)
            unsplit = [str(w.message) for w in said if issubclass(w.category, pe.UnsplitBackwardWarning)]
            if unsplit:
                raise AssertionError(f"{mode} {name} rank {rank}: the split fell back: {unsplit}")
            for s in mine:
                for (pn, p), q in zip(modules[s].named_parameters(), ref[s * per:(s + 1) * per].parameters()):
                    torch.testing.assert_close(p.grad, q.grad, **tol, msg=lambda msg: f"{mode} {name} stage {s} {pn}: {msg}")
            loss_err = None
            if losses:
                mean = sum(losses) / len(losses)
                torch.testing.assert_close(mean, ref_loss.detach(), **tol, msg=lambda msg: f"{mode} {name} loss: {msg}")
                loss_err = float((mean - ref_loss.detach()).abs() / ref_loss.detach().abs())
            for handle in watched:
                handle.remove()
            sim = S.simulate(ir, S.Costs(1.0, 1.0, 1.0))
            # the last stage keeps every microbatch's output (detached) until the step returns them to the caller:
            # alive all step, no activation of the schedule's promise; counted next to it
            outputs = m * args.rows * args.seq * args.d * x.element_size() if n - 1 in mine else 0
            rows[(mode, name)] = {"peak": meter.peak_bytes, "unit": meter.forward_bytes,
                                  "sim_units": sim.peak_activations[rank], "outputs": outputs,
                                  "sim_unit_bubble": sim.bubble_rate, "loss_err": loss_err, "v": v,
                                  "pinned": pinned}
            steps[(mode, name)] = (sched, lambda sched=sched, mine=mine, n=n: sched.step(
                x if 0 in mine else None, target=y if n - 1 in mine else None))
    for key, (sched, step) in steps.items():  # warm-up, untraced
        sched.enable_tracing(False)
        step()
        sched.enable_tracing()  # the timed steps are traced: bubble and costs of exactly those
    def sync() -> None:  # every rank's queued GPU work done, then every rank here
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dist.barrier()

    times: dict[tuple[str, str], list[float]] = {key: [] for key in steps}
    for _ in range(args.repeats):  # interleaved: every schedule once per repeat, side by side
        for key, (_, step) in steps.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            sync()
            times[key].append((time.perf_counter() - t0) / args.steps)
    for key, (sched, _) in steps.items():
        report = sched.trace_report(dst=0)
        rows[key]["times"] = times[key]
        rows[key]["ms"] = statistics.median(times[key]) * 1e3
        if report is None:
            continue
        if args.trace:
            report.write_chrome_trace(f"{args.trace}_{key[0]}_{key[1]}_d{args.d}.json")
        held = [s for s, why in report.split.items() if why is None]
        if key[1] != "1f1b" and (len(held) != len(report.split) or len(report.split) != len(sched._runners) * world):
            raise AssertionError(f"{key}: the trace says the split did not hold: {report.split}")
        gap: dict[str, float] = {}
        # replay runs each rank's actions one after the other: what ran, also for overlapped pairs whose halves
        # never handed over (these blocks make no collective), which run as their two actions in order
        if not report.schedule.overlapped or handover_count() == 0:
            mid = sorted(range(len(report.steps)), key=lambda i: report.step_times[i])[len(report.steps) // 2]
            gap = replay_gap(dataclasses.replace(report.schedule, overlapped=()), report.steps[mid], report.costs)
        rows[key].update(bubble=report.measured_bubble, sim_bubble=report.simulated_bubble,
                         sim_ms=report.simulated.makespan * 1e3, traced_ms=statistics.median(report.step_times) * 1e3,
                         split=f"held on {len(held)}/{len(report.split)} stages", costs=report.costs, gap=gap)
    return rows


def gain_interval(base: list[float], other: list[float], draws: int = 2000) -> tuple[float, float]:
    """The 5th and 95th percentiles of the measured gain (median of ``base`` over median of ``other``) when the
    repeats are drawn again with replacement, each repeat's pair of steps together (a bootstrap, fixed seed).

    Why: on a shared machine one schedule's repeats spread by 20-50 %, so a gain of a few percent needs its
    uncertainty next to it before it is compared with the simulator's.
    """
    import random

    rng = random.Random(0)
    n = len(base)
    gains = sorted(statistics.median(base[i] for i in idx) / statistics.median(other[i] for i in idx)
                   for idx in ([rng.randrange(n) for _ in range(n)] for _ in range(draws)))
    return gains[int(0.05 * draws)], gains[int(0.95 * draws) - 1]


def _total(value: Any) -> float:
    """A cost summed over stages (a per-stage list) or the single value."""
    return sum(value) if isinstance(value, list) else value


def main() -> None:
    import os

    from pipeline_ext.comm.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cuda: every rank's stages on cuda:0 over NCCL (each rank its own NCCL host)")
    ap.add_argument("--ranks", type=int, default=2, choices=(2, 4), help="pipeline ranks (processes)")
    ap.add_argument("--d", type=int, default=64, help="model width")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32, help="tokens per row")
    ap.add_argument("--blocks", type=int, default=8, help="transformer blocks (a multiple of 2 x ranks: V schedules "
                                                          "cut the model into 2 stages per rank)")
    ap.add_argument("--rows", type=int, default=2, help="rows per microbatch")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats; medians are reported")
    ap.add_argument("--steps", type=int, default=2, help="steps per timed repeat")
    ap.add_argument("--schedules", nargs="+", default=SCHEDULES, help="the first is the baseline of the gains")
    ap.add_argument("--no-sac", action="store_true", help="the same blocks without checkpointing (for comparison)")
    ap.add_argument("--both", action="store_true", help="with SAC and without, interleaved in one run")
    ap.add_argument("--trace", metavar="PREFIX", help="write each schedule's traced steps as Chrome trace JSON")
    ap.add_argument("--pin", action="store_true", help="cpu: every thread of a rank on a core of its own (when "
                                                       "there is one core per rank)")
    args = ap.parse_args()
    world = args.ranks
    if args.blocks % (2 * world):
        ap.error(f"--blocks must be a multiple of {2 * world} (V schedules cut the model into {2 * world} stages)")
    gpu = args.device == "cuda"
    res = spawn(worker, world, args, timeout=3600, threads=1, backend="cpu:gloo,cuda:nccl" if gpu else "gloo",
                own_nccl_host=gpu)
    per_rank = {r: rows for r, (_, rows) in res.items()}
    load = os.getloadavg()
    print(f"{args.blocks} transformer blocks d={args.d} ({args.heads} heads), {args.seq} tokens x {args.rows} rows per "
          f"microbatch, {args.microbatches} microbatches, {world} ranks "
          f"({'sharing ' + torch.cuda.get_device_name(0) + ', NCCL' if gpu else 'Gloo, 1 thread each'}"
          f"{'' if gpu else ', ' + next(iter(per_rank[0].values()))['pinned']}), "
          f"{' and '.join(VARIANTS[m] for m in modes(args))}"
          f"; {args.repeats} interleaved repeats of {args.steps} steps; torch {torch.__version__}; "
          f"load average after the run {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores")
    errs = {f"{k[0]} {k[1]}": e for rows in per_rank.values() for k, r in rows.items()
            if (e := r["loss_err"]) is not None}
    print("first step of every schedule checked against the unsplit model (every gradient, the loss; loss rel. err "
          + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()) + "); no UnsplitBackwardWarning")
    base = args.schedules[0]

    def promise(rows: dict, key: tuple[str, str]) -> float:
        return rows[key]["sim_units"] * per_rank[1][key]["unit"] + rows[key]["outputs"]

    ms = lambda v: "/".join(f"{t * 1e3:.1f}" for t in (v if isinstance(v, list) else [v]))  # noqa: E731
    for mode in modes(args):
        print()
        print(f"== {mode} ==")
        print(f"{'schedule':<9} {'ms/step':>8} {'spread':>7} {'traced ms':>9} {'sim ms':>7} {'bubble':>7} "
              f"{'sim bubble':>10} {'sim@unit':>8} {'F ms':>7} {'I ms':>7} {'W ms':>7} {'(I+W)/B':>8} "
              f"{'peak/promise':>12}  I/W split")
        b_base = _total(per_rank[0][(mode, base)]["costs"].b)  # the baseline's whole backward (B), all stages
        for name in args.schedules:
            key = (mode, name)
            r0 = per_rank[0][key]
            c = r0["costs"]
            t = r0["times"]
            spread = (max(t) - min(t)) / statistics.median(t)
            worst = max(per_rank.values(), key=lambda rows: rows[key]["peak"] / promise(rows, key))
            ratio = (_total(c.b) + _total(c.w)) / b_base
            print(f"{name:<9} {r0['ms']:>8.1f} {spread:>7.1%} {r0['traced_ms']:>9.1f} {r0['sim_ms']:>7.1f} "
                  f"{r0['bubble']:>7.3f} {r0['sim_bubble']:>10.3f} {r0['sim_unit_bubble']:>8.3f} "
                  f"{_total(c.f) * 1e3:>7.1f} {_total(c.b) * 1e3:>7.1f} {_total(c.w) * 1e3:>7.1f} "
                  f"{ratio:>8.2f} {worst[key]['peak'] / promise(worst, key):>12.3f}  "
                  f"{r0['split'] if name in ZB else '(no I/W)'}")
        print()
        for name in args.schedules:
            c = per_rank[0][(mode, name)]["costs"]
            gap = per_rank[0][(mode, name)]["gap"]
            parts = "  ".join(f"{k} {v * 1e3:.1f}" for k, v in gap.items() if k != "traced")
            print(f"{name:<9} per stage (ms) F {ms(c.f)}  I/B {ms(c.b)}  W {ms(c.w)}  comm {ms(c.comm)}"
                  + (f"; traced step's gap to the simulator (ms): {parts}" if parts else ""))
        print()
        r_base = per_rank[0][(mode, base)]
        for name in args.schedules[1:]:
            r = per_rank[0][(mode, name)]
            label = base.upper() if base == "1f1b" else base
            lo, hi = gain_interval(r_base["times"], r["times"])
            print(f"gain over {label}: {name} measured {r_base['ms'] / r['ms']:.2f}x "
                  f"simulated {r_base['sim_ms'] / r['sim_ms']:.2f}x ({mode}); paired "
                  f"{statistics.median(a / b for a, b in zip(r_base['times'], r['times'])):.2f}x, fastest repeats "
                  f"{min(r_base['times']) / min(r['times']):.2f}x, 90% interval of the measured {lo:.2f}-{hi:.2f}x")
        split_costs = per_rank[0].get((mode, "zb_h1"), {}).get("costs")
        if split_costs is not None and (mode, "1f1b") in per_rank[0]:
            # select() from the measured costs: ZB-H1's F, I, W and 1F1B's whole backward B, per rank share
            from pipeline_ext import schedules as S

            in_ms = lambda v: [t * 1e3 for t in v] if isinstance(v, list) else v * 1e3  # noqa: E731
            costs = S.Costs(in_ms(split_costs.f), in_ms(split_costs.b), in_ms(split_costs.w), in_ms(split_costs.comm),
                            whole=in_ms(per_rank[0][(mode, "1f1b")]["costs"].b))
            for budget in (None, world):
                sel = S.select(world, args.microbatches, budget, costs)
                told = "none" if budget is None else f"{budget} units (1F1B)"
                print(f"select({world} ranks, {args.microbatches} microbatches, budget {told}) at the measured costs "
                      f"in ms ({mode}): {sel.reason}")
    print()
    print("ms/step: median wall time of the interleaved timed steps; spread: (max - min) / median over the repeats; "
          "traced ms / sim ms: the traced steps' span and the simulator's makespan at the per-stage F, I, W costs "
          "measured on them; bubble: measured on the traced steps, sim bubble at those costs, sim@unit at "
          "F = I = W = 1; F, I, W ms: the measured costs summed over stages (I is B for a schedule without I/W); "
          f"(I+W)/B: that schedule's I + W over {base}'s B; peak/promise: the most activation bytes one rank held "
          "(ActivationMeter) over the simulator's peak stage-microbatches x one stage-microbatch's bytes, worst rank")
    print("gain: the baseline's median step over the schedule's (measured), and the simulator's makespan at the "
          "baseline's measured costs over the simulator's at the schedule's (simulated); paired: the median over the "
          "repeats of the baseline's step over the schedule's in the same repeat; fastest repeats: the "
          "baseline's fastest repeat over the schedule's (load from other processes only ever adds time); 90% "
          "interval: of the measured gain, the repeats drawn again with replacement (bootstrap)")


if __name__ == "__main__":
    main()
