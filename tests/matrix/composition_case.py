"""One case of the composition matrix (``composition.py``), run as a user would, against the unsplit model.

The model: each stage is two pre-norm MLP blocks (``x + w2(relu(w1(norm(x))))``);
the first stage opens with an input projection (scaled by the keyword tensor
``scale`` when the case has kwargs), the last closes with an output
projection; with ``split_fn`` a ``pe.SplitFunction`` linear layer follows the
input side of every stage. Each feature of the case is applied the way a
user applies it (TP plans, ``fully_shard``, DDP, ``Module.compile``,
``torch.utils.checkpoint``, ``save_on_cpu``, ``tie_parameters``,
``step_microbatches``). Two SGD steps; after each, the loss, every gradient
(whole tensors) and, at the end, every parameter are compared with the
unsplit plain model on the whole batch. DualPipeV cases also run the same
steps with ``overlap=False`` and must match it bitwise.
"""
from __future__ import annotations

import contextlib
import traceback
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

import pipeline_ext as pe
from composition import ARGUMENT_DEFAULTS
from models import sac_context, TOL
from mp_utils import forget_dtensor_caches as _fresh_dtensor_caches

D, H, SEQ, ROWS, M, STEPS = 8, 16, 4, 8, 4, 2
#: per microbatch sequence lengths with ``shapes="per_microbatch"`` (even: Shard(1) over tp=2)
LENGTHS = [4, 6, 2, 6]
MULTI_STAGE = {"interleaved_1f1b", "zbv", "dualpipev"}


class _SplitLinear(pe.SplitFunction):
    """``x @ w.T`` with its input half (I) and weight half (W) written out."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward_input(ctx, g):
        _, w = pe.SplitFunction.saved(ctx)
        return g @ w, None

    @staticmethod
    def backward_weight(ctx, g):
        x, _ = pe.SplitFunction.saved(ctx)
        return None, g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


class SplitLinear(nn.Module):
    """A user's layer built on a SplitFunction; on a Replicate DTensor it runs on the local (whole) tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D, D) / D ** 0.5)

    def forward(self, x):
        local = getattr(x, "to_local", None)
        if local is None:
            return _SplitLinear.apply(x, self.weight)
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(_SplitLinear.apply(local(), self.weight), x.device_mesh, x.placements)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.w1, self.w2 = nn.LayerNorm(D), nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(self.norm(x))))


class Stage(nn.Module):
    def __init__(self, index: int, num_stages: int, split_fn: bool, ckpt: str = "none") -> None:
        super().__init__()
        self.inp = nn.Linear(D, D, bias=False) if index == 0 else None
        self.split = SplitLinear() if split_fn else None
        self.blocks = nn.Sequential(Block(), Block())
        self.out = nn.Linear(D, D, bias=False) if index == num_stages - 1 else None
        self.ckpt = ckpt

    def forward(self, x, scale=None):
        from torch.utils.checkpoint import checkpoint

        if scale is not None and self.inp is not None:  # every stage of the first rank gets its kwargs (torch)
            x = x * scale
        if self.inp is not None:
            x = self.inp(x)
        if self.split is not None:
            x = self.split(x)
        for block in self.blocks:
            if self.ckpt == "user":
                x = checkpoint(block, x, use_reentrant=False)
            elif self.ckpt == "sac":
                x = checkpoint(block, x, use_reentrant=False, context_fn=sac_context)
            else:
                x = block(x)
        return self.out(x) if self.out is not None else x


def loss_fn(out, y):
    # written out: mse_loss of Shard(1) DTensors has twice the gradient in torch 2.13 (no pipeline involved)
    return ((out - y) ** 2).mean()


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def _models(case: dict, num_stages: int) -> tuple[list[nn.Module], list[nn.Module]]:
    """All stages as the pipeline builds them, and the plain unsplit reference with the same weights."""
    def make(ckpt: str) -> list[nn.Module]:
        torch.manual_seed(0)
        return [Stage(s, num_stages, case["split_fn"], ckpt) for s in range(num_stages)]

    stages, ref = make(case["ckpt"] if case["ckpt"] in ("user", "sac") else "none"), make("none")
    if case["tied"]:  # the unsplit model shares one weight (tie_parameters broadcasts stage 0's copy)
        ref[-1].out.weight = ref[0].inp.weight
    return stages, ref


