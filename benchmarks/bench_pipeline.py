"""pipeline_ext vs torch.distributed.pipelining on one workload, side by side.

Two ranks on Gloo (127.0.0.1), one intra-op thread each. Two workloads
(``--models``): the MLP of issue 6, 8 x (Linear(d, d) + ReLU), batch 64, 8
microbatches, MSE loss; and a transformer stack closer to what people
pipeline: ``pipeline_ext.demo.model``'s GPT (token embedding, 8 pre-norm
causal self-attention + MLP blocks, LM head, cross-entropy), sequence 128,
batch 16, 8 microbatches, d = ``--dims``.
For every schedule both libraries run in the same processes, alternating, in
interleaved repeats (these machines are shared and noisy; only numbers taken
side by side mean anything), and the unsplit model's forward+backward is timed
on one process in the same repeats: "seq" over the same 8 microbatches
(gradient accumulation: the work the pipeline splits over p ranks, and the
"sequential" of the efficiency), "seq-1" on the whole batch at once (for
reference: 8-row GEMMs cost more per row than 64-row ones).

Printed per (d, schedule): median step time of each library, efficiency =
ideal / measured with ideal = sequential / p x (1 + bubble), bubble being the
simulator's bubble rate of the schedule at unit costs (F = I = W), and the
throughput ratio pipeline_ext / torch. ZB-H1 (one stage per rank) has no torch
twin; torch's closest is ScheduleInterleavedZeroBubble (ZB-H1's I/W split and
ordering, interleaved) given two stages per rank, which is what it is compared
with.

torch moves stage-to-stage messages over the Gloo group; pipeline_ext runs
once per transport in ``--transports`` (default both, as "ours gloo" over the
same group through its C++ ProcessGroupChannel, and "ours shm" over same-host
shared memory), in the same interleaved repeats.

    PYTHONPATH=. python benchmarks/bench_pipeline.py --dims 512 1024 --repeats 5 --steps 3
    PYTHONPATH=. python benchmarks/bench_pipeline.py --models transformer --dims 256 --repeats 5 --steps 2
    PYTHONPATH=. python benchmarks/bench_pipeline.py --overhead
    PYTHONPATH=. python benchmarks/bench_pipeline.py --device cuda --dims 4096   # GPU ranks, NCCL

``--device cuda`` puts every rank's stages on ``cuda:0`` (the ranks share one
GPU, each an NCCL host of its own: ``comm.launch.spawn(own_nccl_host=True)``),
and both libraries move messages over NCCL (ours: ``transport="process_group"``).
With one GPU shared, absolute times mean little; the ratio and the host cost
per action (``--overhead --device cuda``) do.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

LAYERS, BATCH, MICROBATCHES, WORLD = 8, 64, 8, 2
_DEVICE = [torch.device("cpu")]  # where this process's stages and batches live (a worker sets it first)


def _device() -> torch.device:
    return _DEVICE[0]


def _use(device: str) -> None:
    _DEVICE[0] = torch.device(device)
SEQ, SEQ_BATCH, BLOCKS, HEADS = 128, 16, 8, 4  # the transformer workload


@dataclass(frozen=True)
class Case:
    """One schedule: our built-in name, torch's class name, stages per rank on each side."""

    name: str
    torch_class: str
    v_ours: int = 1
    v_torch: int = 1


CASES = {
    "gpipe": Case("gpipe", "ScheduleGPipe"),
    "1f1b": Case("1f1b", "Schedule1F1B"),
    "interleaved_1f1b": Case("interleaved_1f1b", "ScheduleInterleaved1F1B", 2, 2),
    "zb_h1": Case("zb_h1", "ScheduleInterleavedZeroBubble", 1, 2),
}


def mlp_stages(d: int, num_stages: int, seed: int = 0) -> list[nn.Module]:
    """The 8-layer MLP, cut into ``num_stages`` equal stages (same weights for any cut)."""
    torch.manual_seed(seed)
    layers = [m for _ in range(LAYERS) for m in (nn.Linear(d, d), nn.ReLU())]
    per = len(layers) // num_stages
    return [nn.Sequential(*layers[i * per:(i + 1) * per]) for i in range(num_stages)]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


