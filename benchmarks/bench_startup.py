"""Time to the first step of a fresh rank: pipeline_ext vs torch.distributed.pipelining, side by side.

Every job (torchrun, a scheduler's retry, each test that needs fresh ranks)
pays a rank's start-up again: the interpreter, the imports, the process
group, the stage and the schedule, the first step. This starts 2-rank jobs
on fresh interpreters as torchrun does (``MASTER_ADDR``/``MASTER_PORT``,
``RANK``, ``WORLD_SIZE``), the two libraries alternating in the same repeats,
and prints per library the median seconds from the process start to: imports
done, process group up, schedule built, first step done, and exit; plus
the ratio ours / torch of the time to the first step. Both run the same
2-stage MLP, 1F1B over Gloo, 4 microbatches, one intra-op thread.

    PYTHONPATH=. python benchmarks/bench_startup.py --repeats 5
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import textwrap
import time

RANK = textwrap.dedent("""
    import os, sys, time
    t0 = float(os.environ["JOB_T0"])
    marks = {}
    def mark(k): marks[k] = time.time() - t0
    import torch
    import torch.distributed as dist
    from torch import nn
    if os.environ["JOB_LIB"] == "ours":
        import pipeline_ext as lib
    else:
        import torch.distributed.pipelining as lib
    mark("import")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mark("group")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    stage = lib.PipelineStage(model[2 * rank:2 * rank + 2], rank, 2, torch.device("cpu"))
    sched = lib.Schedule1F1B(stage, 4, loss_fn=nn.functional.mse_loss)
    mark("schedule")
    x, y = torch.randn(16, 64), torch.randn(16, 64)
    sched.step(x) if rank == 0 else sched.step(target=y)
    mark("first step")
    dist.destroy_process_group()
    print(" ".join(f"{k.replace(' ', '_')}={v:.3f}" for k, v in marks.items()), flush=True)
""")

PHASES = ["import", "group", "schedule", "first_step", "exit"]


def job(lib: str, port: int) -> dict[str, float]:
    """One 2-rank job; the slower rank's seconds since the job started, per phase."""
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, "-c", RANK], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                                       WORLD_SIZE="2", JOB_LIB=lib, JOB_T0=repr(t0)))
             for r in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    exit_s = time.time() - t0
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{lib}: a rank failed: {outs}")
    per_rank = [dict((k, float(v)) for k, v in (kv.split("=") for kv in out.split())) for out in outs]
    return {**{k: max(r[k] for r in per_rank) for k in PHASES[:-1]}, "exit": exit_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from pipeline_ext.comm.launch import free_port

    runs: dict[str, list[dict[str, float]]] = {"ours": [], "torch": []}
    for _ in range(args.repeats):
        for lib in runs:
            runs[lib].append(job(lib, free_port()))
    print(f"2 ranks on fresh interpreters, 1F1B over Gloo; seconds from the job's start (slower rank), medians of "
          f"{args.repeats} interleaved repeats")
    print(f"{'library':8}" + "".join(f"{p:>12}" for p in PHASES))
    med = {lib: {p: statistics.median(r[p] for r in rs) for p in PHASES} for lib, rs in runs.items()}
    for lib in runs:
        print(f"{lib:8}" + "".join(f"{med[lib][p]:12.2f}" for p in PHASES))
    print(f"time to the first step, ours / torch: {med['ours']['first_step'] / med['torch']['first_step']:.2f}")


if __name__ == "__main__":
    main()
