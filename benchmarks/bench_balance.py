"""Stages balanced by measured cost vs equal block counts: the demo GPT on 2 ranks, the Llama example on 4.

``demo.gpt_stages`` and the Llama example (``examples/llama_pipeline.py``)
spread the blocks (decoder layers) evenly, so the first stage also carries the
embedding and the last the final norm, the LM head and the loss; with a large
vocabulary the head alone costs several blocks and the pipeline waits on the
last stage every microbatch. ``pe.balance_layers`` profiles each entry of the
model's layer list (``demo.gpt_layers``, or the example's ``llama_layers``:
embedding, each block, head; rank 0, one microbatch, loss on the head) and
picks the split with the least simulated step of the schedule.

Both splits run in the same processes (``--ranks``, Gloo on 127.0.0.1, one
thread each), the same weights, timed in interleaved repeats (each repeat
times every split side by side); the table has the median ms/step (slowest
rank), the measured bubble of the timed steps (the schedule's tracer:
``trace_report().measured_bubble``, median over steps) and the simulator's
step and bubble under rank 0's profiled costs.

    PYTHONPATH=. python benchmarks/bench_balance.py
    PYTHONPATH=. python benchmarks/bench_balance.py --schedule zb_h1 --vocab 16384 --layers 8 --repeats 7
    PYTHONPATH=. python benchmarks/bench_balance.py --model llama --ranks 4 --vocab 8192
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def gpt_model(a: dict[str, Any]) -> dict[str, Any]:
    """The demo GPT: its layer list, one step's batch, and a stage of a split (blocks = transformer blocks)."""
    import pipeline_ext as pe
    from pipeline_ext.demo.model import GPTConfig, gpt_layers, lm_loss, synthetic_batch

    cfg = GPTConfig(vocab=a["vocab"], seq_len=a["seq"], d_model=a["d"], heads=4, layers=a["layers"])
    layers = gpt_layers(cfg)
    x, y = synthetic_batch(cfg, a["rows"] * a["microbatches"], 0)

    def stage(sizes: list[int], s: int) -> torch.nn.Module:
        return pe.stage_modules([copy.deepcopy(layer) for layer in layers], sizes)[s]

    return {"layers": layers, "args": (x,), "kwargs": {}, "target": y, "loss_fn": lm_loss, "blocks": cfg.layers,
            "stage": stage, "what": f"demo GPT: {a['layers']} blocks d={a['d']} vocab={a['vocab']} seq={a['seq']}"}


def llama_model(a: dict[str, Any]) -> dict[str, Any]:
    """The Llama example's model (``--size``, ``--vocab``): ``llama_layers``, a batch, and ``LlamaStage`` cuts."""
    sys.path.insert(0, str(EXAMPLES))
    import llama_pipeline as L

    import pipeline_ext as pe

    config = L.llama_config(a["size"], a["seq"], vocab=a["vocab"])
    torch.manual_seed(0)
    full = L.LlamaForCausalLM(config)
    ids, mask, labels = L.make_batch(a["rows"] * a["microbatches"], a["seq"], config.vocab_size, 0)
    n = a["ranks"]

    def stage(sizes: list[int], s: int) -> torch.nn.Module:
        return L.LlamaStage(copy.deepcopy(full), *pe.block_ranges(sizes)[s], first=s == 0, last=s == n - 1)

    return {"layers": L.llama_layers(full), "args": (ids,), "kwargs": {"attention_mask": mask}, "target": labels,
            "loss_fn": L.lm_loss, "blocks": config.num_hidden_layers, "stage": stage,
            "what": f"Llama example: {config.num_hidden_layers} decoder layers hidden={config.hidden_size} "
                    f"vocab={config.vocab_size} seq={a['seq']}"}


MODELS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {"gpt": gpt_model, "llama": llama_model}


