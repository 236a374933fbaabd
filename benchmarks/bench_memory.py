"""Peak activation memory per rank, with and without releasing sent outputs, next to the simulator.

Four ranks (spawned, Gloo on 127.0.0.1; ``--device cuda`` puts each rank's
stages on its own GPU over NCCL), one training step per configuration. The
model: 8 pre-norm residual MLP blocks (LayerNorm, Linear(d, 4d), GELU,
Linear(4d, d), residual add), cut into as many equal stages as the schedule
has (4, or 8 for the two-stages-per-rank ZB-V), MSE loss on the last.

Measured on CPU with ``runtime/memory.ActivationMeter``: the bytes of the
activation storages (stage inputs and outputs, tensors the graph saved for
backward) alive after each action of the step; its peak is deterministic (reference
counting, no allocator or timing in it), so one step per configuration is
enough and the two runs differ by the release only. The first stage's input
(the user's batch) is left out. On CUDA, ``torch.cuda.max_memory_allocated``
over the step (minus what was allocated before it) is printed too.

"sim" is the simulator's ``peak_activations`` of the rank (stage-microbatch
activations alive at once, ``schedules.simulate``) and "sim x unit" that times
the bytes one stage's forward records for one microbatch (measured on rank 1,
whose stages all receive their inputs). "off" / "on": measured peak without /
with the release; "on/off" their ratio (both in the same process, same step).

What the release can save: a stage output that nothing in the stage saved
(here the residual add's) once its send has copied it; the output of the
microbatch just computed is alive until its send, so a rank holding k
microbatches saves at most k - 1 outputs at its peak, and the last stage
(which sends no activation) nothing.

    PYTHONPATH=. python benchmarks/bench_memory.py
    PYTHONPATH=. python benchmarks/bench_memory.py --schedules 1f1b zb_h1 zb_h2 zbv v_half v_min --repeats 5
    PYTHONPATH=. python benchmarks/bench_memory.py --schedules 1f1b zb_h1 --d 256 --microbatches 16
"""
from __future__ import annotations

import argparse
from typing import Any, Optional

import torch
from torch import nn

