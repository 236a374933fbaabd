"""Pipeline x tensor parallel: DTensor activations between stages, exact against the unsplit model.

4 Gloo CPU ranks, mesh (pp=2, tp=2); each stage is two MLP blocks made
tensor-parallel with ``parallelize_module`` (w1 colwise, w2 rowwise), as a
torchtitan user writes it. What crosses stages is a plain tensor (the blocks
return local outputs), a Replicate DTensor (``use_local_output=False``) or a
sequence-parallel ``Shard(1)`` DTensor. Several SGD steps; the loss and every
full gradient are compared with the unsplit model's at every step. The model,
the mesh and the comparisons are tp_case.py's, shared with the other pp x tp
files here. See [Note: DTensors between stages] in
pipeline_ext/runtime/dtensor_wire.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mp_utils import TEST_DEVICE_ENV, device_under_test, no_complaints, run_ranks
from pipeline_ext.comm.transport import TRANSPORT_ENV
from models import GPU_TOL, TOL
from tp_case import (D, M, ROWS, SEQ, STEPS, Block, Stage, batch, first_step_error, full, grad_mismatches,
                     loss_mismatch, mse, param_mismatches, parallelize, placement, pp_tp_mesh, replicas_mean, schedule,
                     sgd_pair, split_fallbacks, stages_on_rank, unsplit_loss)


def _train(rank: int, world: int, case: str, names: list[str], mesh_kw: str, given: str = "", dp: int = 1,
           budget: bool = False) -> list[str]:
    """``given``: the step's inputs, targets and last outputs are DTensors of that placement (split into
    microbatches and merged back by the schedule); else plain tensors. ``dp`` (with ``mesh_kw="fsdp"``): FSDP
    replicas, each stepping on its own rows of the batch as torchtitan feeds them; the full gradients after
    FSDP's reduce-scatter and the loss averaged over the replicas are compared with the unsplit model on the
    whole batch."""
    dev = device_under_test()  # cuda: every rank on cuda:0 over NCCL, tp = world // 2 (1 on one GPU)
    tol = TOL if dev.type == "cpu" else GPU_TOL
    fsdp = mesh_kw == "fsdp"  # FSDP2 as the third dim, composed as torchtitan does: TP, then fully_shard
    mesh = pp_tp_mesh(world, dp if fsdp else 0, dev.type)
    tp, pp = mesh["tp"], mesh["pp"]
    bad: list[str] = []
    for name in names:
        ns, mine = stages_on_rank(name, pp)
        torch.manual_seed(0)
        ref = [Stage().to(dev) for _ in range(ns)]
        torch.manual_seed(0)
        modules = {s: m.to(dev) for s, m in enumerate(Stage() for _ in range(ns)) if s in mine}
        for s in mine:
            modules[s] = parallelize(modules[s], s, ns, case, tp, given)
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
                        loss_fn=mse, scale_grads=True)
        else:
            # ``budget``: FSDP stages gathered one at a time (DualPipeV's pairs: two), placed by the planner
            tight = {"max_active_stages": 2 if name == "dualpipev" else 1} if budget else None
            stages, sched = schedule(name, modules, mine, ns, pp, dev, sched_kw=tight, **extra)
        opt, ref_opt = sgd_pair(mine, modules, ref)
        for step in range(STEPS):
            x, y = (t.to(dev) for t in batch(step))
            opt.zero_grad()
            losses: list = []
            xs, ys = x, y
            if fsdp:  # this replica's rows
                lo = mesh["dp_shard"].get_local_rank() * (ROWS // dp)
                xs, ys = x[lo:lo + ROWS // dp], y[lo:lo + ROWS // dp]
            if given:
                from torch.distributed.tensor import distribute_tensor

                xs, ys = (distribute_tensor(t, tp, [placement(given)]) for t in (x, y))
            merged = sched.step(*((xs,) if 0 in mine else ()), target=ys if ns - 1 in mine else None,
                                losses=losses)
            ref_opt.zero_grad()
            out, ref_loss = unsplit_loss(ref, x, y)
            where = f"{case} {name} rank {rank} step {step}"
            if ns - 1 in mine:
                if given and not torch.allclose(full(merged), out.detach(), **tol):
                    bad.append(f"{where}: the merged output differs from the unsplit model's")
                bad += loss_mismatch(where, replicas_mean(losses, mesh, dp if fsdp else 1), ref_loss, tol)
            bad += grad_mismatches(where, mine, modules, ref, tol, ratio=True)
            opt.step()
            ref_opt.step()
        if mesh_kw != "torch":  # the I/W split held: W ran over the DTensor params
            bad += split_fallbacks(f"{case} {name} rank {rank}", stages)
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

    mesh = pp_tp_mesh()
    other = init_device_mesh("cpu", (4, 1), mesh_dim_names=("x", "tp"))["tp"]  # a "tp" of shape (1,)
    tp, pp = mesh["tp"], mesh["pp"]
    index = pp.get_local_rank()
    torch.manual_seed(0)
    if index == 0:
        module, extra = parallelize(Stage(), 0, 2, "replicate", tp), {}
    elif kind == "mesh_shape":
        module, extra = Stage(), {"mesh": other}
    else:  # a plain tensor declared where a Replicate DTensor arrives
        module, extra = parallelize(Stage(), 1, 2, "replicate", tp), {"input_args": torch.empty(ROWS // M, SEQ, D)}
    return first_step_error(pe.PipelineStage(module, index, 2, "cpu", group=pp, **extra))


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


@pytest.mark.slow
@pytest.mark.ranks8
@pytest.mark.isolated
@pytest.mark.timeout(900)
def test_pp_x_fsdp_x_tp_2x2x2_under_the_tightest_parameter_budget_matches_the_unsplit_model():
    """The same, the multi-stage schedules with FSDP stages gathered one at a time (max_active_stages=1, DualPipeV's
    pairs 2): UNSHARD / RESHARD / REDUCE_GRAD over TP-sharded FSDP parameters, W after a reshard included."""
    no_complaints(_train, 8, "replicate", ["interleaved_1f1b", "zbv", "dualpipev"], "fsdp", "", 2, True,
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
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = pp_tp_mesh(world, max(dp, 1))
    tp, pp = mesh["tp"], mesh["pp"]
    bad: list[str] = []
    for name in names:
        ns, mine = stages_on_rank(name, pp)
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
        _, sched = schedule(name, modules, mine, ns, pp)
        tied = pe.tie_parameters(sched, {"embed": {0: "embed.weight", ns - 1: "head.weight"}})
        opt, ref_opt = sgd_pair(mine, modules, ref)  # the unsplit model's tied weight once
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
            _, ref_loss = unsplit_loss(ref, x, y)
            where = f"tied {name} dp {dp} rank {rank} step {step}"
            if ns - 1 in mine:
                bad += loss_mismatch(where, replicas_mean(losses, mesh, dp), ref_loss)
            bad += grad_mismatches(where, mine, modules, ref)
            opt.step()
            ref_opt.step()
            if tied.max_difference() != 0.0:
                bad.append(f"{where}: the tied copies differ by {tied.max_difference()} after the step")
        # the parameters after the last step, the tied ones on both ends
        bad += param_mismatches(f"tied {name} dp {dp} rank {rank} step {STEPS - 1}", mine, modules, ref)
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
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    mesh = pp_tp_mesh()
    index = mesh["pp"].get_local_rank()
    torch.manual_seed(0)
    if index == 0:  # a TP embedding: Shard(0), local (V/2, D)
        module = parallelize_module(TiedStage(True, False), mesh["tp"],
                                    {"embed": RowwiseParallel(input_layouts=Replicate())})
    else:  # a plain head whose weight happens to have the shard's shape
        module = TiedStage(False, False)
        module.head = nn.Linear(D, V // 2, bias=False)
    sched = pe.Schedule1F1B(pe.PipelineStage(module, index, 2, "cpu", group=mesh["pp"]), M, loss_fn=mse)
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