@dataclass(frozen=True)
class Workload:
    """A model (as any number of stages, same weights for any cut), its batch and its loss."""

    model: str  # "mlp" or "transformer"
    d: int

    def stages(self, num_stages: int) -> list[nn.Module]:
        if self.model == "mlp":
            return [m.to(_device()) for m in mlp_stages(self.d, num_stages)]
        from pipeline_ext.demo.model import gpt_stages

        return [m.to(_device()) for m in gpt_stages(self._gpt(), num_stages)]

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.model == "mlp":
            g = torch.Generator().manual_seed(self.d)
            x, y = torch.randn(BATCH, self.d, generator=g), torch.randn(BATCH, self.d, generator=g)
        else:
            from pipeline_ext.demo.model import synthetic_batch

            x, y = synthetic_batch(self._gpt(), SEQ_BATCH, step=0)
        return x.to(_device()), y.to(_device())

    @property
    def loss(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        if self.model == "mlp":
            return loss_fn
        from pipeline_ext.demo.model import lm_loss

        return lm_loss

    def _gpt(self) -> Any:
        from pipeline_ext.demo.model import GPTConfig

        return GPTConfig(vocab=256, seq_len=SEQ, d_model=self.d, heads=HEADS, layers=BLOCKS)

    def describe(self) -> str:
        if self.model == "mlp":
            return f"MLP {LAYERS} x Linear(d,d)+ReLU, batch {BATCH}"
        return f"GPT {BLOCKS} blocks (demo/model.py), seq {SEQ}, {HEADS} heads, batch {SEQ_BATCH}"


def make_step(case_cls: Any, stage_cls: Any, modules: list[nn.Module], v: int, rank: int, m: int,
              x: torch.Tensor, y: torch.Tensor, loss: Callable[..., torch.Tensor] = loss_fn) -> Callable[[], None]:
    """A zero-argument training step on this rank's stages of ``modules`` (grads cleared each step)."""
    num_stages = len(modules)
    mine = [s for s in range(num_stages) if _rank_of(s, v) == rank]
    stages = [stage_cls(modules[s], s, num_stages, _device()) for s in mine]
    sched = case_cls(stages if v > 1 else stages[0], m, loss_fn=loss)
    params = [p for s in mine for p in modules[s].parameters()]
    first, last = 0 in mine, num_stages - 1 in mine

    def step() -> None:
        for p in params:
            p.grad = None
        if first and last:
            sched.step(x, target=y)
        elif first:
            sched.step(x)
        elif last:
            sched.step(target=y)
        else:
            sched.step()

    return step


def _ours(name: str, transport: str, stages: Any, m: int, loss_fn: Callable) -> Any:
    import pipeline_ext as pe

    return pe.PipelineSchedule(stages, name, m, loss_fn=loss_fn, transport=transport)


def _rank_of(stage: int, v: int) -> int:
    return stage % WORLD  # looped placement; v = 1 is the identity


def sequential_step(work: Workload, x: torch.Tensor, y: torch.Tensor, microbatches: int) -> Callable[[], None]:
    """The unsplit model's forward+backward on one process, over ``microbatches`` chunks (1: whole batch).

    The pipeline's ideal is this run with the same microbatches (gradient
    accumulation), split over p ranks: a GEMM on 8 rows costs several times
    more per row than one on 64 (it is bound by reading the weights), and that
    is the microbatch size's price, not the pipeline's.
    """
    model = nn.Sequential(*work.stages(1))
    chunks = list(zip(x.tensor_split(microbatches), y.tensor_split(microbatches)))
    loss = work.loss

    def step() -> None:
        model.zero_grad(set_to_none=True)
        for xc, yc in chunks:
            (loss(model(xc), yc) / len(chunks)).backward()

    return step


def timed(step: Callable[[], None], steps: int) -> float:
    """Seconds per step of ``steps`` steps, all ranks starting and stopping together."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if _device().type == "cuda":
        torch.cuda.synchronize()  # the GPU's work, not only its launch
    dist.barrier()
    return (time.perf_counter() - t0) / steps


def worker(rank: int, world: int, works: list[Workload], names: list[str], repeats: int, steps: int,
           transports: list[str], device: str = "cpu") -> list[dict]:
    import torch.distributed as dist
    import torch.distributed.pipelining as tp

    import pipeline_ext as pe
    from pipeline_ext import schedules as S

    _use(device)
    rows = []
    for work in works:
        x, y = work.batch()
        idle = lambda: None  # noqa: E731 - rank 1 waits while rank 0 runs the unsplit model alone
        seq = sequential_step(work, x, y, MICROBATCHES) if rank == 0 else idle
        seq_batch = sequential_step(work, x, y, 1) if rank == 0 else idle
        for name in names:
            case = CASES[name]
            ours = {t: make_step(functools.partial(_ours, name, t), pe.PipelineStage, work.stages(WORLD * case.v_ours),
                                 case.v_ours, rank, MICROBATCHES, x, y, work.loss)
                    for t in transports}
            theirs = make_step(getattr(tp, case.torch_class), tp.PipelineStage, work.stages(WORLD * case.v_torch),
                               case.v_torch, rank, MICROBATCHES, x, y, work.loss)
            fns = {"seq": seq, "seq_batch": seq_batch, **{f"ours {k}": f for k, f in ours.items()}, "torch": theirs}
            for fn in fns.values():  # warm-up: shapes, allocator, caches
                timed(fn, 2)
            t: dict[str, list[float]] = {k: [] for k in fns}
            for _ in range(repeats):
                for k, fn in fns.items():
                    t[k].append(timed(fn, steps))
            bubble = S.simulate(S.build(name, WORLD, MICROBATCHES, stages_per_rank=case.v_ours),
                                S.Costs(1.0, 1.0, 1.0)).bubble_rate
            med = {k: statistics.median(v) for k, v in t.items()}
            ideal = med["seq"] / WORLD * (1 + bubble)
            rows.append({"model": work.model, "d": work.d, "schedule": name, "torch_class": case.torch_class,
                         "bubble": bubble, **med, "eff_torch": ideal / med["torch"], "ours": {
                             k: {"ms": med[f"ours {k}"], "eff": ideal / med[f"ours {k}"],
                                 "ratio": med["torch"] / med[f"ours {k}"]} for k in transports}})
            dist.barrier()
    return rows


class Scale(nn.Module):
    """A stage that does next to nothing (one multiply): what is left of a step is the runtime's cost."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def overhead_worker(rank: int, world: int, names: list[str], m: int, repeats: int, steps: int,
                    device: str = "cpu") -> list[dict]:
    """Per-action cost with no-op stages: step time / actions per rank of our lowered schedule.

    Both libraries are divided by the same action count (F, B or I and W,
    and one SEND or RECV per message), so the two numbers compare directly.
    """
    import torch.distributed.pipelining as tp

    import pipeline_ext as pe
    from pipeline_ext import schedules as S

    _use(device)
    x, y = torch.ones(m, 4, device=_device()), torch.ones(m, 4, device=_device())
    rows = []
    for name in names:
        case = CASES[name]
        ours = make_step(pe.get_schedule_class(name), pe.PipelineStage,
                         [Scale().to(_device()) for _ in range(WORLD * case.v_ours)], case.v_ours, rank, m, x, y)
        theirs = make_step(getattr(tp, case.torch_class), tp.PipelineStage,
                           [Scale().to(_device()) for _ in range(WORLD * case.v_torch)], case.v_torch, rank, m, x, y)
        lowered = S.lower(S.build(name, WORLD, m, stages_per_rank=case.v_ours))
        actions = max(len(a) for a in lowered.actions)
        for fn in (ours, theirs):
            timed(fn, 3)
        t = {"ours": [], "torch": []}
        for _ in range(repeats):
            t["ours"].append(timed(ours, steps))
            t["torch"].append(timed(theirs, steps))
        med = {k: statistics.median(v) for k, v in t.items()}
        rows.append({"schedule": name, "torch_class": case.torch_class, "actions": actions, **med})
    return rows