WORLD, BLOCKS, TOKENS = 4, 8, 64
# stages per rank of each schedule; a schedule added later (v_half, v_min) goes here
STAGES_PER_RANK = {"1f1b": 1, "zb_h1": 1, "zb_h2": 1, "zbv": 2, "v_half": 2, "v_min": 2, "interleaved_1f1b": 2}


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def stages(d: int, num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    blocks = [Block(d) for _ in range(BLOCKS)]
    per = BLOCKS // num_stages
    return [nn.Sequential(*blocks[i * per:(i + 1) * per]) for i in range(num_stages)]


def worker(rank: int, world: int, names: list[str], d: int, m: int, device: str, repeats: int = 0,
           steps: int = 3) -> list[dict]:
    import statistics
    import time

    import torch.distributed as dist

    import pipeline_ext as pe
    from pipeline_ext import schedules as S
    from pipeline_ext.runtime.memory import ActivationMeter

    group: Optional[Any] = None
    dev = torch.device("cpu")
    if device == "cuda":
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        group = dist.new_group(backend="nccl")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m * 2, TOKENS, d, generator=g).to(dev)
    y = torch.randn(m * 2, TOKENS, d, generator=g).to(dev)
    rows = []
    timed: dict[str, Any] = {}  # schedule -> its training step with the release (timed after every measurement)
    for name in names:
        v = STAGES_PER_RANK.get(name, 1)
        sched_ir = S.build(name, world, m, stages_per_rank=v)
        sim = S.simulate(sched_ir, S.Costs(1.0, 1.0, 1.0)).peak_activations
        n = world * v
        mine = [s for s, r in enumerate(sched_ir.stage_to_rank) if r == rank]
        row: dict[str, Any] = {"schedule": name, "rank": rank, "sim": sim[rank] / v, "sim_units": sim[rank]}
        for release in (False, True):
            modules = [mod.to(dev) for mod in stages(d, n)]
            ps = [pe.PipelineStage(modules[s], s, n, dev, group=group, release_outputs=release) for s in mine]
            sched = pe.get_schedule_class(name)(ps if v > 1 else ps[0], m, loss_fn=nn.functional.mse_loss)
            meter = ActivationMeter()
            for s, r in sched._runners.items():
                r.instrument(wrap_call=lambda call, first=s == 0: meter.wrap(call, inputs=not first))
            metered = sched.register_action_hook(meter.on_action)  # a sample after every action
            before = 0
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
                before = torch.cuda.memory_allocated(dev)
            args = (x,) if 0 in mine else ()
            sched.step(*args, target=y if n - 1 in mine else None)
            key = "on" if release else "off"
            row[key] = meter.peak_bytes
            row["unit"] = meter.forward_bytes
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                row[f"cuda_{key}"] = torch.cuda.max_memory_allocated(dev) - before
            dist.barrier()
            if release:
                metered.remove()
                timed[name] = lambda sched=sched, args=args, last=n - 1 in mine: sched.step(
                    *args, target=y if last else None)
        row["bubble"] = S.simulate(sched_ir, S.Costs(1.0, 1.0, 1.0)).bubble_rate
        rows.append(row)
    times: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(repeats):  # interleaved: every schedule timed in each repeat, side by side
        for name, step in timed.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            dist.barrier()
            times[name].append((time.perf_counter() - t0) / steps)
    for row in rows:
        row["ms"] = statistics.median(times[row["schedule"]]) * 1e3 if repeats else float("nan")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "zb_h1", "zb_h2", "zbv"])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--repeats", type=int, default=0, help="interleaved repeats timing each schedule's step (0: none)")
    ap.add_argument("--steps", type=int, default=3, help="steps per timed repeat")
    a = ap.parse_args()
    from pipeline_ext.comm.launch import spawn

    res = spawn(worker, WORLD, a.schedules, a.d, a.microbatches, a.device, a.repeats, a.steps, timeout=1800,
                threads=1)
    rows = sorted((r for _, (_, rs) in res.items() for r in rs), key=lambda r: (a.schedules.index(r["schedule"]), r["rank"]))
    units = {r["schedule"]: r["unit"] for r in rows if r["rank"] == 1}
    print(f"{WORLD} ranks, {BLOCKS} residual MLP blocks d={a.d}, {TOKENS} tokens x 2 rows per microbatch, "
          f"{a.microbatches} microbatches; activation bytes (KiB) at each rank's peak")
    cuda = a.device == "cuda"
    head = (f"{'schedule':<9} {'rank':>4} {'sim':>5} {'sim x unit':>11} {'off':>9} {'on':>9} {'on/off':>7} "
            f"{'off/sim':>8}")
    print(head + (f" {'cuda off':>10} {'cuda on':>10}" if cuda else ""))
    for r in rows:
        unit = units[r["schedule"]]
        pred = r["sim_units"] * unit
        line = (f"{r['schedule']:<9} {r['rank']:>4} {r['sim']:>5g} {pred / 1024:>11.0f} {r['off'] / 1024:>9.0f} "
                f"{r['on'] / 1024:>9.0f} {r['on'] / r['off']:>7.3f} {r['off'] / pred:>8.3f}")
        if cuda:
            line += f" {r['cuda_off'] / 1024:>10.0f} {r['cuda_on'] / 1024:>10.0f}"
        print(line)
    print("sim: the simulator's peak in microbatches of the whole rank's layers (stage activations / v); "
          "unit: one stage, one microbatch, measured on rank 1")
    print()
    print("per schedule, the largest over the ranks (units: microbatches of one rank's layers; KiB with the release)")
    print(f"{'schedule':<9} {'sim peak':>9} {'sim bubble':>11} {'measured peak KiB':>18} {'predicted KiB':>14} "
          f"{'ms/step':>9}")
    for name in a.schedules:
        mine = [r for r in rows if r["schedule"] == name]
        pred = max(r["sim_units"] for r in mine) * units[name]
        print(f"{name:<9} {max(r['sim'] for r in mine):>9g} {mine[0]['bubble']:>11.3f} "
              f"{max(r['on'] for r in mine) / 1024:>18.0f} {pred / 1024:>14.0f} {mine[0]['ms']:>9.1f}")


if __name__ == "__main__":
    main()
