"""Long context: 1F1B on whole sequences against 1F1B over K sequence pieces (Seq1F1B), side by side.

A small GPT (pre-norm blocks, grouped-query causal attention with rotary
positions through ``pipeline_ext.seqchunks``, an MLP), cut into R stages of
two blocks on R Gloo CPU ranks (one torch thread each, so a bubble is idle
time); 4 microbatches of one sequence each. Per K (1 = whole sequences, then
2 and 4 pieces) in the same processes, repeats interleaved:

- exact: the step's loss and every gradient against the unsplit model run on
  the whole sequences on every rank (grad_rel: the largest per-parameter
  |g - g_ref| / |g_ref|; yes when every gradient is within fp32 tolerances);
- activations: the peak of what rank 0 keeps for backward, sampled after
  every action (``ActivationMeter``: inputs, outputs and saved tensors of
  each forward, what an I keeps for its W; plus the gradients later pieces
  left on carried keys and values), over 1F1B's;
- speed: the median step time of 1F1B over this one's (medians of --repeats
  repeats of --steps steps), and the simulator's prediction of the same
  ratio (``simulated``): each schedule replayed at the per-stage F, B and
  message costs its own traced step measured (``trace_report()``).

    PYTHONPATH=.:tests python benchmarks/bench_long_context.py --ranks 2
    PYTHONPATH=.:tests python benchmarks/bench_long_context.py --ranks 4
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

DIM, HQ, HKV, HEAD, LAYERS_PER_STAGE = 256, 8, 2, 32, 2
MICROBATCHES, SEQ = 4, 2048
PIECES = (1, 2, 4)


def _stages(ranks: int) -> list[nn.Module]:
    torch.manual_seed(0)
    from models import PieceBlock  # tests/ is on PYTHONPATH (the command in the docstring)

    return [nn.Sequential(*(PieceBlock(s * LAYERS_PER_STAGE + i, DIM, HQ, HKV, HEAD, mlp=4)
                            for i in range(LAYERS_PER_STAGE))) for s in range(ranks)]


def worker(rank: int, world: int, steps: int, repeats: int) -> dict:
    import torch.distributed as dist

    import pipeline_ext as pe
    from bench_agreement import interleaved_medians  # benchmarks/ is on sys.path when run as a script
    from pipeline_ext.runtime.memory import ActivationMeter

    g = torch.Generator().manual_seed(0)
    x = torch.randn(MICROBATCHES, SEQ, DIM, generator=g)
    y = torch.randn(MICROBATCHES, SEQ, DIM, generator=g)
    ref = _stages(world)
    out = x
    for s in ref:
        out = s(out)
    F.mse_loss(out, y).backward()
    ref_grads = [p.grad.clone() for p in ref[rank].parameters()]

    scheds, mods, result = {}, {}, {}
    for k in PIECES:
        mods[k] = _stages(world)[rank]
        stage = pe.PipelineStage(mods[k], rank, world, "cpu")
        scheds[k] = pe.Schedule1F1B(stage, MICROBATCHES, loss_fn=F.mse_loss, seq_chunks=k, timeout=600)

    def step(k: int) -> None:
        for p in mods[k].parameters():
            p.grad = None
        scheds[k].step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None)

    # exactness and the activation peak, on one step each
    for k in PIECES:
        meter = ActivationMeter()
        runner = scheds[k].stages[rank]._runner
        handle = meter.watch(runner)
        pieces = runner.pieces

        def sample(_: object, meter=meter, pieces=pieces) -> None:
            if pieces is not None:  # the gradients carried back to earlier pieces' keys and values count too
                meter.track(pieces.carried_gradients())
            meter.sample()

        hook = scheds[k].register_action_hook(sample)
        step(k)
        hook.remove()
        handle.remove()
        rel = max(((p.grad - q).norm() / q.norm()).item() for p, q in zip(mods[k].parameters(), ref_grads))
        ok = all(torch.allclose(p.grad, q, rtol=1e-4, atol=1e-6) for p, q in zip(mods[k].parameters(), ref_grads))
        flags = torch.tensor([int(ok)])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        result[k] = dict(exact=bool(flags.item()), grad_rel=rel, activations=meter.peak_bytes)
    times = interleaved_medians({k: (lambda k=k: step(k)) for k in PIECES}, steps, repeats, warmup=1)
    for k in PIECES:
        result[k]["ms"] = times[k] * 1e3
    # the simulator's prediction: each schedule replayed at the costs its own traced step measured (runtime/trace.py)
    for k in PIECES:
        scheds[k].enable_tracing(True)
        step(k)
        report = scheds[k].trace_report()
        scheds[k].enable_tracing(False)
        if report is not None:
            result[k]["sim"] = report.simulated.makespan
    dist.barrier()
    return result


def main() -> None:
    from pipeline_ext.comm.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, choices=[2, 4])
    ap.add_argument("--steps", type=int, default=2, help="steps per timed repeat")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    out = spawn(worker, args.ranks, args.steps, args.repeats, timeout=3600, threads=1)
    rows = out[0][1]
    base = rows[1]
    print(f"{args.ranks} Gloo CPU ranks (one thread each), 1F1B, {MICROBATCHES} microbatches of one sequence of {SEQ} "
          f"tokens, {LAYERS_PER_STAGE} blocks of dim {DIM} per stage; torch {torch.__version__}; medians of "
          f"{args.repeats} interleaved repeats x {args.steps} steps; rank 0's activations")
    for k in PIECES[1:]:
        r = rows[k]
        print(f"long context: {k} chunks exact {'yes' if r['exact'] else 'no'} grad_rel {r['grad_rel']:.1e} "
              f"activations {r['activations'] / base['activations']:.2f}x of 1F1B speed {base['ms'] / r['ms']:.2f}x "
              f"of 1F1B (simulated {base['sim'] / r['sim']:.2f}x)")


if __name__ == "__main__":
    main()
