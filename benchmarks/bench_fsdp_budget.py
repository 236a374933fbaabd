"""FSDP2 stages under a parameter budget: pipeline_ext's planner against torch 2.13's policy, side by side.

pp=2 x dp=2 on 4 Gloo CPU ranks, interleaved 1F1B with V stages per rank (8 microbatches), every block and
every stage ``fully_shard``ed over dp with ``reshard_after_forward=False`` (torchtitan's setting under PP).
The same modules' copies run under torch's ``ScheduleInterleaved1F1B`` (its runtime keeps at most 3 stages
unsharded) and under pipeline_ext with ``max_active_stages`` = 1..V and without a budget, in the same
processes, repeats interleaved. Per configuration, on rank 0 (pp rank 0, dp rank 0): FSDP's all-gathers and
reduce-scatters in one step (counted by wrapping FSDP's collective functions), when the reduce-scatters were
issued (as a fraction of the step), the peak bytes held in unsharded parameters plus unsharded gradients as a
multiple of P (the rank's stages' unsharded parameter bytes; sampled at every FSDP collective and after every
block's forward and backward, the same points for both libraries), and the median step time. The simulator's
prediction for the same plan is printed beside ours.

    PYTHONPATH=.:tests python benchmarks/bench_fsdp_budget.py [--v 4] [--dim 64] [--steps 3] [--repeats 5]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

PP, DP, M, ROWS, SEQ = 2, 2, 8, 16, 8


class _Probe:
    """Counts FSDP's collectives and samples held bytes on this rank while installed."""

    def __init__(self) -> None:
        self.groups: list = []
        self.reset()

    def reset(self) -> None:
        self.gathers = self.scatters = 0
        self.peak = 0
        self.scatter_at: list[float] = []
        self.t0 = time.perf_counter()

    def held(self) -> int:
        from models import unsharded_bytes

        return unsharded_bytes(self.groups)

    def sample(self, *_: object) -> None:
        self.peak = max(self.peak, self.held())

    def install(self):
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

        gather, scatter = pg.foreach_all_gather, pg.foreach_reduce

        def counting_gather(*args, **kwargs):
            self.gathers += 1
            self.sample()
            out = gather(*args, **kwargs)
            self.sample()
            return out

        def counting_scatter(*args, **kwargs):
            self.scatters += 1
            self.scatter_at.append(time.perf_counter() - self.t0)
            self.sample()
            return scatter(*args, **kwargs)

        pg.foreach_all_gather, pg.foreach_reduce = counting_gather, counting_scatter
        return lambda: (setattr(pg, "foreach_all_gather", gather), setattr(pg, "foreach_reduce", scatter))


def _stages(v: int, dim: int, probe: _Probe) -> list[torch.nn.Module]:
    """All 2V stages, seeded (the same weights for every configuration), each block sampled by the probe."""
    from models import Block

    torch.manual_seed(0)
    mods = [torch.nn.Sequential(Block(dim, heads=4)) for _ in range(PP * v)]
    for m in mods:
        m[0].register_forward_hook(probe.sample)
        m[0].register_full_backward_hook(probe.sample)
    return mods


