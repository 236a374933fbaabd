"""What torch.distributed.pipelining and pipeline_ext accept, side by side: an uneven batch, a batch-size
change between steps, a sequence-length change (2 Gloo ranks, Schedule1F1B, 2 microbatches).

    PYTHONPATH=. python tools/torch_shape_probe.py

Prints, per library and case, what each rank ended with ("ok" or the last line
of its error). This is the measurement behind docs/parity.md ("What torch 2.13 refuses
and we accept"); rerun it when torch changes.
"""
from __future__ import annotations

import torch
from torch import nn

from pipeline_ext.comm.launch import spawn

CASES = {"even": [(8, 8)], "uneven": [(7, 8)], "batch_change": [(8, 8), (6, 8)],
         "seq_change": [(4, 5, 8), (4, 3, 8)]}


def worker(rank: int, world: int, lib: str, case: str) -> str:
    if lib == "torch":
        import torch.distributed.pipelining as P

        stage = P.PipelineStage(nn.Linear(8, 8), rank, world, torch.device("cpu"))
    else:
        import pipeline_ext as P

        stage = P.PipelineStage(nn.Linear(8, 8), rank, world, "cpu")
    sched = P.Schedule1F1B(stage, 2, loss_fn=nn.functional.mse_loss)
    for shape in CASES[case]:
        x = torch.randn(*shape)
        sched.step(*((x,) if rank == 0 else ()), **({"target": torch.zeros(shape)} if rank == 1 else {}))
    return "ok"


def main() -> None:
    for lib in ("torch", "pipeline_ext"):
        for case in CASES:
            out = spawn(worker, 2, lib, case, timeout=60, pg_timeout=20, raise_errors=False)
            said = {r: s if s != "error" else v.strip().splitlines()[-1][:150] for r, (s, v) in sorted(out.items())}
            print(f"{lib:13s} {case:13s} {said}", flush=True)


if __name__ == "__main__":
    main()
