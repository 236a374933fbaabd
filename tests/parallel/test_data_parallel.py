"""Pipeline x data parallel (issue 11): 4 Gloo ranks as 2 pipeline stages x 2 replicas.

Each replica gets half of the global batch; every stage is wrapped in
DistributedDataParallel, in FSDP2 ``fully_shard`` (block and stage, so both
resharding settings are exercised) or in nothing (the user all-reduces by
hand). After 3 SGD steps every rank's parameters must equal those of the
unsplit model trained on the whole global batch, for 1F1B, interleaved 1F1B,
ZB-H1 and ZBV (several stages per rank, I/W split, V placement), and with DDP
and FSDP2 also for GPipe, looped BFS, ZB-H2 and DualPipeV. One spawn per
(wrapper, schedule list) loops over the schedules, building fresh models each
time. Reductions are counted: exactly one per stage (DDP bucket, FSDP2
parameter group) per step.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from models import build, loss_fn, make_batch, run_stages, TOL
from mp_utils import no_complaints, run_ranks, device_under_test

PP, DP, M, ROWS, STEPS = 2, 2, 4, 16, 3
SCHEDULES = ["1f1b", "interleaved_1f1b", "zb_h1", "zbv"]
OTHER_SCHEDULES = ["gpipe", "looped_bfs", "zb_h2", "dualpipev"]
COUNTED = {"zb_h1", "zbv", "zb_h2", "dualpipev"}  # these count reductions through a DDP comm hook / an FSDP2 custom reduce-scatter


def _counting_reduce_scatter(counter: list[int]):
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class Counting(DefaultReduceScatter):
        def __call__(self, *args, **kwargs):
            counter[0] += 1
            return super().__call__(*args, **kwargs)

    return Counting()


def _wrap(wrapper: str, module: torch.nn.Module, mesh, counter: list[int], count: bool) -> torch.nn.Module:
    """The stage as the user would wrap it; counting wrappers reduce exactly as the defaults do."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    if wrapper == "ddp":
        ddp = DDP(module, process_group=mesh["dp"].get_group())
        if count:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def hook(group, bucket):
                counter[0] += 1
                return allreduce_hook(group, bucket)

            ddp.register_comm_hook(mesh["dp"].get_group(), hook)
        return ddp
    if wrapper == "fsdp":
        fully_shard(module.block, mesh=mesh["dp"])  # inner: reshards after forward (FSDP2's default)
        root = fully_shard(module, mesh=mesh["dp"])  # root: stays unsharded after forward
        if count:
            for m in (module.block, root):
                if m._get_fsdp_state()._fsdp_param_groups:
                    m.set_custom_reduce_scatter(_counting_reduce_scatter(counter))
        return root
    return module


def _groups_reduced(wrapper: str, wrapped: dict) -> int:
    """Reductions one step must make on this rank: one per DDP bucket or FSDP2 parameter group."""
    if wrapper == "ddp":
        return len(wrapped)  # these small stages fit in one bucket
    return sum(len(m._get_fsdp_state()._fsdp_param_groups) for w in wrapped.values() for m in (w.block, w))


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()


