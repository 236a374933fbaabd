"""pp2 x tp2 1F1B training step with DTensor activations between stages: pipeline_ext vs torch 2.13.

4 Gloo CPU ranks, mesh (pp=2, tp=2); each stage two MLP blocks made tensor-parallel (w1 colwise, w2
rowwise, ``use_local_output=False``: Replicate DTensors cross the stages, or sequence parallel Shard(1)).
Both libraries run the same modules in the same processes, interleaved repeats; the ratio is of medians.
Also timed on one rank: what the DTensor path adds per message (``to_wire`` of a stage's output and
``from_wire`` on the receiver, no transport), the part of the layout that plain tensors never pay.

    PYTHONPATH=.:tests:tests/parallel python benchmarks/bench_tensor_parallel.py [--steps 10] [--repeats 5] [--case replicate]
"""
from __future__ import annotations

import argparse
import time

import torch


def worker(rank: int, world: int, case: str, steps: int, repeats: int, dim: int) -> dict[str, float]:
    import torch.distributed as dist
    from torch.distributed import pipelining as tpp
    from torch.distributed.device_mesh import init_device_mesh

    import pipeline_ext as pe
    import tp_case as T
    from bench_agreement import interleaved_medians  # benchmarks/ is on sys.path when run as a script
    from pipeline_ext.runtime import dtensor_wire

    T.D, T.H = dim, 4 * dim
    rows, seq, m = 16, 16, 4
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    tp, pp = mesh["tp"], mesh["pp"]
    s = pp.get_local_rank()
    torch.manual_seed(0)
    mod_pe = T.parallelize(T.Stage(), s, 2, case, tp)
    torch.manual_seed(0)
    mod_t = T.parallelize(T.Stage(), s, 2, case, tp)
    sched_pe = pe.Schedule1F1B(pe.PipelineStage(mod_pe, s, 2, "cpu", group=pp), m, loss_fn=T.mse)
    stage_t = tpp.PipelineStage(mod_t, s, 2, torch.device("cpu"), group=pp.get_group(),
                                get_mesh=lambda names, layout: mesh[names])
    sched_t = tpp.Schedule1F1B(stage_t, m, loss_fn=T.mse, scale_grads=True)
    x, y = torch.randn(rows, seq, dim), torch.randn(rows, seq, dim)

    def step(sched) -> None:
        sched.step(x) if s == 0 else sched.step(target=y)

    fns = {"pipeline_ext": lambda: step(sched_pe), "torch": lambda: step(sched_t)}
    out = {k: t * 1e3 for k, t in interleaved_medians(fns, steps, repeats, warmup=2).items()}
    # the DTensor path's own cost per message, on this rank (stage 0 produces one DTensor per microbatch)
    if s == 0:
        with torch.no_grad():
            y0 = mod_pe(x[: rows // m])
        if isinstance(y0, dtensor_wire.dtensor_type()):
            finder = dtensor_wire.MeshFinder(mod_pe)
            n = 2000
            t0 = time.perf_counter()
            for _ in range(n):
                dtensor_wire.from_wire(dtensor_wire.to_wire((y0,), 0, 0), finder, 1, 0)
            out["wire_us"] = (time.perf_counter() - t0) / n * 1e6
    dist.barrier()
    return out


def main() -> None:
    from pipeline_ext.comm.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10, help="steps per timed repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--case", default="replicate", choices=["local", "replicate", "sequence"])
    ap.add_argument("--dim", type=int, default=64)
    args = ap.parse_args()
    out = spawn(worker, 4, args.case, args.steps, args.repeats, args.dim, timeout=900, threads=1)
    row = out[0][1]
    print(f"pp2 x tp2, 4 Gloo CPU ranks, 1F1B, 4 microbatches, case {args.case}, dim {args.dim}, torch "
          f"{torch.__version__}; medians of {args.repeats} interleaved repeats x {args.steps} steps (rank 0)")
    print(f"pipeline_ext step  {row['pipeline_ext']:.2f} ms")
    print(f"torch step         {row['torch']:.2f} ms   (pipeline_ext / torch = "
          f"{row['pipeline_ext'] / row['torch']:.2f})")
    if "wire_us" in row:
        print(f"DTensor layout per message (to_wire + from_wire, no transport): {row['wire_us']:.1f} us")


if __name__ == "__main__":
    main()
