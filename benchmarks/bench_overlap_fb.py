"""How much of a slow all-to-all DualPipeV's overlapped pairs hide (CPU proxy, 2 pipeline ranks over Gloo).

Why: the point of running an ``OVERLAP_F_B`` pair's F and B at the same time
(``runtime/overlap.py``) is that one half's communication waits hide behind
the other half's compute. On a CPU host with no real network, the
communication is a *known* delay: each MoE layer's dispatch and combine
(forward) and their gradients (backward) wait ``d`` seconds inside
``pe.comm_region()``, as a slow expert all-to-all would (EP=1: the
all-to-all itself is the identity, only its latency is modelled).

Each rank times its own steps with overlap off, on, and without any delay,
interleaved (one schedule; ``sched.overlap`` and the delay set between
steps), and reports medians. The delay on the critical path is what the
delays add to the step with overlap off, t_off - t_none (a rank's step also
waits on its peer's delays, so counting the delays in this rank's own pairs,
4 per MoE layer per pair, would not be it); hidden = (t_off - t_on) /
(t_off - t_none).

    python benchmarks/bench_overlap_fb.py [--delay 0.01] [--repeats 7] [--markdown PATH]
    python benchmarks/bench_overlap_fb.py --pair-cost   # the runner's own host time per pair
"""
from __future__ import annotations

import argparse
import statistics
import time

from typing import Optional

import torch
from torch import nn

M = 8  # microbatches (dualpipev needs m >= 2p)
LAYERS = 2  # MoE layers per stage (MoEProxy)


class _Latency(torch.autograd.Function):
    """Identity whose forward and backward each wait ``d`` seconds in a comm region (a slow all-to-all)."""

    @staticmethod
    def forward(ctx, x, d):  # type: ignore[override]
        import pipeline_ext as pe

        ctx.d = d
        with pe.comm_region():
            time.sleep(d)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        import pipeline_ext as pe

        with pe.comm_region():
            time.sleep(ctx.d)
        return grad, None


def _mlp(d_model: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.GELU(), nn.Linear(2 * d_model, d_model))


class MoEProxy(nn.Module):
    """``layers`` MoE layers and a closing block: each layer is attention (an MLP stands in) -> dispatch (a
    wait) -> expert -> combine (a wait), residual; the closing block is the next layer's attention.

    Shaped as DualPipe wants a model: compute between every two waits, in both directions, including before
    the first wait of the forward and after the last (the closing block), so every wait can hide behind the
    other half's compute. A stage without that (nothing after its last combine) exposes the waits at a
    half's ends."""

    def __init__(self, d_model: int, delay: float, last: bool, layers: int = 2) -> None:
        super().__init__()
        self.delay = delay
        self.attn = nn.ModuleList([_mlp(d_model) for _ in range(layers)])
        self.experts = nn.ModuleList([_mlp(d_model) for _ in range(layers)])
        self.close = _mlp(d_model)
        self.head = nn.Linear(d_model, 4) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for attn, expert in zip(self.attn, self.experts):
            x = x + torch.tanh(attn(x))
            x = x + _Latency.apply(expert(_Latency.apply(x, self.delay)), self.delay)
        x = x + torch.tanh(self.close(x))
        return self.head(x) if self.head is not None else x


def worker(rank: int, world: int, d_model: int, rows: int, delay: float, repeats: int, M: int = M,
           trace: Optional[str] = None) -> dict:
    import pipeline_ext as pe

    n = 2 * world
    torch.manual_seed(0)
    modules = [MoEProxy(d_model, delay, last=s == n - 1) for s in range(n)]
    mine = [rank, n - 1 - rank]
    stages = [pe.PipelineStage(modules[s], s, n, "cpu") for s in mine]
    sched = pe.ScheduleDualPipeV(stages, M, loss_fn=lambda o, t: nn.functional.mse_loss(o, t), timeout=120.0)
    x, y = torch.randn(M * rows, d_model), torch.randn(M * rows, 4)  # M: this run's microbatches
    modes = {"off": (False, delay), "on": (True, delay), "none": (False, 0.0)}
    times: dict[str, list[float]] = {k: [] for k in modes}
    for i in range(repeats + 1):
        order = list(modes)[i % 3:] + list(modes)[:i % 3]  # interleaved, each mode in each position
        for mode in order:
            sched.overlap, d = modes[mode]
            for m in modules:
                m.delay = d
            torch.distributed.barrier()
            t0 = time.perf_counter()
            sched.step(x if rank == 0 else None, target=y if rank == 0 else None)
            if i:  # the first round warms up
                times[mode].append(time.perf_counter() - t0)
    pairs = sum(1 for f, _ in sched.schedule.overlapped if f.stage in mine)
    if trace:  # one more step with overlap on, traced: the measured timeline shows each pair's halves overlapping
        sched.overlap = True
        for m in modules:
            m.delay = delay
        sched.enable_tracing(True)
        sched.step(x if rank == 0 else None, target=y if rank == 0 else None)
        report = sched.trace_report()
        if report is not None:
            report.write_png(trace)
            report.write_chrome_trace(trace.rsplit(".", 1)[0] + ".json")
    return {**{k: statistics.median(v) for k, v in times.items()}, "pairs": pairs}


