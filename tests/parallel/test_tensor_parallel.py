"""Pipeline x tensor parallel: DTensor activations between stages, exact against the unsplit model.

4 Gloo CPU ranks, mesh (pp=2, tp=2); each stage is two MLP blocks made
tensor-parallel with ``parallelize_module`` (w1 colwise, w2 rowwise), as a
torchtitan user writes it. What crosses stages is a plain tensor (the blocks
return local outputs), a Replicate DTensor (``use_local_output=False``) or a
sequence-parallel ``Shard(1)`` DTensor. Several SGD steps; the loss and every
full gradient are compared with the unsplit model's at every step.
See [Note: DTensors between stages] in pipeline_ext/runtime/dtensor_wire.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mp_utils import TEST_DEVICE_ENV, device_under_test, no_complaints, run_ranks
from mp_utils import forget_dtensor_caches as _fresh_dtensor_caches
from pipeline_ext.comm.transport import TRANSPORT_ENV
from models import GPU_TOL, TOL

D, H, SEQ, ROWS, M, STEPS = 8, 16, 4, 8, 4, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())

    def forward(self, x):
        return self.blocks(x)


def _loss(out, y):
    # mse_loss(reduction="mean") of two Shard(0) DTensors has twice the gradient in torch 2.13 (its own
    # loss.backward(), no pipeline); the same loss written out is exact on plain tensors and DTensors alike
    return ((out - y) ** 2).mean()


def _placement(name: str):
    from torch.distributed.tensor import Replicate, Shard

    return {"replicate": Replicate(), "shard0": Shard(0), "shard1": Shard(1)}[name]


def _parallelize(stage: nn.Module, index: int, num_stages: int, case: str, tp, last_out: str = "") -> nn.Module:
    """w1 colwise, w2 rowwise; between stages: ``case`` (the last block of the last stage returns a plain tensor,
    or with ``last_out`` a DTensor of that placement)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for b in range(2):
        first, last = index == 0 and b == 0, index == num_stages - 1 and b == 1
        if case == "local" or last:
            plan[f"blocks.{b}.w1"], plan[f"blocks.{b}.w2"] = ColwiseParallel(), RowwiseParallel()
        elif case == "replicate":
            plan[f"blocks.{b}.w1"] = ColwiseParallel()
            plan[f"blocks.{b}.w2"] = RowwiseParallel(use_local_output=False)
        else:  # sequence parallel: activations sharded on the sequence dim between the blocks and the stages
            plan[f"blocks.{b}.w1"] = ColwiseParallel(input_layouts=Replicate() if first else Shard(1))
            plan[f"blocks.{b}.w2"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
        if last and case == "sequence":
            plan[f"blocks.{b}.w1"] = ColwiseParallel(input_layouts=Shard(1))
    if last_out and index == num_stages - 1:
        plan["blocks.1.w2"] = RowwiseParallel(output_layouts=_placement(last_out), use_local_output=False)
    return parallelize_module(stage, tp, plan)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def _replicas_mean(losses: list, mesh, dp: int) -> torch.Tensor:
    """The step's mean loss over its microbatches, and over the ``dp`` FSDP replicas (``mesh["dp_shard"]``):
    with equal rows per replica, the whole batch's mean is the replicas' mean."""
    got = torch.stack([_full(v) for v in losses]).mean()
    if dp > 1:
        dist.all_reduce(got, group=mesh["dp_shard"].get_group())
        got /= dp
    return got


def _train(rank: int, world: int, case: str, names: list[str], mesh_kw: str, given: str = "", dp: int = 1) -> list[str]:
    """``given``: the step's inputs, targets and last outputs are DTensors of that placement (split into
    microbatches and merged back by the schedule); else plain tensors. ``dp`` (with ``mesh_kw="fsdp"``): FSDP
    replicas, each stepping on its own rows of the batch as torchtitan feeds them; the full gradients after
    FSDP's reduce-scatter and the loss averaged over the replicas are compared with the unsplit model on the
    whole batch."""
    import pipeline_ext as pe
    from pipeline_ext import schedules as S
    from torch.distributed.device_mesh import init_device_mesh

    _fresh_dtensor_caches()
    dev = device_under_test()  # cuda: every rank on cuda:0 over NCCL, tp = world // 2 (1 on one GPU)
    tol = TOL if dev.type == "cpu" else GPU_TOL
    fsdp = mesh_kw == "fsdp"  # FSDP2 as the third dim, composed as torchtitan does: TP, then fully_shard
    if fsdp:
        mesh = init_device_mesh(dev.type, (2, dp, world // (2 * dp)), mesh_dim_names=("pp", "dp_shard", "tp"))
    else:
        mesh = init_device_mesh(dev.type, (2, world // 2), mesh_dim_names=("pp", "tp"))
    tp, pp = mesh["tp"], mesh["pp"]
    bad: list[str] = []
    for name in names:
        plan = S.build(name, 2, M)
        ns = plan.num_stages
        mine = [s for s, r in enumerate(plan.stage_to_rank) if r == pp.get_local_rank()]
        torch.manual_seed(0)
        ref = [Stage().to(dev) for _ in range(ns)]
        torch.manual_seed(0)
        modules = {s: m.to(dev) for s, m in enumerate(Stage() for _ in range(ns)) if s in mine}
        for s in mine:
            modules[s] = _parallelize(modules[s], s, ns, case, tp, given)
            if fsdp:
                from torch.distributed.fsdp import fully_shard

                for block in modules[s].blocks:
                    fully_shard(block, mesh=mesh["dp_shard"])
                modules[s] = fully_shard(modules[s], mesh=mesh["dp_shard"])
        extra = {"mesh": tp} if mesh_kw == "mesh" else {"get_mesh": lambda names, layout: mesh[names]} \
            if mesh_kw == "get_mesh" else {}
        if mesh_kw == "torch":  # torch 2.13's own PipelineStage and schedule on the same case, side by side
            from torch.distributed import pipelining as tp_lib

            lookup = {"1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B"}
            stages = [tp_lib.PipelineStage(modules[s], s, ns, dev, group=pp.get_group(),
                                           get_mesh=lambda names, layout: mesh[names]) for s in mine]
            cls = tp_lib.schedules.get_schedule_class(lookup[name])
            sched = cls(stages if issubclass(cls, tp_lib.schedules.PipelineScheduleMulti) else stages[0], M,
                        loss_fn=_loss, scale_grads=True)
        else:
            stages = [pe.PipelineStage(modules[s], s, ns, dev, group=pp, **extra) for s in mine]
            sched = pe.get_schedule_class(name)(stages if len(stages) > 1 else stages[0], M, loss_fn=_loss,
                                                timeout=120.0)
        opt = torch.optim.SGD([p for s in mine for p in modules[s].parameters()], lr=0.1)
        ref_opt = torch.optim.SGD([p for m in ref for p in m.parameters()], lr=0.1)
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            x, y = (torch.randn(ROWS, SEQ, D, generator=g).to(dev) for _ in range(2))
            opt.zero_grad()
            losses: list = []
            xs, ys = x, y
            if fsdp:  # this replica's rows
                lo = mesh["dp_shard"].get_local_rank() * (ROWS // dp)
                xs, ys = x[lo:lo + ROWS // dp], y[lo:lo + ROWS // dp]
            if given:
                from torch.distributed.tensor import distribute_tensor

                xs, ys = (distribute_tensor(t, tp, [_placement(given)]) for t in (x, y))
            merged = sched.step(*((xs,) if 0 in mine else ()), target=ys if ns - 1 in mine else None,
                                losses=losses)
            ref_opt.zero_grad()
            out = x
            for m in ref:
                out = m(out)
            ref_loss = _loss(out, y)
            ref_loss.backward()
            where = f"{case} {name} rank {rank} step {step}"
            if ns - 1 in mine:
                if given and not torch.allclose(_full(merged), out.detach(), **tol):
                    bad.append(f"{where}: the merged output differs from the unsplit model's")
                got = _replicas_mean(losses, mesh, dp if fsdp else 1)
                if not torch.allclose(got, ref_loss.detach(), **tol):
                    bad.append(f"{where}: loss {got.item()} != {ref_loss.item()}")
            for s in mine:
                for (pn, p), q in zip(modules[s].named_parameters(), ref[s].parameters()):
                    if p.grad is None or not torch.allclose(_full(p.grad), q.grad, **tol):
                        err = "none" if p.grad is None else f"{(_full(p.grad) - q.grad).abs().max():.3g}"
                        bad.append(f"{where}: stage {s} {pn} grad differs (max err {err})"
                                   + ("" if p.grad is None else f" ratio {(_full(p.grad) / q.grad).flatten()[:3].tolist()}"))
            opt.step()
            ref_opt.step()
        for st in stages if mesh_kw != "torch" else ():  # the I/W split held: W ran over the DTensor params
            if st._runner.split_seen and st._runner.split_fallback is not None:
                bad.append(f"{case} {name} rank {rank}: stage {st.stage_index}'s I ran the whole backward: "
                           f"{st._runner.split_fallback}")
        dist.barrier()
    return bad


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["local", "replicate", "sequence"])
def test_pp_x_tp_matches_the_unsplit_model(case):
    no_complaints(_train, 4, case, ["1f1b", "zb_h1", "interleaved_1f1b"], "found", timeout=500)


@pytest.mark.cuda
@pytest.mark.isolated  # fresh ranks: NCCL communicators of their own
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["local", "replicate", "sequence"])
def test_pp_x_tp_on_one_gpu_matches_the_unsplit_model(case, monkeypatch):
    """pp=2 x tp=1 on cuda:0 over NCCL (two ranks sharing one GPU, each its own NCCL host): DTensor activations
    (the local shard and its layout) cross stages on the GPU path; tools/gpu_check.sh runs it. pp=1 x tp=2 is not
    a pipeline, and pp=2 x tp=2 needs 4 GPUs."""
    monkeypatch.setenv(TEST_DEVICE_ENV, "cuda")
    monkeypatch.setenv(TRANSPORT_ENV, "process_group")
    no_complaints(_train, 2, case, ["1f1b", "zb_h1", "interleaved_1f1b"], "found", timeout=500)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["replicate", "sequence"])
def test_pp_x_tp_v_schedules_match_the_unsplit_model(case):
    no_complaints(_train, 4, case, ["zbv", "dualpipev"], "found", timeout=500)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("given", ["replicate", "shard0", "shard1"])
def test_dtensor_inputs_targets_and_outputs_are_split_and_merged_exactly(given):
    no_complaints(_train, 4, "replicate", ["1f1b", "zb_h1"], "found", given, timeout=500)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mesh_kw", ["mesh", "get_mesh"])
def test_the_receiving_mesh_may_be_given(mesh_kw):
    no_complaints(_train, 4, "sequence", ["1f1b"], mesh_kw, timeout=500)


# -- refused: what the receiving stage cannot rebuild, named on every rank ----------------------------------
def _mismatch(rank: int, world: int, kind: str) -> str:
    import pipeline_ext as pe
    from torch.distributed.device_mesh import init_device_mesh

    _fresh_dtensor_caches()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    other = init_device_mesh("cpu", (4, 1), mesh_dim_names=("x", "tp"))["tp"]  # a "tp" of shape (1,)
    tp, pp = mesh["tp"], mesh["pp"]
    index = pp.get_local_rank()
    torch.manual_seed(0)
    if index == 0:
        module, extra = _parallelize(Stage(), 0, 2, "replicate", tp), {}
    elif kind == "mesh_shape":
        module, extra = Stage(), {"mesh": other}
    else:  # a plain tensor declared where a Replicate DTensor arrives
        module, extra = _parallelize(Stage(), 1, 2, "replicate", tp), {"input_args": torch.empty(ROWS // M, SEQ, D)}
    stage = pe.PipelineStage(module, index, 2, "cpu", group=pp, **extra)
    sched = pe.Schedule1F1B(stage, M, loss_fn=_loss, timeout=60.0)
    x, y = torch.randn(ROWS, SEQ, D), torch.randn(ROWS, SEQ, D)
    try:
        sched.step(x) if index == 0 else sched.step(target=y)
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["mesh_shape", "declared_plain"])
def test_a_dtensor_the_receiver_cannot_take_is_refused_by_name_on_every_rank(kind):
    said = {r: v for r, (_, v) in run_ranks(_mismatch, 4, kind, timeout=240).items()}
    want = ("stage 1's input 0, microbatch 0 is a DTensor from stage 0 on mesh ('tp',) of shape (2,) with placements "
            "(Replicate(),), but stage 1 has no such mesh (its meshes: mesh ('tp',) of shape (1,))"
            if kind == "mesh_shape" else
            "stage 1, microbatch 0: input 0 is a DTensor with placements (Replicate(),) on mesh ('tp',) of shape (2,), "
            "input_args has a plain tensor")
    for r in range(4):
        assert want in said[r], f"rank {r}: {said[r]}"


@pytest.mark.isolated  # fresh ranks: after another DTensor test in a pool worker, torch's DTensor dispatch
# reaches a previous test's process group ("Could not resolve the process group registered under the name 4")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["replicate", "sequence"])
def test_pp_x_fsdp_x_tp_2x1x2_matches_the_unsplit_model(case):
    no_complaints(_train, 4, case, ["1f1b", "zb_h1"], "fsdp", timeout=500)


@pytest.mark.slow
@pytest.mark.ranks8
@pytest.mark.isolated  # fresh ranks, as the 2 x 1 x 2 run
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", ["replicate", "sequence"])
def test_pp_x_fsdp_x_tp_2x2x2_matches_the_unsplit_model(case):
    """8 ranks: two FSDP replicas, each on half the batch; FSDP's reduce-scatter over dp_shard averages them. The
    zero-bubble schedules' W and the V schedules' two stages per rank under FSDP included."""
    no_complaints(_train, 8, case, ["1f1b", "zb_h1", "interleaved_1f1b", "zbv", "dualpipev"], "fsdp", "", 2,
                  timeout=800)


@pytest.mark.isolated  # fresh ranks: after another DTensor test in a pool worker, torch's DTensor dispatch
# reaches a previous test's process group ("Could not resolve the process group registered under the name 4")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["replicate", "sequence"])
def test_torch_pipeline_stage_on_the_same_case_for_reference(case):
    """torch 2.13's PipelineStage (with get_mesh=) and 1F1B on the same model and data: exact too."""
    no_complaints(_train, 4, case, ["1f1b", "interleaved_1f1b"], "torch", timeout=500)


# -- tied weights sharded over TP: the embedding on the first stage, the head on the last -------------------
V = 16  # vocabulary: the tied weight is (V, D), Shard(0) over tp on both ends (rowwise embedding, colwise head)


class TiedStage(nn.Module):
    def __init__(self, first: bool, last: bool) -> None:
        super().__init__()
        if first:
            self.embed = nn.Embedding(V, D)
        self.blocks = nn.Sequential(Block())
        if last:
            self.head = nn.Linear(D, V, bias=False)

    def forward(self, x):
        x = self.blocks(self.embed(x) if hasattr(self, "embed") else x)
        return self.head(x) if hasattr(self, "head") else x


def _train_tied(rank: int, world: int, names: list[str], dp: int) -> list[str]:
    """The user's loop with ``pe.tie_parameters`` over a TP-sharded embedding and head (FSDP over ``dp`` replicas
    when ``dp``): the tied gradient is the sum of both uses' DTensor gradients, the copies stay equal."""
    import pipeline_ext as pe
    from pipeline_ext import schedules as S
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    _fresh_dtensor_caches()
    mesh = init_device_mesh("cpu", (2, max(dp, 1), world // (2 * max(dp, 1))), mesh_dim_names=("pp", "dp_shard", "tp"))
    tp, pp = mesh["tp"], mesh["pp"]
    tol = TOL
    bad: list[str] = []
    for name in names:
        plan = S.build(name, 2, M)
        ns = plan.num_stages
        mine = [s for s, r in enumerate(plan.stage_to_rank) if r == pp.get_local_rank()]
        torch.manual_seed(0)
        ref = [TiedStage(s == 0, s == ns - 1) for s in range(ns)]
        ref[-1].head.weight = ref[0].embed.weight  # the unsplit model: one weight, both uses
        torch.manual_seed(0)
        modules = {s: m for s, m in enumerate(TiedStage(s == 0, s == ns - 1) for s in range(ns)) if s in mine}
        for s, m in modules.items():  # the head starts as its own random weight: tie_parameters broadcasts stage 0's
            tp_plan = {"blocks.0.w1": ColwiseParallel(), "blocks.0.w2": RowwiseParallel(use_local_output=False)}
            if s == 0:
                tp_plan["embed"] = RowwiseParallel(input_layouts=Replicate())
            if s == ns - 1:
                tp_plan["blocks.0.w2"] = RowwiseParallel()
                tp_plan["head"] = ColwiseParallel(output_layouts=Replicate())
            modules[s] = parallelize_module(m, tp, tp_plan)
            if dp:
                fully_shard(modules[s], mesh=mesh["dp_shard"])
        stages = [pe.PipelineStage(modules[s], s, ns, "cpu", group=pp) for s in mine]
        sched = pe.get_schedule_class(name)(stages if len(stages) > 1 else stages[0], M, loss_fn=_loss, timeout=120.0)
        tied = pe.tie_parameters(sched, {"embed": {0: "embed.weight", ns - 1: "head.weight"}})
        opt = torch.optim.SGD([p for m in modules.values() for p in m.parameters()], lr=0.1)
        ref_opt = torch.optim.SGD(nn.ModuleList(ref).parameters(), lr=0.1)  # the tied weight once
        rows = ROWS // max(dp, 1)
        lo = mesh["dp_shard"].get_local_rank() * rows
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randint(0, V, (ROWS, SEQ), generator=g), torch.randn(ROWS, SEQ, V, generator=g)
            opt.zero_grad()
            losses: list = []
            sched.step(*((x[lo:lo + rows],) if 0 in mine else ()), target=y[lo:lo + rows] if ns - 1 in mine else None,
                       losses=losses)
            ref_opt.zero_grad()
            out = x
            for m in ref:
                out = m(out)
            ref_loss = _loss(out, y)
            ref_loss.backward()
            where = f"tied {name} dp {dp} rank {rank} step {step}"
            if ns - 1 in mine:
                got = _replicas_mean(losses, mesh, dp)
                if not torch.allclose(got, ref_loss.detach(), **tol):
                    bad.append(f"{where}: loss {got.item()} != {ref_loss.item()}")
            for s in mine:
                for pn, p in modules[s].named_parameters():
                    q = ref[s].get_parameter(pn)
                    if p.grad is None or not torch.allclose(_full(p.grad), q.grad, **tol):
                        err = "none" if p.grad is None else f"{(_full(p.grad) - q.grad).abs().max():.3g}"
                        bad.append(f"{where}: stage {s} {pn} grad differs (max err {err})")
            opt.step()
            ref_opt.step()
            if tied.max_difference() != 0.0:
                bad.append(f"{where}: the tied copies differ by {tied.max_difference()} after the step")
        for s in mine:  # the parameters after the steps, the tied ones on both ends
            for pn, p in modules[s].named_parameters():
                if not torch.allclose(_full(p), ref[s].get_parameter(pn).detach(), **tol):
                    bad.append(f"tied {name} dp {dp} rank {rank}: stage {s} {pn} differs after {STEPS} steps")
        dist.barrier()
    return bad


@pytest.mark.isolated  # fresh ranks, as the FSDP runs above
@pytest.mark.timeout(600)
def test_tied_embedding_and_head_sharded_over_tp_match_the_unsplit_model():
    """pp=2 x tp=2; 1F1B, ZB-H1 and ZBV (both ends on one rank: the copies summed in memory). Without FSDP the
    embedding's gradient is Replicate, the head's Shard(0): the tie lays both out as their parameters first."""
    no_complaints(_train_tied, 4, ["1f1b", "zb_h1", "zbv"], 0, timeout=500)


@pytest.mark.slow
@pytest.mark.ranks8
@pytest.mark.isolated
@pytest.mark.timeout(900)
def test_tied_embedding_and_head_over_pp_x_fsdp_x_tp_2x2x2_match_the_unsplit_model():
    """With FSDP the tie sums the reduce-scattered shards ((_StridedShard(0), Shard(0)) on (dp_shard, tp))."""
    no_complaints(_train_tied, 8, ["1f1b", "zb_h1", "zbv"], 2, timeout=800)


def _tie_mismatched_placements(rank: int, world: int) -> str:
    import pipeline_ext as pe
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    _fresh_dtensor_caches()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    index = mesh["pp"].get_local_rank()
    torch.manual_seed(0)
    if index == 0:  # a TP embedding: Shard(0), local (V/2, D)
        module = parallelize_module(TiedStage(True, False), mesh["tp"],
                                    {"embed": RowwiseParallel(input_layouts=Replicate())})
    else:  # a plain head whose weight happens to have the shard's shape
        module = TiedStage(False, False)
        module.head = nn.Linear(D, V // 2, bias=False)
    sched = pe.Schedule1F1B(pe.PipelineStage(module, index, 2, "cpu", group=mesh["pp"]), M, loss_fn=_loss)
    try:
        pe.tie_parameters(sched, {"embed": {0: "embed.weight", 1: "head.weight"}})
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(300)
def test_tied_copies_sharded_differently_are_refused_on_every_rank():
    said = {r: v for r, (_, v) in run_ranks(_tie_mismatched_placements, 4, timeout=240).items()}
    for r in range(4):
        assert "differ in (local shape, dtype, placements)" in said[r] and "(Shard(dim=0),)" in said[r] \
            and "'plain'" in said[r], f"rank {r}: {said[r]}"