def executor_cost_worker(rank: int, world: int, m: int, repeats: int, steps: int,
                         device: str = "cpu") -> Optional[dict]:
    """The runtime's own cost per action, without any transfer: one stage on a one-rank group.

    Rank 0 runs a single-stage schedule (m forwards, m backwards) over a group
    of itself, with both libraries, and the same m forward+backward calls by
    hand ("bare"); (step - bare) / 2m is the per-action cost of the runtime.
    The other rank waits at the barrier, so nothing else of ours competes.
    """
    import torch.distributed as dist
    import torch.distributed.pipelining as tp

    import pipeline_ext as pe

    _use(device)
    groups = [dist.new_group([r]) for r in range(world)]
    if rank != 0:
        for _ in range(2 + 3 * repeats):
            dist.barrier()
        return None
    g = groups[0]
    x, y = torch.ones(m, 4, device=_device()), torch.ones(m, 4, device=_device())
    mod = Scale().to(_device())
    ours = pe.Schedule1F1B(pe.PipelineStage(mod, 0, 1, _device(), group=g), m, loss_fn=loss_fn)
    theirs = tp.Schedule1F1B(tp.PipelineStage(mod, 0, 1, _device(), group=g), m, loss_fn=loss_fn)
    chunks = list(zip(x.tensor_split(m), y.tensor_split(m)))

    def bare() -> None:
        for xc, yc in chunks:
            (loss_fn(mod(xc), yc) / m).backward()

    fns = {"ours": lambda: ours.step(x, target=y), "torch": lambda: theirs.step(x, target=y), "bare": bare}
    for fn in fns.values():
        fn()
    dist.barrier()
    t: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                mod.w.grad = None
                fn()
            if _device().type == "cuda":
                torch.cuda.synchronize()
            t[k].append((time.perf_counter() - t0) / steps)
            dist.barrier()
    dist.barrier()
    med = {k: statistics.median(v) for k, v in t.items()}
    return {"m": m, **med, "calls": {k: _python_calls(fn) for k, fn in fns.items()},
            "ops": {k: _aten_ops(fn) for k, fn in fns.items()}}


