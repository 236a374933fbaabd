"""Counts host-device synchronisations in one ``Pipe.step`` (needs a CUDA GPU).

Why: a pipeline only overlaps stages if the host keeps queueing work; every
synchronisation stalls the worker thread until the GPU drains. Two independent
counts, after a warm-up step:

- the CUDA runtime calls that block the host (``cudaStreamSynchronize``,
  ``cudaEventSynchronize``, ``cudaDeviceSynchronize``, blocking ``cudaMemcpy``,
  ``cudaFree``), read from the profiler's trace;
- the warnings of ``torch.cuda.set_sync_debug_mode("warn")``.

With every stage on the GPU both must be 0. A CPU stage must wait for the data
it receives from the GPU, so there one ``cudaEventSynchronize`` per received
message is expected and nothing else.

``--ranks 2`` counts the same in one step of a known multi-process pipeline
instead: 2 ranks sharing cuda:0 (each its own NCCL host), 1F1B and ZB-H1 over
NCCL, 4 microbatches of a known shape, after a discovery step; each rank
counts its own step. Only the step records (Gloo, host memory) may wait; a
known step reads nothing from the device.

    python tools/gpu_sync_count.py [--markdown PATH] [--ranks 2]
"""
from __future__ import annotations

import argparse
import warnings
from collections import Counter
from typing import Callable, Optional

import torch
from torch import nn

import pipeline_ext as pe
from pipeline_ext.runtime.trace import profiler_events

SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
              "cudaMemcpy2D", "cudaFree", "cudaMemset")
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zb_h2", "zbv", "dualpipev"]


def runtime_syncs(run: Callable[[], object]) -> Counter:
    events = profiler_events(run)
    return Counter(e["name"] for e in events if e.get("cat") == "cuda_runtime" and e.get("name") in SYNC_CALLS)


def debug_mode_warnings(run: Callable[[], object]) -> list[str]:
    """The sync-debug warnings ``run`` raises (first line of each)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # torch's own text for a synchronising call (its one-time "prototype feature" notice is not one)
    return [str(w.message).splitlines()[0] for w in caught if "called a synchronizing" in str(w.message)]


def model(n_stages: int, d: int = 256) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d)) for _ in range(n_stages)])


def count(name: str, devices: list[str], call: bool = False) -> dict:
    v = 2 if name in pe.pipe.MULTI_STAGE_SCHEDULES else 1
    n = len(devices) * v
    pipe = pe.Pipe(model(n), balance=[1] * n, devices=devices, chunks=4, schedule=name, checkpoint="except_last")
    x = torch.randn(64, 256, device=devices[0])
    y = torch.randn(64, 256, device=devices[-1] if v == 1 else devices[0])
    if call:
        def run() -> None:
            pipe(x).float().pow(2).mean().backward()
    else:
        def run() -> None:
            pipe.step(x, target=y, loss_fn=nn.functional.mse_loss)
    run()  # warm-up: CUDA context, cuBLAS, allocator
    torch.cuda.synchronize()
    calls = runtime_syncs(run)
    torch.cuda.synchronize()
    return {"config": f"{'pipe(x)+backward' if call else 'step'} {name} on {devices}", "calls": calls,
            "warnings": debug_mode_warnings(run)}


def rank_counts(rank: int, world: int, names: list[str]) -> list[dict]:
    """One rank of ``--ranks``: per schedule, the blocking calls and sync warnings of one known step on cuda:0."""
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    baseline = runtime_syncs(lambda: None)
    out = []
    for name in names:
        mod = model(world).to(dev)
        stage = pe.PipelineStage(mod[rank], rank, world, dev)
        cls = pe.get_schedule_class(name)
        sched = cls(stage, 4, loss_fn=nn.functional.mse_loss, transport="process_group")
        x, y = torch.randn(64, 256, device=dev), torch.randn(64, 256, device=dev)

        def run() -> None:
            sched.step(x) if rank == 0 else sched.step(target=y)

        run()  # the discovery step: layouts are exchanged (read on the host) once
        run()
        torch.cuda.synchronize()
        calls = runtime_syncs(run) - baseline
        torch.cuda.synchronize()
        out.append({"config": f"{name} step, rank {rank} of {world} on cuda:0 (NCCL)", "calls": calls,
                    "warnings": debug_mode_warnings(run)})
    return out


def multiprocess(world: int) -> list[dict]:
    from pipeline_ext.comm.launch import spawn

    res = spawn(rank_counts, world, ["1f1b", "zb_h1"], timeout=300, backend="cpu:gloo,cuda:nccl",
                own_nccl_host=True)
    return [row for r in sorted(res) for row in res[r][1]]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--ranks", type=int, default=0, help="count in a multi-process step on this many ranks")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_sync_count: no GPU (torch.cuda.is_available() is False); nothing to count")
        return 0
    if args.ranks:
        return _report(multiprocess(args.ranks), [], args.markdown)
    # What the profiler itself calls (it synchronises the device when it stops).
    baseline = runtime_syncs(lambda: None)
    rows = [{"config": "profiler alone (subtracted below)", "calls": baseline, "warnings": []}]
    measured = [count(name, ["cuda:0", "cuda:0"]) for name in SCHEDULES]
    measured.append(count("gpipe", ["cuda:0", "cuda:0"], call=True))
    measured.append(count("1f1b", ["cuda:0", "cpu"]))
    for r in measured:
        r["calls"] = r["calls"] - baseline
    return _report(measured, rows, args.markdown)


def _report(measured: list[dict], rows: list[dict], markdown: Optional[str]) -> int:
    """Print (and write) the table; 1 when a configuration with every stage on the GPU synchronised."""
    rows = rows + measured
    lines = ["| configuration | blocking CUDA runtime calls | sync-debug warnings |", "|---|---|---|"]
    for r in rows:
        calls = ", ".join(f"{k} x{v}" for k, v in sorted(r["calls"].items())) or "none"
        warned = "; ".join(sorted(set(r["warnings"])))
        lines.append(f"| {r['config']} | {calls} | {len(r['warnings'])}{': ' + warned if warned else ''} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if markdown:
        with open(markdown, "w") as f:
            f.write(text)
    all_gpu = [r for r in measured if "cpu" not in r["config"]]
    return 1 if any(r["calls"] or r["warnings"] for r in all_gpu) else 0


if __name__ == "__main__":
    raise SystemExit(main())
