"""Long context: 1F1B on whole sequences against 1F1B over K sequence pieces (Seq1F1B), side by side.

A small GPT (pre-norm blocks, grouped-query causal attention with rotary
positions through ``pipeline_ext.seqchunks``, an MLP), cut into R stages of
two blocks on R Gloo CPU ranks (one torch thread each, each rank pinned to a
core of its own when there are enough, so a bubble is idle time); 4
microbatches of one sequence of 4096 tokens each. The pieces are cut to equal
cost (``seq_split``: causal attention's share of a whole sequence's cost,
``schedules.pieces.attention_share`` of the model's width and weights), since
with equal lengths the last piece, which attends to every key, sets the pace.
Per K (1 = whole sequences, then 2 and 4 pieces) in the same processes,
repeats interleaved:

- exact: the step's loss and every gradient against the unsplit model run on
  the whole sequences on every rank (grad_rel: the largest per-parameter
  |g - g_ref| / |g_ref|; yes when every gradient is within fp32 tolerances);
- activations: the peak of what rank 0 keeps for backward, sampled after
  every action (``ActivationMeter``: inputs, outputs and saved tensors of
  each forward, what an I keeps for its W; plus the gradients later pieces
  left on carried keys and values), over 1F1B's;
- speed: 1F1B's median step time over this one's (``--repeats`` interleaved
  repeats of ``--steps`` steps), and the simulator's prediction of the same
  ratio (``simulated``): each schedule replayed at the per-stage F and B
  costs and, over pieces, the per-piece weights its own timed steps measured
  (``trace_report()``, ``runtime/trace.measure_costs``).

A second line per K gives the speed's 90 % bootstrap interval (the repeats
drawn again with replacement, each repeat's steps of every K together),
whether (S - 1) >= 0.8 (T - 1) holds for the measured S and simulated T, and
the simulator's activation ratio (``SimResult.peak_bytes`` with each piece's
size, ``schedules.pieces.piece_sizes``; the carried keys' gradients are not in
it); and per K where a step's time went (``runtime/trace.replay_gap``): the
simulation at the measured medians, what the actions' varying around those
medians added (a pipeline waits on the slower of two actions), and the
runtime's own time.

    PYTHONPATH=.:tests python benchmarks/bench_long_context.py --ranks 2
    PYTHONPATH=.:tests python benchmarks/bench_long_context.py --ranks 4 --repeats 5
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

DIM, HQ, HKV, HEAD, LAYERS_PER_STAGE = 256, 8, 2, 32, 2
MICROBATCHES, SEQ = 4, 4096
PIECES = (1, 2, 4)


def _stages(ranks: int) -> list[nn.Module]:
    torch.manual_seed(0)
    from models import PieceBlock  # tests/ is on PYTHONPATH (the command in the docstring)

    return [nn.Sequential(*(PieceBlock(s * LAYERS_PER_STAGE + i, DIM, HQ, HKV, HEAD, mlp=4)
                            for i in range(LAYERS_PER_STAGE))) for s in range(ranks)]


def seq_split(block: nn.Module) -> float:
    """Causal attention's share of a whole sequence's cost in ``block``: the ``seq_split`` of equal-cost pieces."""
    from pipeline_ext.schedules.pieces import attention_share

    matmul = sum(m.weight.numel() for m in block.modules() if isinstance(m, nn.Linear))
    return attention_share(length=SEQ, width=HQ * HEAD, matmul_params=matmul)


def worker(rank: int, world: int, steps: int, repeats: int) -> dict:
    import torch.distributed as dist

    import pipeline_ext as pe
    from bench_zb_sac import pin_to_own_core  # benchmarks/ is on sys.path when run as a script
    from pipeline_ext.runtime.memory import ActivationMeter
    from pipeline_ext.runtime.trace import replay_gap
    from pipeline_ext.schedules.pieces import piece_lengths, piece_sizes

    pinned = pin_to_own_core(rank, world)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(MICROBATCHES, SEQ, DIM, generator=g)
    y = torch.randn(MICROBATCHES, SEQ, DIM, generator=g)
    ref = _stages(world)
    split = seq_split(ref[0][0])
    out = x
    for s in ref:
        out = s(out)
    F.mse_loss(out, y).backward()
    ref_grads = [p.grad.clone() for p in ref[rank].parameters()]
    del ref, out

    scheds, mods, result = {}, {}, {}
    for k in PIECES:
        mods[k] = _stages(world)[rank]
        stage = pe.PipelineStage(mods[k], rank, world, "cpu")
        scheds[k] = pe.Schedule1F1B(stage, MICROBATCHES, loss_fn=F.mse_loss, seq_chunks=k, seq_split=split,
                                    timeout=600)

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
        result[k] = dict(exact=bool(flags.item()), grad_rel=rel, activations=meter.peak_bytes, times=[])
    # the timed steps, traced: the simulator's costs are those of exactly these steps (runtime/trace.py)
    for k in PIECES:
        scheds[k].enable_tracing(True)
    for _ in range(repeats):  # interleaved: every K once per repeat, side by side
        for k in PIECES:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                step(k)
            dist.barrier()
            result[k]["times"].append((time.perf_counter() - t0) / steps)
    for k in PIECES:
        report = scheds[k].trace_report()
        if report is not None:
            sim = report.simulated
            result[k]["sim"] = sim.makespan
            gaps = [replay_gap(report.schedule, st, report.costs) for st in report.steps]
            result[k]["gap"] = {key: statistics.median(g[key] for g in gaps) for key in gaps[0]}
            if k == 1:  # whole sequences: a unit is one sequence's activations
                result[k]["sim_activations"] = float(sim.peak_activations[0])
            else:  # a mean piece is 1/K of a sequence's; each piece weighted by its length
                sizes = piece_sizes(piece_lengths(SEQ, k, split))
                result[k]["sim_activations"] = sim.peak_bytes(1.0 / k, sizes)[0]
    result["pinned"], result["split"] = pinned, split
    dist.barrier()
    return result


def main() -> None:
    from bench_zb_sac import gain_interval  # benchmarks/ is on sys.path when run as a script

    from pipeline_ext.comm.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, choices=[2, 4])
    ap.add_argument("--steps", type=int, default=1, help="steps per timed repeat")
    ap.add_argument("--repeats", type=int, default=12, help="interleaved repeats (at least 5)")
    args = ap.parse_args()
    if args.repeats < 5:
        ap.error("--repeats must be at least 5: the speed is a median over the repeats")
    out = spawn(worker, args.ranks, args.steps, args.repeats, timeout=7200, threads=1)
    rows = out[0][1]
    base = rows[1]
    print(f"{args.ranks} Gloo CPU ranks (one thread each, {rows['pinned']}), 1F1B, {MICROBATCHES} microbatches of "
          f"one sequence of {SEQ} tokens, {LAYERS_PER_STAGE} blocks of dim {DIM} per stage, pieces of equal cost "
          f"(seq_split={rows['split']:.3f}); torch {torch.__version__}; medians of {args.repeats} interleaved "
          f"repeats x {args.steps} steps; rank 0's activations")
    for k in PIECES[1:]:
        r = rows[k]
        speed = statistics.median(base["times"]) / statistics.median(r["times"])
        sim = base["sim"] / r["sim"]
        print(f"long context: {k} chunks exact {'yes' if r['exact'] else 'no'} grad_rel {r['grad_rel']:.1e} "
              f"activations {r['activations'] / base['activations']:.2f}x of 1F1B speed {speed:.2f}x "
              f"of 1F1B (simulated {sim:.2f}x)")
        lo, hi = gain_interval(base["times"], r["times"])
        print(f"  {k} chunks: speed 90 % bootstrap interval [{lo:.2f}, {hi:.2f}] over {args.repeats} repeats; "
              f"(S - 1) >= 0.8 (T - 1): {'yes' if speed - 1 >= 0.8 * (sim - 1) else 'no'} "
              f"({speed - 1:+.3f} vs {0.8 * (sim - 1):+.3f}); simulated activations "
              f"{r['sim_activations'] / base['sim_activations']:.2f}x of 1F1B")
    for k in PIECES:
        gap = rows[k]["gap"]
        print(f"  where a step's time went, K = {k} (ms, medians over the timed steps, runtime/trace.replay_gap): "
              f"simulated {gap['simulated'] * 1e3:.0f} + compute varying around its medians "
              f"{gap['compute'] * 1e3:.0f} + messages and the runtime "
              f"{sum(gap[x] for x in ('latency', 'send', 'recv', 'between')) * 1e3:.0f} = traced "
              f"{gap['traced'] * 1e3:.0f}")


if __name__ == "__main__":
    main()