def _python_calls(fn: Callable[[], None]) -> int:
    """Python function calls (and calls of C functions from Python) in one run of ``fn``: a host cost that
    does not depend on how busy the machine is, unlike a timing."""
    import sys

    calls = [0]

    def count(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            calls[0] += 1

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls[0]


def _aten_ops(fn: Callable[[], None]) -> int:
    """Tensor operations (``aten::`` and pipeline_ext's own ops) dispatched in one run of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith(("aten::", "pipeline_ext::")))


def print_executor_cost(row: dict) -> None:
    per = {k: (row[k] - row["bare"]) / (2 * row["m"]) * 1e6 for k in ("ours", "torch")}
    print(f"one rank, one no-op stage, {row['m']} microbatches (F and B each): step ours {row['ours'] * 1e3:.2f} ms, "
          f"torch {row['torch'] * 1e3:.2f} ms, bare F+B calls {row['bare'] * 1e3:.2f} ms")
    print(f"runtime cost per action (step - bare) / {2 * row['m']}: ours {per['ours']:.1f} us, torch {per['torch']:.1f} us")
    calls = {k: (row["calls"][k] - row["calls"]["bare"]) / (2 * row["m"]) for k in ("ours", "torch")}
    print(f"Python calls per action (step - bare) / {2 * row['m']}, the same on any machine: ours {calls['ours']:.1f}, "
          f"torch {calls['torch']:.1f}; tensor ops per step: ours {row['ops']['ours']}, torch {row['ops']['torch']}, "
          f"bare {row['ops']['bare']}")


def print_overhead(rows: list[dict]) -> None:
    print(f"{'schedule':<17} {'torch class':<30} {'actions/rank':>12} {'ours ms':>8} {'torch ms':>9} "
          f"{'ours us/action':>14} {'torch us/action':>15}")
    for r in rows:
        print(f"{r['schedule']:<17} {r['torch_class']:<30} {r['actions']:>12} {r['ours'] * 1e3:>8.2f} "
              f"{r['torch'] * 1e3:>9.2f} {r['ours'] / r['actions'] * 1e6:>14.1f} {r['torch'] / r['actions'] * 1e6:>15.1f}")


def print_table(rows: list[dict]) -> None:
    transports = list(rows[0]["ours"]) if rows else []
    print(f"{'model':<11} {'d':>5} {'schedule':<17} {'torch class':<30} {'seq ms':>7} {'seq-1 ms':>8} {'torch ms':>9} "
          f"{'eff torch':>9}" + "".join(f" {'ours ' + t + ' ms':>12} {'eff':>6} {'vs torch':>8}" for t in transports))
    for r in rows:
        print(f"{r['model']:<11} {r['d']:>5} {r['schedule']:<17} {r['torch_class']:<30} {r['seq'] * 1e3:>7.2f} "
              f"{r['seq_batch'] * 1e3:>8.2f} {r['torch'] * 1e3:>9.2f} {r['eff_torch']:>9.3f}"
              + "".join(f" {o['ms'] * 1e3:>12.2f} {o['eff']:>6.3f} {o['ratio']:>7.2f}x" for o in r["ours"].values()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--models", nargs="+", default=["mlp"], choices=["mlp", "transformer"])
    ap.add_argument("--schedules", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--repeats", type=int, default=7, help="interleaved repeats; medians are reported")
    ap.add_argument("--steps", type=int, default=5, help="steps per timed repeat")
    ap.add_argument("--timeout", type=float, default=1200.0)
    ap.add_argument("--transports", nargs="+", default=["gloo", "shm"], choices=["gloo", "shm"],
                    help="pipeline_ext's transports, each timed against torch in the same repeats")
    ap.add_argument("--overhead", action="store_true", help="per-action cost with no-op stages instead")
    ap.add_argument("--overhead-microbatches", type=int, default=32)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: every rank's stages on cuda:0, messages over NCCL (both libraries)")
    args = ap.parse_args()
    gpu = args.device == "cuda"
    if gpu:
        args.transports = ["process_group"]  # NCCL; shared memory is for CPU stages
    ranks = dict(backend="cpu:gloo,cuda:nccl" if gpu else "gloo", own_nccl_host=gpu)

    from pipeline_ext.comm.launch import spawn

    if args.overhead:
        m = args.overhead_microbatches
        print(f"no-op stages (x * w), {m} microbatches, {WORLD} ranks (ours: transport auto), 1 thread/rank, torch {torch.__version__}; "
              f"medians of {args.repeats} interleaved repeats x {args.steps} steps")
        out = spawn(overhead_worker, WORLD, args.schedules, m, args.repeats, args.steps, args.device,
                    timeout=args.timeout, **ranks)
        print_overhead(out[0][1])
        out = spawn(executor_cost_worker, WORLD, m, args.repeats, args.steps, args.device, timeout=args.timeout,
                    **ranks)
        print_executor_cost(out[0][1])
        return

    works = [Workload(model, d) for model in args.models for d in args.dims]
    for model in args.models:
        print(f"{model}: {Workload(model, 0).describe()}")
    print(f"{MICROBATCHES} microbatches, {WORLD} ranks on {args.device} (torch: {'NCCL' if gpu else 'Gloo'}), 1 thread/rank, torch {torch.__version__}; "
          f"medians of {args.repeats} interleaved repeats x {args.steps} steps")
    out = spawn(worker, WORLD, works, args.schedules, args.repeats, args.steps, args.transports, args.device,
                timeout=args.timeout, threads=1, **ranks)
    print_table(out[0][1])


if __name__ == "__main__":
    main()
