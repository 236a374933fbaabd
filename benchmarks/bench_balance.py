"""Stages balanced by measured cost vs equal block counts, on the demo GPT over 2 ranks.

``demo.gpt_stages`` spreads the transformer blocks evenly, so the first stage
also carries the embedding and the last the final norm, the LM head and the
loss; with a large vocabulary the head alone costs several blocks and the
pipeline waits on the last stage every microbatch. ``pe.balance_layers``
profiles each layer of ``demo.gpt_layers`` (rank 0, one microbatch, loss on the
head) and picks the split with the least simulated step of the schedule.

Both splits run in the same processes (2 ranks, Gloo on 127.0.0.1, one thread
each), the same weights, timed in interleaved repeats (each repeat times every
split side by side); the table has the median ms/step, and the simulator's
step and bubble rate under the profiled costs.

    PYTHONPATH=. python benchmarks/bench_balance.py
    PYTHONPATH=. python benchmarks/bench_balance.py --schedule zb_h1 --vocab 16384 --layers 8 --repeats 7
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch

WORLD = 2


def worker(rank: int, world: int, a: dict[str, Any]) -> list[dict[str, Any]]:
    import torch.distributed as dist

    import pipeline_ext as pe
    from pipeline_ext import schedules as S
    from pipeline_ext.demo.model import GPTConfig, gpt_layers, lm_loss, synthetic_batch

    torch.set_num_threads(1)
    cfg = GPTConfig(vocab=a["vocab"], seq_len=a["seq"], d_model=a["d"], heads=4, layers=a["layers"])
    m, name = a["microbatches"], a["schedule"]
    layers = gpt_layers(cfg)
    x, y = synthetic_batch(cfg, a["rows"] * m, 0)
    bal = pe.balance_layers(layers, (x[:a["rows"]],), name, num_ranks=world, microbatches=m, loss_fn=lm_loss,
                            target=y[:a["rows"]], repeats=a["profile_repeats"])
    costs = bal.layers  # what rank 0 measured, as every rank got it
    blocks = S.equal_sizes(cfg.layers, world)
    equal = [n + (s == 0) + (s == world - 1) for s, n in enumerate(blocks)]  # embedding first, head last
    splits = {"equal blocks": equal, "balanced": bal.sizes}
    steps, rows = {}, []
    for label, sizes in splits.items():
        mods = pe.stage_modules([copy.deepcopy(layer) for layer in layers], sizes)
        sched = pe.get_schedule_class(name)(pe.PipelineStage(mods[rank], rank, world, "cpu"), m, loss_fn=lm_loss)
        args = (x,) if rank == 0 else ()
        target = y if rank == world - 1 else None
        steps[label] = lambda sched=sched, args=args, target=target: sched.step(*args, target=target)
        sim = S.evaluate_split(bal.schedule, costs, sizes)
        rows.append({"split": label, "sizes": sizes, "sim_ms": sim.makespan * 1e3, "bubble": sim.bubble_rate})
        steps[label]()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(a["repeats"]):
        for label, step in steps.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(a["steps"]):
                step()
            dist.barrier()
            times[label].append((time.perf_counter() - t0) / a["steps"])
    for row in rows:
        row["ms"] = statistics.median(times[row["split"]]) * 1e3
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--rows", type=int, default=4, help="rows per microbatch")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved timed repeats")
    ap.add_argument("--steps", type=int, default=2, help="steps per timed repeat")
    ap.add_argument("--profile-repeats", type=int, default=5)
    a = vars(ap.parse_args())
    from pipeline_ext.dist.launch import spawn

    res = spawn(worker, WORLD, a, timeout=1800, threads=1)
    rows = res[0][1]
    ms = {r["split"]: max(res[k][1][i]["ms"] for k in res) for i, r in enumerate(rows)}
    print(f"{WORLD} ranks, schedule {a['schedule']}, demo GPT: {a['layers']} blocks d={a['d']} vocab={a['vocab']} "
          f"seq={a['seq']}, {a['microbatches']} microbatches x {a['rows']} rows; layers = [embedding, blocks..., head+loss]")
    print(f"{'split':<13} {'layers/stage':<14} {'sim ms/step':>12} {'sim bubble':>11} {'ms/step':>9}")
    for r in rows:
        print(f"{r['split']:<13} {str(r['sizes']):<14} {r['sim_ms']:>12.1f} {r['bubble']:>11.3f} {ms[r['split']]:>9.1f}")
    print(f"(ms/step: median of {a['repeats']} interleaved repeats of {a['steps']} steps, slowest rank; "
          "sim: the simulator under rank 0's profiled costs)")


if __name__ == "__main__":
    main()