def _batch(case: dict, step: int, dp: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The step's microbatches over the whole batch (all replicas' rows): (x, scale, y) each."""
    g = torch.Generator().manual_seed(100 + step)
    rows = ROWS * dp // M
    lengths = LENGTHS if case["shapes"] == "per_microbatch" else [SEQ] * M
    return [(torch.randn(rows, t, D, generator=g), torch.rand(rows, 1, 1, generator=g) + 0.5,
             torch.randn(rows, t, D, generator=g)) for t in lengths]


def _per_microbatch(case: dict, losses: list, own: list) -> Optional[torch.Tensor]:
    """The step's mean loss from what ``losses`` holds: one loss per microbatch, or with sequence pieces one per
    piece (each the mean over its positions, so a microbatch's loss is their mean weighted by length)."""
    k = case.get("seq_chunks", 1)
    if len(losses) != M * k:
        return None
    if k == 1:
        return torch.stack([_full(v) for v in losses]).mean()
    from pipeline_ext.schedules.pieces import piece_lengths

    per_mb = []
    for j, (x, _, _) in enumerate(own):
        lengths = piece_lengths(x.shape[1], k, "equal")
        per_mb.append(sum(_full(losses[j * k + i]) * n for i, n in enumerate(lengths)) / sum(lengths))
    return torch.stack(per_mb).mean()


def _unsplit(ref: list[nn.Module], x, scale):
    for s in ref:
        x = s(x, scale=scale) if s.inp is not None else s(x)
    return x


def _apply_tp(module: Stage, case: dict, tp) -> None:
    """The case's tensor parallelism, as a torchtitan user writes it."""
    from torch.distributed.tensor import Shard, distribute_module
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    mode = case["tp"]
    for block in module.blocks:
        if mode == "local":
            parallelize_module(block, tp, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        elif mode == "replicate":
            distribute_module(block.norm, tp)  # DTensor parameters in a module that is not TP-sharded
            parallelize_module(block, tp, {"w1": ColwiseParallel(), "w2": RowwiseParallel(use_local_output=False)})
        else:
            parallelize_module(block, tp, {"norm": SequenceParallel(use_local_output=False),
                                           "w1": ColwiseParallel(input_layouts=Shard(1)),
                                           "w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)})
    if mode in ("replicate", "sequence"):
        for lin in (module.inp, module.out):
            if lin is not None:
                distribute_module(lin, tp)


def _compile(module: Stage, case: dict) -> None:
    """Each block compiled in place (``Module.compile`` keeps the parameter names), as torchtitan does.

    Every block instance is a recompile of ``Block.forward``; past dynamo's recompile limit a block would run
    eager, so a case (and each of DualPipeV's two runs, which must agree to the bit) starts from a reset
    dynamo (``_train``, ``run_pipe_case``)."""
    backend = pe.split_backend if case["compiled"] == "split_backend" else case["compiled"]
    for block in module.blocks:
        block.compile(backend=backend)


def _placement(case: dict):
    from torch.distributed.tensor import Replicate, Shard

    return {"replicate": [Replicate()], "sequence": [Shard(1)]}.get(case["tp"])


def _put(case: dict, tp, t: torch.Tensor, replicate: bool = False):
    """A step input as the case feeds it: a DTensor of the activations' placement, else the plain tensor."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    placement = _placement(case)
    if placement is None:
        return t
    return distribute_tensor(t, tp, [Replicate()] if replicate else placement)


def _my_rows(mbs: list, dp_rank: int, dp: int) -> list:
    """This data-parallel replica's rows of each microbatch (equal rows per replica)."""
    return [tuple(t.chunk(dp)[dp_rank] for t in mb) for mb in mbs]


def run_case(case: dict, mesh) -> list[str]:
    """One case on this rank; the complaints (empty when it is exact). ``mesh``: ("pp", "dp", "tp")."""
    from pipeline_ext import schedules as S

    name = case["schedule"]
    plan = S.build(name, 2, M, stages_per_rank=2 if name in MULTI_STAGE else 1)
    mine = [s for s, r in enumerate(plan.stage_to_rank) if r == mesh["pp"].get_local_rank()]
    runs = [True, False] if case["family"] == "dualpipev" else [None]
    results = [_train(case, mesh, plan, mine, overlap) for overlap in runs]
    bad = results[0][0]
    if len(results) == 2:  # overlapped pairs promise the sequential run's numbers to the bit
        bad += results[1][0]
        for (n1, g1), (n2, g2) in zip(results[0][1], results[1][1]):
            if not torch.equal(g1, g2):
                bad.append(f"rank {dist.get_rank()}: {n1} differs between overlap=True and overlap=False "
                           f"(max {(g1 - g2).abs().max():.3g})")
    return bad


def _train(case: dict, mesh, plan, mine: list[int], overlap: Optional[bool]) -> tuple[list[str], list]:
    name, ns = case["schedule"], plan.num_stages
    pp, dp_mesh, tp = mesh["pp"], mesh["dp"], mesh["tp"]
    dp, dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()
    if case["compiled"] != "off":
        torch._dynamo.reset()  # see _compile
    all_stages, ref = _models(case, ns)
    modules = {s: all_stages[s] for s in mine}
    for s in mine:
        if case["tp"] != "none":
            _apply_tp(modules[s], case, tp)
        if case["compiled"] != "off":
            _compile(modules[s], case)
        if case["dp"] == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for block in modules[s].blocks:
                fully_shard(block, mesh=dp_mesh)
            fully_shard(modules[s], mesh=dp_mesh)
    params = {s: dict(modules[s].named_parameters()) for s in mine}  # before DDP's "module." prefix
    run = dict(modules)
    if case["dp"] == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        run = {s: DDP(m, process_group=dp_mesh.get_group()) for s, m in modules.items()}
    extra = {"overlap": overlap} if overlap is not None else {}
    for arg, default in ARGUMENT_DEFAULTS.items():  # a design's schedule arguments (seq_chunks, a budget)
        if case.get(arg, default) != default:
            extra[arg] = case[arg]
    stages = [pe.PipelineStage(run[s], s, ns, "cpu", group=pp.get_group()) for s in mine]
    sched = pe.get_schedule_class(name)(stages if len(stages) > 1 else stages[0], M, loss_fn=loss_fn,
                                       timeout=60.0, **extra)
    if case["tied"]:
        pe.tie_parameters(sched, {"io": {0: "inp.weight", ns - 1: "out.weight"}})
    opt = torch.optim.SGD([p for s in mine for p in modules[s].parameters()], lr=0.1)
    ref_opt = torch.optim.SGD(list({id(p): p for m in ref for p in m.parameters()}.values()), lr=0.1)
    first, last = 0 in mine, ns - 1 in mine
    where = f"rank {dist.get_rank()} overlap={overlap}"
    bad: list[str] = []
    for step in range(STEPS):
        mbs = _batch(case, step, dp)
        own = _my_rows(mbs, dp_rank, dp)
        losses: list = []
        hooks = torch.autograd.graph.save_on_cpu() if case["ckpt"] == "offload" else contextlib.nullcontext()
        with hooks:
            if case["shapes"] == "per_microbatch":
                kw = [{"scale": _put(case, tp, sc, replicate=True)} for _, sc, _ in own] if case["kwargs"] else None
                sched.step_microbatches([(_put(case, tp, x),) for x, _, _ in own] if first else None,
                                        kwarg_mbs=kw if first else None,
                                        target_mbs=[_put(case, tp, y) for _, _, y in own] if last else None,
                                        losses=losses)
            else:
                x, sc, y = (torch.cat(parts) for parts in zip(*own))
                kw = {"scale": _put(case, tp, sc, replicate=True)} if case["kwargs"] and first else {}
                sched.step(*((_put(case, tp, x),) if first else ()), target=_put(case, tp, y) if last else None,
                           losses=losses, **kw)
        # the unsplit model on every replica's rows: the mean over microbatches of each one's mean loss
        ref_losses = [loss_fn(_unsplit(ref, x, sc if case["kwargs"] else None), y) for x, sc, y in mbs]
        torch.stack(ref_losses).mean().backward()
        if last:
            with torch.no_grad():
                want = torch.stack([loss_fn(_unsplit(ref, x, sc if case["kwargs"] else None), y)
                                    for x, sc, y in own]).mean()
            got = _per_microbatch(case, losses, own)
            if got is None or not torch.allclose(got, want, **TOL):
                bad.append(f"{where} step {step}: loss {got} vs the unsplit model's {want} ({len(losses)} losses)")
        for s in mine:
            for pname, p in params[s].items():
                want = ref[s].get_parameter(pname).grad
                if p.grad is None or not torch.allclose(_full(p.grad), want, **TOL):
                    err = "missing" if p.grad is None else f"max err {(_full(p.grad) - want).abs().max():.3g}"
                    bad.append(f"{where} step {step}: stage {s} {pname} grad {err}")
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    grads_after = [(f"stage {s} {pname}", _full(p).clone()) for s in mine for pname, p in params[s].items()]
    for s in mine:
        for pname, p in params[s].items():
            if not torch.allclose(_full(p), ref[s].get_parameter(pname).detach(), **TOL):
                bad.append(f"{where}: stage {s} {pname} differs from the unsplit model's after {STEPS} steps")
    return bad, grads_after


def run_pipe_case(case: dict) -> list[str]:
    """A Pipe case (one process, two CPU "devices", a thread each)."""
    name = case["schedule"]
    ns = 4 if name in MULTI_STAGE else 2
    all_stages, ref = _models(case, ns)
    if case["compiled"] != "off":
        torch._dynamo.reset()  # see _compile
        for m in all_stages:
            _compile(m, case)
    pipe = pe.Pipe(nn.Sequential(*all_stages), balance=[1] * ns, devices=["cpu", "cpu"], chunks=M, schedule=name,
                   checkpoint="always" if case["ckpt"] == "user" else "never")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD([p for m in ref for p in m.parameters()], lr=0.1)
    bad: list[str] = []
    for step in range(STEPS):
        mbs = _batch(case, step, 1)
        hooks = torch.autograd.graph.save_on_cpu() if case["ckpt"] == "offload" else contextlib.nullcontext()
        with hooks:
            if case["shapes"] == "per_microbatch":
                got = pipe.step_microbatches([(x,) for x, _, _ in mbs],
                                             [{"scale": sc} for _, sc, _ in mbs] if case["kwargs"] else None,
                                             [y for _, _, y in mbs], loss_fn=loss_fn)
            else:
                x, sc, y = (torch.cat(parts) for parts in zip(*mbs))
                got = pipe.step(x, target=y, loss_fn=loss_fn, **({"scale": sc} if case["kwargs"] else {}))
        ref_loss = torch.stack([loss_fn(_unsplit(ref, x, sc if case["kwargs"] else None), y)
                                for x, sc, y in mbs]).mean()
        ref_loss.backward()
        if not torch.allclose(got, ref_loss.detach(), **TOL):
            bad.append(f"pipe step {step}: loss {got} vs {ref_loss}")
        for s, (m, r) in enumerate(zip(all_stages, ref)):
            for pname, p in m.named_parameters():
                want = r.get_parameter(pname).grad
                if p.grad is None or not torch.allclose(p.grad, want, **TOL):
                    err = "missing" if p.grad is None else f"max err {(p.grad - want).abs().max():.3g}"
                    bad.append(f"pipe step {step}: stage {s} {pname} grad {err}")
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    return bad


def run_group(rank: int, world: int, cases: list[dict]) -> list[tuple[str, list[str]]]:
    """Every case of one world size on this rank, in one process group; (case id, complaints) per case. A case
    that raises is a complaint (its peers' timeouts end theirs), and the group goes on with the next case."""
    from torch.distributed.device_mesh import init_device_mesh

    from composition import case_id

    out: list[tuple[str, list[str]]] = []
    for case in cases:
        _fresh_dtensor_caches()
        try:
            dp = 2 if case["dp"] != "none" else 1
            mesh = init_device_mesh("cpu", (2, dp, world // (2 * dp)), mesh_dim_names=("pp", "dp", "tp"))
            bad = run_case(case, mesh)
        except Exception as exc:  # noqa: BLE001 -- a refusal or a failure: the case's complaint
            where = traceback.extract_tb(exc.__traceback__)[-4:]
            bad = [f"rank {rank} raised {type(exc).__name__}: {str(exc)[:400]} (at "
                   + " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in reversed(where)) + ")"]
        out.append((case_id(case), bad))
        dist.barrier()
    return out