def worker(rank: int, world: int, v: int, dim: int, steps: int, repeats: int) -> dict:
    import torch.distributed as dist
    from torch.distributed import pipelining as tpp
    from torch.distributed.fsdp import fully_shard

    import pipeline_ext as pe
    from bench_agreement import interleaved_medians  # benchmarks/ is on sys.path when run as a script
    from pipeline_ext.schedules import simulate

    mesh = pe.pipeline_mesh(pp=PP, dp=DP, device_type="cpu")
    layout = pe.pipeline_layout(mesh, "interleaved_1f1b", stages_per_rank=v)
    ns, mine = layout.num_stages, layout.stages
    probe = _Probe()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(ROWS, SEQ, dim, generator=g), torch.randn(ROWS, SEQ, dim, generator=g)
    rows = slice(layout.dp_rank * ROWS // DP, (layout.dp_rank + 1) * ROWS // DP)
    loss = torch.nn.functional.mse_loss
    configs: dict = {}

    def build(kind: str, budget):
        mods = _stages(v, dim, probe)
        for s in mine:
            fully_shard(mods[s][0], mesh=mesh["dp"], reshard_after_forward=False)
            fully_shard(mods[s], mesh=mesh["dp"], reshard_after_forward=False)
        groups = [gr for s in mine for m in (mods[s][0], mods[s]) for gr in m._get_fsdp_state()._fsdp_param_groups]
        if kind == "torch":
            stages = [tpp.PipelineStage(mods[s], s, ns, torch.device("cpu"), group=mesh["pp"].get_group())
                      for s in mine]
            sched = tpp.ScheduleInterleaved1F1B(stages, M, loss_fn=loss)
        else:
            stages = [pe.PipelineStage(mods[s], s, ns, "cpu", group=mesh["pp"]) for s in mine]
            kw = {} if budget is None else {"max_active_stages": budget}
            sched = pe.ScheduleInterleaved1F1B(stages, M, loss_fn=loss, **kw)
        opt = torch.optim.SGD([p for s in mine for p in mods[s].parameters()], lr=0.0)
        P = sum(fp._orig_size.numel() * 4 for gr in groups for fp in gr.fsdp_params)

        def step() -> None:
            opt.zero_grad()
            sched.step(*((x[rows],) if 0 in mine else ()), target=y[rows] if ns - 1 in mine else None)

        return groups, P, step, sched

    def mods_of(sched) -> torch.nn.Module:
        """A pipeline_ext schedule's first stage module on this rank (its FSDP root)."""
        return next(iter(sched.stages.values())).submod

    names = [("torch", None), ("pipeline_ext", None)] + [("pipeline_ext", b) for b in range(1, v + 1)]
    steps_fns: dict = {}
    scheds: dict = {}
    gather_s = None
    undo = probe.install()
    try:
        for kind, budget in names:
            key = f"{kind} " + ("default" if budget is None else f"max_active_stages={budget}")
            groups, P, step, sched = build(kind, budget)
            if kind == "pipeline_ext" and budget is not None:
                scheds[key] = sched
            probe.groups = groups
            step()  # warm-up: lazy init
            probe.reset()
            step()
            elapsed = time.perf_counter() - probe.t0
            configs[key] = dict(gathers=probe.gathers, scatters=probe.scatters, peak=probe.peak / P, P=P,
                                scatter_at=[t / elapsed for t in probe.scatter_at])
            if gather_s is None and kind == "pipeline_ext":  # one stage's all-gather, waited (what an UNSHARD costs when nothing hides it)
                m = mods_of(sched)
                t0 = time.perf_counter()
                for _ in range(5):
                    m.unshard()
                    m.reshard()
                gather_s = (time.perf_counter() - t0) / 5
            if kind == "pipeline_ext":
                from pipeline_ext.schedules import fsdp as F

                configs[key]["planned_unshards"] = sum(F.unshard_counts(sched.schedule).get(s, 0) for s in mine) \
                    if budget is not None else None
            steps_fns[key] = step
        times = interleaved_medians(steps_fns, steps, repeats, warmup=1)
    finally:
        undo()
    for key, t in times.items():
        configs[key]["ms"] = t * 1e3
    # the simulator on each planned schedule, at costs traced on one step and a measured all-gather
    for key, sched in scheds.items():
        sched.enable_tracing(True)
        steps_fns[key]()
        rep = sched.trace_report()
        sched.enable_tracing(False)
        if rep is not None and rep.schedule.has_fsdp:
            stage_p = configs[key]["P"] / v
            costs = dataclasses.replace(rep.costs, param_bytes=stage_p, unshard=gather_s, reduce_grad=gather_s)
            sim = simulate(rep.schedule, costs)
            configs[key]["sim_ms"] = sim.makespan * 1e3
            configs[key]["sim_peak"] = sim.peak_unsharded_bytes[0] / configs[key]["P"]
            configs[key]["traced_ms"] = statistics.median(rep.step_times) * 1e3
    dist.barrier()
    return configs


def main() -> None:
    from pipeline_ext.comm.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--v", type=int, default=4, help="stages per rank")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3, help="steps per timed repeat")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    out = spawn(worker, PP * DP, args.v, args.dim, args.steps, args.repeats, timeout=1800, threads=1)
    rows = out[0][1]
    print(f"pp2 x dp2, 4 Gloo CPU ranks, interleaved 1F1B, V={args.v} stages per rank, {M} microbatches, blocks of "
          f"dim {args.dim}, fully_shard(reshard_after_forward=False); torch {torch.__version__}; rank 0; medians of "
          f"{args.repeats} interleaved repeats x {args.steps} steps")
    print(f"{'configuration':36s} {'all-gathers':>11s} {'reduce-scatters':>15s} {'RS at (first..last)':>19s} "
          f"{'peak held / P':>13s} {'(simulated)':>11s} {'step ms':>8s} {'traced':>7s} {'(simulated)':>11s}")
    for key, r in rows.items():
        at = r["scatter_at"]
        span = f"{min(at):.2f}..{max(at):.2f}" if at else "-"
        sim_peak = f"{r['sim_peak']:.2f}" if "sim_peak" in r else "-"
        traced = f"{r['traced_ms']:.1f}" if "traced_ms" in r else "-"
        sim_ms = f"{r['sim_ms']:.1f}" if "sim_ms" in r else "-"
        print(f"{key:36s} {r['gathers']:11d} {r['scatters']:15d} {span:>19s} {r['peak']:13.2f} {sim_peak:>11s} "
              f"{r['ms']:8.1f} {traced:>7s} {sim_ms:>11s}")


if __name__ == "__main__":
    main()