def worker(rank: int, world: int, a: dict[str, Any]) -> list[dict[str, Any]]:
    import torch.distributed as dist

    import pipeline_ext as pe
    from pipeline_ext import schedules as S

    torch.set_num_threads(1)
    model = MODELS[a["model"]](a)
    m, name, rows = a["microbatches"], a["schedule"], a["rows"]
    one = lambda t: t[:rows]  # noqa: E731  (the first microbatch)
    bal = pe.balance_layers(model["layers"], tuple(map(one, model["args"])), name, num_ranks=world, microbatches=m,
                            example_kwargs={k: one(v) for k, v in model["kwargs"].items()},
                            loss_fn=model["loss_fn"], target=one(model["target"]), repeats=a["profile_repeats"])
    costs = bal.layers  # what rank 0 measured, as every rank got it
    splits = {"equal blocks": pe.sizes_with_ends(S.equal_sizes(model["blocks"], world)), "balanced": bal.sizes}
    steps, scheds, rows_out = {}, {}, []
    for label, sizes in splits.items():
        sched = pe.get_schedule_class(name)(pe.PipelineStage(model["stage"](sizes, rank), rank, world, "cpu"), m,
                                            loss_fn=model["loss_fn"])
        args, kwargs = (model["args"], model["kwargs"]) if rank == 0 else ((), {})
        target = model["target"] if rank == world - 1 else None
        steps[label] = lambda sched=sched, args=args, kwargs=kwargs, target=target: sched.step(*args, target=target,
                                                                                                **kwargs)
        scheds[label] = sched
        sim = S.evaluate_split(bal.schedule, costs, sizes)
        rows_out.append({"split": label, "sizes": sizes, "sim_ms": sim.makespan * 1e3, "bubble": sim.bubble_rate})
        steps[label]()  # warm-up (and the first step's shape exchange, left out of the trace)
        sched.enable_tracing()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(a["repeats"]):
        for label, step in steps.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(a["steps"]):
                step()
            dist.barrier()
            times[label].append((time.perf_counter() - t0) / a["steps"])
    for row in rows_out:
        row["ms"] = statistics.median(times[row["split"]]) * 1e3
        report = scheds[row["split"]].trace_report(dst=0)  # a collective: the report on rank 0
        row["measured_bubble"] = report.measured_bubble if report is not None else None
    if rank == 0:
        rows_out[0]["what"] = model["what"]
    return rows_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt", choices=sorted(MODELS))
    ap.add_argument("--ranks", type=int, default=2, help="pipeline ranks (processes), one stage each")
    ap.add_argument("--schedule", default="1f1b", help="a schedule with one stage per rank (1f1b, zb_h1, ...)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--d", type=int, default=128, help="GPT width (Llama: --size)")
    ap.add_argument("--layers", type=int, default=6, help="GPT blocks (Llama: --size)")
    ap.add_argument("--size", default="small", help="Llama: the example's SIZES entry (small: hidden 256, 8 layers)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--rows", type=int, default=4, help="rows per microbatch")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved timed repeats")
    ap.add_argument("--steps", type=int, default=2, help="steps per timed repeat")
    ap.add_argument("--profile-repeats", type=int, default=5)
    a = vars(ap.parse_args())
    from pipeline_ext.comm.launch import spawn

    # pg_timeout: the other ranks wait in a broadcast while rank 0 profiles
    res = spawn(worker, a["ranks"], a, timeout=1800, pg_timeout=600, threads=1)
    rows = res[0][1]
    ms = {r["split"]: max(res[k][1][i]["ms"] for k in res) for i, r in enumerate(rows)}
    print(f"{a['ranks']} ranks, schedule {a['schedule']}, {rows[0]['what']}, {a['microbatches']} microbatches x "
          f"{a['rows']} rows; layers = [embedding, blocks..., head+loss]")
    print(f"{'split':<13} {'layers/stage':<16} {'sim ms/step':>12} {'sim bubble':>11} {'ms/step':>9} "
          f"{'measured bubble':>16}")
    for r in rows:
        print(f"{r['split']:<13} {str(r['sizes']):<16} {r['sim_ms']:>12.1f} {r['bubble']:>11.3f} "
              f"{ms[r['split']]:>9.1f} {r['measured_bubble']:>16.3f}")
    print(f"(ms/step: median of {a['repeats']} interleaved repeats of {a['steps']} steps, slowest rank; measured "
          "bubble: the tracer's, median over the timed steps; sim: the simulator under rank 0's profiled costs)")


if __name__ == "__main__":
    main()