def _schedule_run(rank: int, mesh, name: str, wrapper: str) -> list[str]:
    import pipeline_ext as pe

    layout = pe.pipeline_layout(mesh, name)
    ns, mine = layout.num_stages, layout.stages
    modules, ref = build("blocks", ns), build("blocks", ns)
    counter, count = [0], name in COUNTED and wrapper != "none"
    wrapped = {s: _wrap(wrapper, modules[s], mesh, counter, count) for s in mine}
    group = mesh["pp"] if wrapper == "fsdp" else layout.pp_group  # a 1-D DeviceMesh works as well as its group
    stages = [pe.PipelineStage(wrapped[s], s, ns, device_under_test(), group=group) for s in mine]
    sched = pe.get_schedule_class(name)(stages if len(stages) > 1 else stages[0], M, loss_fn=loss_fn)
    opt = torch.optim.SGD([p for s in mine for p in wrapped[s].parameters()], lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD([p for st in ref for p in st.parameters()], lr=0.1, momentum=0.9)
    rows = slice(layout.dp_rank * ROWS // DP, (layout.dp_rank + 1) * ROWS // DP)
    where = f"{wrapper} {name} rank {rank}"
    for step in range(STEPS):
        x, y = make_batch("blocks", ROWS, seed=step)
        opt.zero_grad()
        sched.step(*((x[rows],) if 0 in mine else ()), target=y[rows] if ns - 1 in mine else None)
        if wrapper == "none":  # by hand, as a user would without a wrapper
            for p in (p for s in mine for p in modules[s].parameters()):
                dist.all_reduce(p.grad, group=layout.dp_group)
                p.grad /= DP
        opt.step()
        ref_opt.zero_grad()
        loss_fn(run_stages(ref, x), y).backward()
        ref_opt.step()
    bad = [
        f"{where}: stage {s} param {i} differs from the unsplit model after {STEPS} steps "
        f"(max err {(_full(p) - q).abs().max():.3g})"
        for s in mine
        for i, (p, q) in enumerate(zip(wrapped[s].parameters(), ref[s].parameters()))
        if not torch.allclose(_full(p), q, **TOL)
    ]
    if count and counter[0] != STEPS * _groups_reduced(wrapper, wrapped):
        bad.append(f"{where}: {counter[0]} reductions in {STEPS} steps, expected {STEPS * _groups_reduced(wrapper, wrapped)}")
    if wrapper == "ddp" and name == "1f1b":
        bad += _accumulate_under_no_sync(sched, wrapped, ref, mine, ns, rows, where)
    return bad


def _accumulate_under_no_sync(sched, wrapped: dict, ref, mine: list[int], ns: int, rows: slice, where: str) -> list[str]:
    """A step inside the user's ``no_sync()`` accumulates this replica's gradients and reduces nothing."""
    x, y = make_batch("blocks", ROWS, seed=99)
    for p in (p for s in mine for p in wrapped[s].parameters()):
        p.grad = None
    with contextlib.ExitStack() as stack:
        for w in wrapped.values():
            stack.enter_context(w.no_sync())
        sched.step(*((x[rows],) if 0 in mine else ()), target=y[rows] if ns - 1 in mine else None)
    for st in ref:
        st.zero_grad()
    loss_fn(run_stages(ref, x[rows]), y[rows]).backward()  # this replica's half only
    bad = [f"{where}: require_backward_grad_sync not restored" for w in wrapped.values() if not w.require_backward_grad_sync]
    bad += [
        f"{where}: under no_sync, stage {s} param {i} grad is not this replica's own"
        for s in mine
        for i, (p, q) in enumerate(zip(wrapped[s].parameters(), ref[s].parameters()))
        if not torch.allclose(p.grad, q.grad, **TOL)
    ]
    return bad


def _train(rank: int, world: int, wrapper: str, names: list[str]) -> list[str]:
    import pipeline_ext as pe

    mesh = pe.pipeline_mesh(pp=PP, dp=DP, device_type=device_under_test().type)
    return [b for name in names for b in _schedule_run(rank, mesh, name, wrapper)]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp", "none"])
@pytest.mark.usefixtures("stage_device")
def test_pp_x_dp_matches_unsplit_model(wrapper):
    no_complaints(_train, PP * DP, wrapper, SCHEDULES, timeout=200)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_pp_x_dp_other_schedules_match_unsplit_model(wrapper):
    no_complaints(_train, PP * DP, wrapper, OTHER_SCHEDULES, timeout=200)


# -- refused wrappers ---------------------------------------------------------------------------
def _refusals(rank: int, world: int) -> dict[str, str]:
    """Build a stage around each wrapper the runner cannot make exact; return each error message."""
    import pipeline_ext as pe
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pipeline_ext.comm.data_parallel import UnsupportedWrapperError

    said: dict[str, str] = {}

    def attempt(case: str, make) -> None:
        try:
            pe.PipelineStage(make(), rank, world, "cpu")
        except UnsupportedWrapperError as exc:
            said[case] = str(exc)
        else:
            said[case] = "accepted"

    def hooked() -> nn.Module:
        lin = nn.Linear(4, 4)
        lin.weight.register_post_accumulate_grad_hook(lambda p: None)
        return lin

    solo = [dist.new_group([r]) for r in range(world)][rank]  # a data-parallel group of one: not overlapping
    attempt("fsdp1", lambda: FullyShardedDataParallel(nn.Linear(4, 4), process_group=solo, device_id=torch.device("cpu")))
    attempt("data_parallel", lambda: nn.DataParallel(nn.Linear(4, 4)))
    attempt("static_graph", lambda: DDP(nn.Linear(4, 4), process_group=solo, static_graph=True))
    attempt("overlapping_group", lambda: DDP(nn.Linear(4, 4)))  # the world: the other stage is no replica
    attempt("post_accumulate_hook", hooked)
    attempt("nested_fsdp1", lambda: nn.Sequential(nn.Linear(4, 4), FullyShardedDataParallel(
        nn.Linear(4, 4), process_group=solo, device_id=torch.device("cpu"))))
    said["plain_ddp"] = repr(pe.PipelineStage(DDP(nn.Linear(4, 4), process_group=solo), rank, world, "cpu").grad_sync)
    return said


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_unsupported_wrappers_are_refused_with_their_name():
    said = run_ranks(_refusals, 2, timeout=90)[0][1]
    expect = {
        "fsdp1": "FullyShardedDataParallel (FSDP1)",
        "data_parallel": "DataParallel",
        "static_graph": "static_graph=True",
        "overlapping_group": "include ranks [1] of the pipeline group",
        "post_accumulate_hook": "parameter 'weight' has a post-accumulate-grad hook",
        "nested_fsdp1": "submodule '1'",
    }
    for case, words in expect.items():
        assert words in said[case], (case, said[case])
    assert "DDPSync" in said["plain_ddp"], said["plain_ddp"]


# -- the runner's side of the protocol (one process, no communication) ---------------------------
class _Recorder:
    """A GradientSync that records what the runner asks of it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def begin(self) -> None:
        self.calls.append("begin")

    def before_backward(self) -> None:
        self.calls.append("before")

    def finish(self) -> None:
        self.calls.append("finish")

    def abort(self) -> None:
        self.calls.append("abort")


@pytest.mark.parametrize("split", [False, True])
def test_runner_begins_at_first_forward_and_finishes_after_last_weight_grad(split):
    from torch import nn

    from pipeline_ext.runtime.stage import StageRunner

    sync = _Recorder()
    runner = StageRunner(nn.Linear(4, 4), 1, 2, loss_fn, grad_sync=sync, n_microbatches=2)
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    with torch.no_grad():
        runner.forward(0, (x,))  # forward-only (eval) steps never begin a sync
    runner.reset()
    assert sync.calls == []
    for mb in range(2):
        runner.forward(mb, (x,), target=y)
    assert sync.calls == ["begin"]
    for mb in range(2):
        if split:
            runner.backward_input(mb)
            runner.backward_weight(mb)
        else:
            runner.backward(mb)
    backwards = ["before", "before"] if split else ["before"]
    assert sync.calls == ["begin", *backwards, *backwards, "finish"]  # finish exactly once, after the last
    sync.calls.clear()
    runner.forward(0, (x,), target=y)  # a step that fails after its first forward
    runner.reset()
    assert sync.calls == ["begin", "abort"]
    with pytest.raises(ValueError, match="n_microbatches"):
        StageRunner(nn.Linear(4, 4), 0, 2, grad_sync=sync)
