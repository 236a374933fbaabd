"""What torch.distributed.pipelining and pipeline_ext accept, side by side: an uneven batch, a batch-size
change between steps, a sequence-length change (2 Gloo ranks, Schedule1F1B, 2 microbatches).

    python tools/torch_shape_probe.py

Prints, per library and case, what each rank ended with ("ok" or the last line of its error).
"""
import sys, torch
from torch import nn
from pipeline_ext.launch import spawn

def worker(rank, world, lib, case):
    if lib == "torch":
        import torch.distributed.pipelining as P
        mk = lambda mod: P.PipelineStage(mod, rank, world, torch.device("cpu"))
    else:
        import pipeline_ext as P
        mk = lambda mod: P.PipelineStage(mod, rank, world, "cpu")
    torch.manual_seed(0)
    mod = nn.Linear(8, 8)
    sched = P.Schedule1F1B(mk(mod), 2, loss_fn=nn.functional.mse_loss)
    shapes = {"uneven": [(7, 8)], "batch_change": [(8, 8), (6, 8)], "seq_change": [(4, 5, 8), (4, 3, 8)],
              "even": [(8, 8)]}[case]
    for sh in shapes:
        x = torch.randn(*sh)
        sched.step(*((x,) if rank == 0 else ()), **({"target": torch.zeros(sh)} if rank == 1 else {}))
    return "ok"

if __name__ == "__main__":
    for lib in ("torch", "pipeline_ext"):
        for case in ("even", "uneven", "batch_change", "seq_change"):
            try:
                out = spawn(worker, 2, lib, case, timeout=40, pg_timeout=20, raise_errors=False)
                res = {r: (s if s != "error" else v.strip().splitlines()[-1][:150]) for r, (s, v) in out.items()}
            except Exception as exc:
                res = f"{type(exc).__name__}: {str(exc)[:200]}"
            print(lib, case, res, flush=True)