def pair_alone(d_model: int, rows: int, delay: float, repeats: int) -> dict:
    """The pair runner alone, in this process (one core is enough): a pair of F and B halves, each a stage of
    ``MoEProxy`` (compute segments between 4 waits of ``delay`` per layer), run one after the other
    vs overlapped. Free of the pipeline and of the other rank's load: what the baton itself hides."""
    from pipeline_ext.runtime.overlap import run_overlapped
    from pipeline_ext.schedules import Action, ActionKind

    torch.set_num_threads(1)
    layer = MoEProxy(d_model, delay, last=False)
    x = torch.randn(rows, d_model, requires_grad=True)
    pending: dict = {}

    def forward() -> None:
        pending["out"] = layer(x).sum()

    # B of an earlier microbatch: its graph is built before the pair (as the pipeline's F did it earlier)
    f, b = Action(0, ActionKind.F, 1), Action(1, ActionKind.B, 0)
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(repeats + 1):
        for overlap in ((False, True) if i % 2 else (True, False)):
            graph = layer(x).sum()
            work = {f: forward, b: lambda g=graph: g.backward()}
            t0 = time.perf_counter()
            if overlap:
                run_overlapped((f, b), lambda a: work[a]())
            else:
                work[f]()
                work[b]()
            if i:
                times[overlap].append(time.perf_counter() - t0)
            pending.clear()
    layer.delay = 0.0
    graph = layer(x).sum()
    t0 = time.perf_counter()
    forward()
    graph.backward()
    compute = time.perf_counter() - t0
    return {"on": statistics.median(times[True]), "off": statistics.median(times[False]), "compute": compute}


def pair_cost(repeats: int) -> dict[str, float]:
    """The runner's own host time per pair: ``run_overlapped`` on two actions that do nothing, with no handover
    and with one handover per half, against calling the two actions directly (``overlap=False``), interleaved.

    Why: a pipeline runs one pair per microbatch in DualPipeV's middle; what the runner adds to each (threads,
    the baton, the collective wrappers) is time between actions, on the critical path, in every step.
    """
    import pipeline_ext as pe
    from pipeline_ext.runtime.overlap import run_overlapped
    from pipeline_ext.schedules import Action, ActionKind

    pair = (Action(0, ActionKind.B, 0), Action(1, ActionKind.F, 1))  # DualPipeV's order: B, then F
    def nothing(a: Action) -> None:
        return None

    cases = {"direct": lambda: [nothing(a) for a in pair],
             "no handover": lambda: run_overlapped(pair, nothing),
             "one handover per half": lambda: run_overlapped(pair, lambda a: pe.overlap_point())}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for i in range(repeats + 10):  # the first 10: warm-up (the pool's thread, the wrappers)
        for name, case in cases.items():
            t0 = time.perf_counter()
            case()
            if i >= 10:
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--delay", type=float, default=0.01, help="seconds per simulated all-to-all")
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--rows", type=int, default=96, help="rows per microbatch")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--microbatches", type=int, default=M, help="more: a larger share of the actions in pairs")
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--pair-cost", action="store_true", help="only the runner's own host time per pair (one "
                                                              "process, medians of 2000 interleaved pairs)")
    ap.add_argument("--trace", default=None, help="also write one overlapped step's measured timeline (PNG, and "
                                                  "Chrome trace JSON beside it)")
    args = ap.parse_args()
    if args.pair_cost:
        cost = pair_cost(2000)
        print("the pair runner's host time per pair (two actions that do nothing; medians of 2000 interleaved):")
        for name, t in cost.items():
            print(f"  {name:<22} {t * 1e6:7.1f} us" + (f"  (+{(t - cost['direct']) * 1e6:.1f} us over direct)"
                                                        if name != "direct" else ""))
        return
    from pipeline_ext.comm.launch import spawn

    alone = pair_alone(args.d_model, args.rows, args.delay, 3 * args.repeats)
    out = spawn(worker, 2, args.d_model, args.rows, args.delay, args.repeats, args.microbatches, args.trace,
                timeout=900, threads=1)
    lines = [f"DualPipeV, 2 pipeline ranks (Gloo, 1 intra-op thread each), {args.microbatches} microbatches of {args.rows} x "
             f"{args.d_model}, delay d = {args.delay * 1e3:g} ms per all-to-all (4 per MoE layer, 2 layers per stage), medians of "
             f"{args.repeats} interleaved steps", "",
             "| rank | pairs | no delay (ms) | overlap off (ms) | overlap on (ms) | delay in the step, off (ms) | "
             "delay in pairs (ms) | actions in pairs | hidden |",
             "|---|---|---|---|---|---|---|---|---|"]
    for rank in sorted(out):
        v = out[rank][1]
        added = v["off"] - v["none"]  # the delays on the critical path, none hidden: what overlap can take back
        hidden = (v["off"] - v["on"]) / added if added > 0 else float("nan")
        lines.append(f"| {rank} | {v['pairs']} | {v['none'] * 1e3:.0f} | {v['off'] * 1e3:.0f} | "
                     f"{v['on'] * 1e3:.0f} | {added * 1e3:.0f} | {4 * LAYERS * v['pairs'] * args.delay * 1e3:.0f} | "
                     f"{2 * v['pairs']}/{4 * args.microbatches} | {hidden:.0%} |")
    hidden = (alone["off"] - alone["on"]) / (4 * LAYERS * args.delay)
    lines += ["", f"The pair runner alone (one process, one thread computing at a time, medians of "
              f"{3 * args.repeats} interleaved pairs):", "",
              "| pair compute, no delay (ms) | sequential (ms) | overlapped (ms) | delay in the pair (ms) | hidden |",
              "|---|---|---|---|---|",
              f"| {alone['compute'] * 1e3:.1f} | {alone['off'] * 1e3:.1f} | {alone['on'] * 1e3:.1f} | "
              f"{4 * LAYERS * args.delay * 1e3:.0f} | {hidden:.0%} |"]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
