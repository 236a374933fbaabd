"""Behaviours torch.distributed.pipelining users rely on, checked on pipeline_ext (2 Gloo ranks).

Written here from torch's documented behaviour (its schedules' ``step`` and
``eval``, ``PipelineStage``, ``TensorChunkSpec``, the CSV format and the class
names): every behaviour is compared with the unsplit model. The checks are
grouped into a few spawned runs to keep CI short.
"""
from __future__ import annotations

import pytest
import torch

import pipeline_ext as pe
from models import build, loss_fn, make_batch, run_stages, TOL
from mp_utils import no_complaints


def _parity(rank: int, world: int) -> list[str]:
    modules, ref = build("mlp", world), build("mlp", world)
    stage = pe.PipelineStage(modules[rank], rank, world, "cpu")
    sched = pe.Schedule1F1B(stage, 4, loss_fn=loss_fn)
    bad, losses = [], []
    for i in range(2):
        x, y = make_batch("mlp", 8, seed=i)
        # as torch allows: every rank passes the batch; only stage 0's rank uses it
        sched.step(x, target=y if rank == world - 1 else None, losses=losses)
        if rank == world - 1:
            # the list holds this step's losses only (torch clears it first)
            mean = sum(losses) / len(losses)
            with torch.no_grad():
                want = loss_fn(run_stages(ref, x), y)
            if len(losses) != 4 or not torch.allclose(mean, want, **TOL):
                bad.append(f"step {i}: {len(losses)} losses, mean {float(mean):.6f} vs {float(want):.6f}")
        loss_fn(run_stages(ref, x), y).backward()
    # the inputs every rank passed changed nothing: gradients of both steps equal the unsplit model's
    for j, (p, q) in enumerate(zip(modules[rank].parameters(), ref[rank].parameters())):
        if not torch.allclose(p.grad, q.grad, **TOL):
            bad.append(f"rank {rank}: parameter {j} gradient differs from the unsplit model")
    return bad


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_losses_list_is_refilled_and_inputs_on_other_ranks_are_ignored():
    no_complaints(_parity, 2, timeout=40)


def test_torch_class_names():
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    assert pe.get_schedule_class("ZBVZeroBubble") is pe.ScheduleZBVZeroBubble
    for name, cls in [("1F1B", pe.Schedule1F1B), ("Interleaved1F1B", pe.ScheduleInterleaved1F1B),
                      ("GPipe", pe.ScheduleGPipe), ("LoopedBFS", pe.ScheduleLoopedBFS),
                      ("InterleavedZeroBubble", pe.ScheduleInterleavedZeroBubble), ("DualPipeV", pe.ScheduleDualPipeV),
                      ("PipelineScheduleSingle", pe.PipelineScheduleSingle),
                      ("PipelineScheduleMulti", pe.PipelineScheduleMulti), ("zb_h1", pe.ScheduleZBH1)]:
        assert pe.get_schedule_class(name) is cls and pe.get_schedule_class(name.upper()) is cls
    for cls in (pe.ScheduleGPipe, pe.Schedule1F1B, pe.ScheduleZBH1, pe._ScheduleForwardOnly):
        assert issubclass(cls, pe.PipelineScheduleSingle) and issubclass(cls, _PipelineSchedule)
    for cls in (pe.ScheduleInterleaved1F1B, pe.ScheduleLoopedBFS, pe.ScheduleInterleavedZeroBubble, pe.ScheduleZBVZeroBubble,
                pe.ScheduleDualPipeV):
        assert issubclass(cls, pe.PipelineScheduleMulti) and issubclass(cls, _PipelineSchedule)
    # torch's keyword arguments are visible in the signatures (mypy, Sphinx)
    import inspect

    assert "backward_requires_autograd" in inspect.signature(pe.ScheduleInterleaved1F1B).parameters
    assert list(inspect.signature(pe.Schedule1F1B).parameters)[:3] == ["stage", "n_microbatches", "loss_fn"]
    with pytest.raises(ValueError, match="unknown schedule 'nope'"):
        pe.get_schedule_class("nope")


def test_torch_chunk_specs_and_split_helper():
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate, sum_reducer

    x, mask = torch.arange(24.0).reshape(4, 6), torch.ones(6)
    args, kwargs = pe.split_args_kwargs_into_chunks((x, mask), {"y": x}, 2, (TensorChunkSpec(0), _Replicate),
                                                    {"y": TensorChunkSpec(1)})
    assert [a[0].shape for a in args] == [(2, 6), (2, 6)] and all(a[1] is mask for a in args)
    assert [k["y"].shape for k in kwargs] == [(4, 3), (4, 3)]
    assert torch.equal(pe.merge_chunks([k["y"] for k in kwargs], TensorChunkSpec(1)), x)
    assert float(pe.merge_chunks([torch.tensor(1.0), torch.tensor(2.5)], sum_reducer)) == 3.5
    assert pe.TensorChunkSpec.from_tuple((0, 1)) == (pe.TensorChunkSpec(0), pe.TensorChunkSpec(1))


def test_csv_round_trip_in_torchs_format(tmp_path):
    from pipeline_ext import schedules as S

    for name, v in [("zb_h1", 1), ("interleaved_zb", 2), ("zbv", 2)]:
        sched = S.build(name, 2, 4, stages_per_rank=v)
        S.dump_csv(sched, tmp_path / f"{name}.csv")
        back = S.load_csv(tmp_path / f"{name}.csv")
        assert back.actions == sched.actions and back.stage_to_rank == sched.stage_to_rank
    # torch's own spelling of idle slots, FSDP actions (kept: schedules place parameters too) and overlapped pairs
    (tmp_path / "torch.csv").write_text("0F0,0UNSHARD,,0F1,0RESHARD,(0B0;0B1)OVERLAP_F_B\n")
    assert [str(a) for a in S.load_csv(tmp_path / "torch.csv").actions[0]] == ["0F0", "0UNSHARD", "0F1", "0RESHARD",
                                                                                 "0B0", "0B1"]
    (tmp_path / "comms.csv").write_text("0F0,0SEND_F0\n")
    with pytest.raises(S.ScheduleError, match="use format='compute_comms'"):
        S.load_csv(tmp_path / "comms.csv")


def _grads_equal(modules, ref, idx) -> list[str]:
    return [f"stage {i} parameter {j}: gradient differs from the unsplit model"
            for i in idx for j, (p, q) in enumerate(zip(modules[i].parameters(), ref[i].parameters()))
            if p.grad is None or not torch.allclose(p.grad, q.grad, **TOL)]


def _step(sched, rank: int, world: int, x, y, **kw):
    return sched.step(*((x,) if rank == 0 else ()), **({"target": y} if rank == world - 1 else {}), **kw)


def _step_surface(rank: int, world: int) -> list[str]:
    """step()/eval() keywords and PipelineStage's methods, as torch has them."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec

    bad: list[str] = []
    last = rank == world - 1
    modules, ref = build("mlp", world), build("mlp", world)
    x, y = make_batch("mlp", 8)
    stage = pe.PipelineStage(modules[rank], rank, world, "cpu")
    scaled = lambda out, tgt, scale=1.0: scale * loss_fn(out, tgt)  # noqa: E731
    sched = pe.Schedule1F1B(stage, 4, loss_fn=scaled, args_chunk_spec=(TensorChunkSpec(0),),
                            output_merge_spec=TensorChunkSpec(0))
    assert stage.has_backward
    # eval with a target: losses, no backward
    losses: list = []
    out = sched.eval(*((x,) if rank == 0 else ()), target=y if last else None, losses=losses)
    with torch.no_grad():
        want_out = run_stages(ref, x)
    if any(p.grad is not None for p in modules[rank].parameters()):
        bad.append("eval(target=) wrote .grad")
    if last and not (len(losses) == 4 and torch.allclose(sum(losses) / 4, loss_fn(want_out, y), rtol=1e-5)
                     and torch.allclose(out, want_out, **TOL)):
        bad.append(f"eval(target=, losses=): {losses}")
    # loss_kwargs reach the loss; return_outputs=False returns nothing
    losses = []
    got = _step(sched, rank, world, x, y, losses=losses, loss_kwargs={"scale": 2.0}, return_outputs=False)
    (2.0 * loss_fn(run_stages(ref, x), y)).backward()
    if got is not None:
        bad.append("return_outputs=False returned something")
    if last and not torch.allclose(sum(losses) / 4, 2.0 * loss_fn(want_out, y), rtol=1e-5):
        bad.append("loss_kwargs did not reach the loss_fn")
    if last and stage.output_chunks:  # torch's save_forward_output=False: nothing returned, nothing kept
        bad.append(f"return_outputs=False kept {len(stage.output_chunks)} outputs in output_chunks")
    bad += _grads_equal(modules, ref, [rank])
    stage.scale_grads(2)
    if not all(torch.allclose(p.grad * 2, q.grad) for p, q in zip(modules[rank].parameters(), ref[rank].parameters())):
        bad.append("scale_grads(2) did not halve the gradients")
    stage.clear_runtime_states()
    if stage.output_chunks:
        bad.append("clear_runtime_states left output_chunks")
    # input_args/output_args describe one microbatch; a mismatch is named (checked on a one-rank group)
    import torch.distributed as dist

    alone = [dist.new_group([r]) for r in range(world)][rank]
    one = build("mlp", 1)[0]
    solo = pe.PipelineStage(one, 0, 1, "cpu", input_args=(torch.empty(2, x.shape[1]),), group=alone)
    sched1 = pe.ScheduleGPipe(solo, 4, loss_fn=loss_fn)
    sched1.step(x, target=y)  # 8 rows into 4 microbatches of 2: as declared
    try:
        sched1.step(x[:4], target=y[:4])
        bad.append("a microbatch unlike input_args was accepted")
    except pe.PipeliningMetadataError as exc:  # torch's class (also a ValueError), raised before any stage runs
        if "input 0: shape mismatch: (1, " not in str(exc) or "input_args has (2, " not in str(exc):
            bad.append(f"input_args mismatch message: {exc}")
    return bad


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_step_eval_keywords_and_stage_methods():
    no_complaints(_step_surface, 2, timeout=60)


class _CountingDw:
    """torch's dw_builder: a builder of W runners; counts the runs."""

    def __init__(self) -> None:
        self.runs = 0

    def __call__(self):
        def run() -> None:
            self.runs += 1

        return run


def _schedules(rank: int, world: int, tmp: str) -> list[str]:
    """Schedules torch has that we lacked, one stage per rank for the looped ones, CSV, dw_builder."""
    bad: list[str] = []
    last = rank == world - 1
    x, y = make_batch("mlp", 8)
    # (class, stages per rank, microbatches): torch's rounds rule lets 3 microbatches run on 2 ranks interleaved
    cases = [("ScheduleInterleavedZeroBubble", 2, 4), ("ScheduleInterleaved1F1B", 1, 4), ("ScheduleLoopedBFS", 1, 4),
             ("ScheduleZBVZeroBubble", 2, 4), ("ScheduleInterleaved1F1B", 2, 3), ("ScheduleInterleavedZeroBubble", 2, 1)]
    for cls_name, v, m in cases:
        n = world * v
        modules, ref = build("mlp", n), build("mlp", n)
        mine = [s for s in range(n) if (s % world == rank if cls_name != "ScheduleZBVZeroBubble"
                                        else s in (rank, n - 1 - rank))]
        stages = [pe.PipelineStage(modules[s], s, n, "cpu") for s in mine]
        sched = getattr(pe, cls_name)(stages, m, loss_fn=loss_fn)
        holds_last = (n - 1) in mine
        sched.step(*((x,) if 0 in mine else ()), **({"target": y} if holds_last else {}))
        loss_fn(run_stages(ref, x), y).backward()
        bad += [f"{cls_name} v={v} m={m}: {b}" for b in _grads_equal(modules, ref, mine)]
    # a schedule dumped in torch's CSV format and loaded into another runs exactly
    modules, ref = build("mlp", world), build("mlp", world)
    sched = pe.Schedule1F1B(pe.PipelineStage(modules[rank], rank, world, "cpu"), 4, loss_fn=loss_fn)
    if rank == 0:
        pe.ScheduleZBH1(pe.PipelineStage(build("mlp", world)[0], 0, world, "cpu"), 4)._dump_csv(f"{tmp}/zb.csv")
    import torch.distributed as dist

    dist.barrier()
    sched._load_csv(f"{tmp}/zb.csv")
    from torch.distributed.pipelining.schedules import F, I, W, _Action

    if not all(isinstance(a, _Action) for a in sched.pipeline_order[rank]):
        bad.append("pipeline_order does not hold torch's _Action objects")
    if {a.computation_type for a in sched.pipeline_order[rank]} != {F, I, W}:
        bad.append(f"the loaded CSV did not replace the order: {sched.pipeline_order[rank][:6]}")
    _step(sched, rank, world, x, y)
    loss_fn(run_stages(ref, x), y).backward()
    bad += [f"CSV: {b}" for b in _grads_equal(modules, ref, [rank])]
    # dw_builder: the whole autograd backward at I, the user's runner at W, once per microbatch
    modules, ref = build("mlp", world), build("mlp", world)
    dw = _CountingDw()
    sched = pe.ScheduleZBH1(pe.PipelineStage(modules[rank], rank, world, "cpu", dw_builder=dw), 4, loss_fn=loss_fn)
    _step(sched, rank, world, x, y)
    loss_fn(run_stages(ref, x), y).backward()
    bad += [f"dw_builder: {b}" for b in _grads_equal(modules, ref, [rank])]
    if dw.runs != 4:
        bad.append(f"dw_builder's runner ran {dw.runs} times, want 4 (one W per microbatch)")
    # torch's way of writing a custom schedule: subclass PipelineScheduleMulti, assign pipeline_order
    bad += _custom_subclass(rank, world, x, y)
    bad += _explicit_comms(rank, world, x, y)
    # torch's tracer front end: pipeline() cuts the model, torch's own build_stage or ours wraps a stage module
    bad += _traced(rank, world)
    # forward-only schedule and a training step under no_grad
    fwd = pe._ScheduleForwardOnly(pe.PipelineStage(build("mlp", world)[rank], rank, world, "cpu"), 4)
    out = fwd.step(*((x,) if rank == 0 else ()))
    if last and out.shape != y.shape:
        bad.append(f"_ScheduleForwardOnly output {tuple(out.shape)}")
    multi = pe.ScheduleInterleaved1F1B([pe.PipelineStage(build("mlp", world)[rank], rank, world, "cpu")], 4,
                                       loss_fn=loss_fn)
    try:
        with torch.no_grad():
            _step(multi, rank, world, x, y)
        bad.append("a training step under no_grad was accepted")
    except RuntimeError as exc:
        if "needs autograd" not in str(exc):
            bad.append(str(exc))
    return bad


class _TorchStyleV(pe.PipelineScheduleMulti):
    """A custom schedule written as torch users write one: torch's _Action objects, V placement."""

    def __init__(self, stages, n_microbatches: int, loss_fn) -> None:
        from torch.distributed.pipelining.schedules import _Action

        from pipeline_ext import schedules as S

        super().__init__(stages, n_microbatches, loss_fn=loss_fn)
        zbv = S.build("zbv", 2, n_microbatches)
        order = {r: [_Action.from_str(str(a)) for a in acts] + [None] for r, acts in enumerate(zbv.actions)}
        self.pipeline_order = order
        self._validate_and_set_stage_mapping(self.pipeline_order)


def _custom_subclass(rank: int, world: int, x, y) -> list[str]:
    n = 2 * world
    modules, ref = build("mlp", n), build("mlp", n)
    mine = [rank, n - 1 - rank]
    sched = _TorchStyleV([pe.PipelineStage(modules[s], s, n, "cpu") for s in mine], 4, loss_fn)
    sched.step(*((x,) if rank == 0 else ()), **({"target": y} if rank == 0 else {}))
    loss_fn(run_stages(ref, x), y).backward()
    return [f"torch-style subclass: {b}" for b in _grads_equal(modules, ref, mine)]


class _ExplicitComms(pe._PipelineScheduleRuntime):
    """torch's runtime class given every action, sends held back until both forwards ran (as torch users write one)."""

    def __init__(self, stages, n_microbatches: int, loss_fn) -> None:
        super().__init__(stages=stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
        self.pipeline_order_with_comms = {
            0: ["0F0", "0F1", "0SEND_F0", "0SEND_F1", "0RECV_B0", "0RECV_B1", "0B0", "0B1"],
            1: ["1RECV_F0", "1RECV_F1", "1F0", "1F1", "1B0", "1B1", "1SEND_B0", "1SEND_B1"],
        }


def _explicit_comms(rank: int, world: int, x, y) -> list[str]:
    modules, ref = build("mlp", world), build("mlp", world)
    sched = _ExplicitComms([pe.PipelineStage(modules[rank], rank, world, "cpu")], 2, loss_fn)
    if [str(a) for a in sched.pipeline_order_with_comms[0]][:4] != ["0F0", "0F1", "0SEND_F0", "0SEND_F1"]:
        return ["pipeline_order_with_comms does not give back the order as assigned"]
    _step(sched, rank, world, x, y)
    loss_fn(run_stages(ref, x), y).backward()
    return [f"_PipelineScheduleRuntime: {b}" for b in _grads_equal(modules, ref, [rank])]


class _Chain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _traced(rank: int, world: int) -> list[str]:
    bad = []
    x, y = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)), torch.zeros(8, 16)
    for how in ("torch's pipe.build_stage", "pe.build_stage"):
        torch.manual_seed(0)
        model, ref = _Chain(), _Chain()
        ref.load_state_dict(model.state_dict())
        pipe = pe.pipeline(model, mb_args=(x[:2],), split_spec={"layers.2": pe.SplitPoint.BEGINNING})
        if how == "pe.build_stage":
            stage = pe.build_stage(pipe.get_stage_module(rank), rank, pipe.info(), "cpu")
        else:
            stage = pipe.build_stage(rank, torch.device("cpu"))
        _step(pe.Schedule1F1B(stage, 4, loss_fn=loss_fn), rank, world, x, y)
        loss_fn(ref(x), y).backward()
        want = dict(ref.named_parameters())
        for name, p in stage.submod.named_parameters():
            if not torch.allclose(p.grad, want[name].grad, **TOL):
                bad.append(f"traced ({how}): {name} gradient differs from the unsplit model")
    return bad


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_torch_schedules_csv_and_dw_builder_are_exact(tmp_path):
    no_complaints(_schedules, 2, str(tmp_path), timeout=90)


class _StandIn:
    """A stage that only says where it sits (no module, no process group), as torch's own tests mock one."""

    submod = None
    group = None

    def __init__(self, num_stages: int, group_size: int, group_rank: int = 0) -> None:
        self.num_stages, self.group_size, self.group_rank = num_stages, group_size, group_rank


@pytest.mark.parametrize("cls,v", [(pe.ScheduleInterleaved1F1B, 2), (pe.ScheduleLoopedBFS, 3),
                                   (pe.ScheduleInterleavedZeroBubble, 2), (pe.ScheduleZBVZeroBubble, 2),
                                   (pe.ScheduleDualPipeV, 2)])
def test_orders_planned_from_stand_in_stages_pass_torchs_checks(cls, v):
    """No process group needed to plan: pipeline_order is torch's _Action lists, valid by torch's own simulator."""
    from torch.distributed.pipelining.schedules import _Action, _add_send_recv, _simulate_comms_compute

    p, m = 4, 8
    sched = cls([_StandIn(v * p, p) for _ in range(v)], m)
    order = sched.pipeline_order
    assert sorted(order) == list(range(p)) and all(isinstance(a, _Action) for acts in order.values() for a in acts)
    rank_of = sched.schedule.stage_to_rank.__getitem__
    # torch's simulator does not read OVERLAP_F_B pairs (DualPipeV's): it gets their two actions, as torch runs them
    order = {r: [s for a in acts for s in (a.sub_actions or (a,))] for r, acts in order.items()}
    _simulate_comms_compute(_add_send_recv(order, stage_to_rank=rank_of, num_stages=v * p),
                            stage_to_rank=rank_of, num_stages=v * p)
    with pytest.raises(RuntimeError, match="built from stand-in stages"):
        sched.step(torch.zeros(8, 2))
    with pytest.raises(ValueError, match="stages_per_rank == 2"):  # V schedules: two stages per rank
        pe.ScheduleZBVZeroBubble([_StandIn(3 * p, p) for _ in range(3)], m)


# -- torch's signatures, parameter by parameter (red-team issue 54, item 8) -----------------------------------

#: what torchtitan 0.3.0's trainer passes to step() (torch's newer pre-split form, which torch 2.13 lacks)
TORCHTITAN_STEP = ("arg_mbs", "kwarg_mbs", "target_mbs", "losses", "loss_kwargs", "return_outputs")


def _torch_classes() -> list[tuple[str, type, type]]:
    """(name, torch's class, ours) for PipelineStage and every schedule class both torch 2.13 and we have."""
    import inspect

    import torch.distributed.pipelining.schedules as ts
    import torch.distributed.pipelining.stage as tst

    found = [("PipelineStage", tst.PipelineStage, pe.PipelineStage)]
    for name, cls in sorted(vars(ts).items()):
        if (inspect.isclass(cls) and (name.startswith(("Schedule", "PipelineSchedule")) or name in (
                "_ScheduleForwardOnly", "_PipelineScheduleRuntime")) and hasattr(pe, name)):
            found.append((name, cls, getattr(pe, name)))
    return found


def test_every_parameter_of_torchs_signatures_is_accepted_in_torchs_positions():
    """Each parameter torch 2.13's ``__init__`` / ``step`` / ``eval`` takes is ours too, at the same position.

    By position as well as by name: a torch script that passes ``scale_grads``
    positionally to ``ScheduleInterleaved1F1B`` (torch has no
    ``use_full_backward`` there) must not set another argument here.
    """
    import inspect

    found = _torch_classes()
    names = {n for n, _, _ in found}
    assert {"PipelineStage", "Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
            "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV", "PipelineScheduleSingle",
            "PipelineScheduleMulti", "_ScheduleForwardOnly", "_PipelineScheduleRuntime"} <= names, names
    problems = []
    for name, theirs, ours in found:
        for method in ("__init__", "step", "eval"):
            if not hasattr(theirs, method):
                continue
            want = inspect.signature(getattr(theirs, method)).parameters
            have = inspect.signature(getattr(ours, method)).parameters
            if any(p.kind is p.VAR_KEYWORD for p in want.values()) and len(want) <= 3:
                continue  # torch's (*args, **kwargs) pass-through: its base class's signature is compared
            positional = lambda ps: [n for n, p in ps.items() if p.kind is p.POSITIONAL_OR_KEYWORD]  # noqa: E731
            if positional(have)[:len(positional(want))] != positional(want):
                problems.append(f"{name}.{method}: positions {positional(want)} in torch, {positional(have)} here")
            for pname, p in want.items():
                if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                    continue
                if pname not in have:
                    problems.append(f"{name}.{method}: torch's {pname}= is missing")
                elif p.default is not p.empty and have[pname].default != p.default:
                    problems.append(f"{name}.{method}: {pname} defaults to {have[pname].default!r} here, "
                                    f"{p.default!r} in torch")
        if name.startswith(("Schedule", "PipelineSchedule")) and name != "_ScheduleForwardOnly":
            have = inspect.signature(ours.step).parameters
            problems += [f"{name}.step: torchtitan's {k}= is missing" for k in TORCHTITAN_STEP if k not in have]
    assert not problems, "\n".join(problems)


def test_bad_torch_arguments_are_refused_by_name():
    import torch.distributed as dist

    from mp_utils import free_port

    mine = not dist.is_initialized()  # a one-rank group in this process, for PipelineStage's own checks
    if mine:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        mod = torch.nn.Linear(16, 16)
        with pytest.raises(TypeError, match="output_grads must be a tensor or a tuple of tensors"):
            pe.PipelineStage(mod, 0, 1, "cpu", output_grads="grad")
        # torch before 2.13 took group seventh; torch 2.13 (and this) takes output_grads there
        with pytest.raises(TypeError, match="output_grads got a ProcessGroup.*pass group= by keyword"):
            pe.PipelineStage(mod, 0, 1, "cpu", None, None, dist.group.WORLD)
        # declared gradients that cannot be the gradients of the declared tensors: the stage and both sides named
        with pytest.raises(pe.PipeliningMetadataError,
                           match=r"stage 0: output_grads\[0\] has shape \(2, 8\), output_args\[0\] has shape \(2, 16\)"):
            pe.PipelineStage(mod, 0, 1, "cpu", output_args=torch.empty(2, 16), output_grads=torch.empty(2, 8))
        with pytest.raises(pe.PipeliningMetadataError, match=r"stage 0: input_grads\[0\] has dtype torch.float64, "
                                                             r"input_args\[0\] has dtype torch.float32"):
            pe.PipelineStage(mod, 0, 1, "cpu", input_args=(torch.empty(2, 16),),
                             input_grads=(torch.empty(2, 16, dtype=torch.float64),))
        with pytest.raises(pe.PipeliningMetadataError, match="output_grads has 2 entries, output_args 1"):
            pe.PipelineStage(mod, 0, 1, "cpu", output_args=torch.empty(2, 16), output_grads=(torch.empty(2, 16), None))
        ok = pe.PipelineStage(mod, 0, 1, "cpu", output_args=torch.empty(2, 16), output_grads=[torch.empty(2, 16)],
                              input_grads=(None,))
        assert ok.output_grads[0].shape == (2, 16) and ok.input_grads == (None,)
        with pytest.raises(TypeError, match="defer_pp_recv must be a bool"):
            pe.ScheduleInterleaved1F1B([ok], 2, loss_fn=loss_fn, defer_pp_recv="yes")
    finally:
        if mine:
            dist.destroy_process_group()


def _ref_grads(ref, x, y, scale: float = 1.0) -> None:
    (scale * loss_fn(run_stages(ref, x), y)).backward()


def _pre_split(rank: int, world: int) -> list[str]:
    """torchtitan's step(arg_mbs=, kwarg_mbs=, target_mbs=, losses=, loss_kwargs=, return_outputs=False)."""
    bad: list[str] = []
    first, last = rank == 0, rank == world - 1
    m = 4
    x, y = make_batch("mlp", 8, seed=5)
    xs, ys = list(x.tensor_split(m)), list(y.tensor_split(m))
    split_mods, whole_mods, ref = build("mlp", world), build("mlp", world), build("mlp", world)
    scaled = lambda out, tgt, scale=1.0: scale * loss_fn(out, tgt)  # noqa: E731
    stage = pe.PipelineStage(split_mods[rank], rank, world, "cpu")
    pre = pe.Schedule1F1B(stage, m, loss_fn=scaled)
    whole = pe.Schedule1F1B(pe.PipelineStage(whole_mods[rank], rank, world, "cpu"), m, loss_fn=scaled)
    # kwarg_mbs on every rank, arg_mbs on stage 0's, target_mbs on the last stage's: as torchtitan's trainer calls it
    pre_losses: list = []
    out = pre.step(arg_mbs=[(t,) for t in xs] if first else None, kwarg_mbs=[{} for _ in range(m)],
                   target_mbs=ys if last else None, losses=pre_losses)
    whole_losses: list = []
    want_out = _step(whole, rank, world, x, y, losses=whole_losses)
    _ref_grads(ref, x, y)
    bad += [f"pre-split: {b}" for b in _grads_equal(split_mods, ref, [rank])]
    for j, (p, q) in enumerate(zip(split_mods[rank].parameters(), whole_mods[rank].parameters())):
        if not torch.equal(p.grad, q.grad):
            bad.append(f"parameter {j}: step(arg_mbs=...) and step(x, target=y) give different gradients")
    if last:
        if not (len(pre_losses) == m and all(torch.equal(a, b) for a, b in zip(pre_losses, whole_losses))):
            bad.append(f"losses {pre_losses} vs step(x, target=y)'s {whole_losses}")
        if not (isinstance(out, torch.Tensor) and torch.equal(out, want_out)):
            bad.append("step(arg_mbs=...) did not return the merged output step(x) returns")
    elif out is not None:
        bad.append("a rank without the last stage got an output")
    # return_outputs=False: None on every rank and nothing kept; loss_kwargs reach the loss
    pre_losses = []
    got = pre.step(arg_mbs=[(t,) for t in xs] if first else None, target_mbs=ys if last else None,
                   losses=pre_losses, loss_kwargs={"scale": 3.0}, return_outputs=False)
    _ref_grads(ref, x, y, scale=3.0)
    if got is not None:
        bad.append(f"return_outputs=False returned {type(got).__name__}")
    if last and stage.output_chunks:
        bad.append("return_outputs=False kept the outputs")
    if last and not torch.allclose(sum(pre_losses) / m, scaled(run_stages(ref, x).detach(), y, 3.0), rtol=1e-5):
        bad.append("loss_kwargs did not reach the loss_fn in a pre-split step")
    bad += [f"return_outputs=False: {b}" for b in _grads_equal(split_mods, ref, [rank])]
    # eval() takes them too (torchtitan's validator): losses, no gradient
    before = [p.grad.clone() for p in split_mods[rank].parameters()]
    losses: list = []
    got = pre.eval(arg_mbs=[(t,) for t in xs] if first else None, target_mbs=ys if last else None, losses=losses,
                   return_outputs=False)
    if got is not None or (last and len(losses) != m):
        bad.append(f"eval(arg_mbs=...): returned {type(got).__name__}, {len(losses)} losses")
    if not all(torch.equal(a, p.grad) for a, p in zip(before, split_mods[rank].parameters())):
        bad.append("eval(arg_mbs=...) changed .grad")
    # a mix of whole-batch and pre-split inputs: refused naming both, on every rank that mixed
    said = _refusal(pre.step, *((x,) if first else ()), **({"arg_mbs": [(t,) for t in xs]} if first else
                                                              {"target_mbs": ys, "target": y}))
    want = ("arg_mbs=", "whole-batch positional arguments") if first else ("target_mbs=", "target=")
    if not (said.startswith(("ValueError", "TypeError")) and all(w in said for w in want)):
        bad.append(f"mixing: {said}")
    # a list of the wrong length on one rank: refused there by name, and every other rank refuses that step too
    # (the agreement tells them), so none waits for a step that will not run
    said = _refusal(pre.step, **({"arg_mbs": [(t,) for t in xs[:3]]} if first else {"target_mbs": ys}))
    want = "arg_mbs has 3 entries but the schedule runs n_microbatches=4" if first else "StepRejectedError"
    if want not in said:
        bad.append(f"wrong length: {said}")
    pre_losses = []
    pre.step(arg_mbs=[(t,) for t in xs] if first else None, target_mbs=ys if last else None, losses=pre_losses)
    _ref_grads(ref, x, y)
    bad += [f"after refusals: {b}" for b in _grads_equal(split_mods, ref, [rank])]
    return bad


def _refusal(call, *args, **kwargs) -> str:
    try:
        call(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - which error, and its words, are what is checked
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_pre_split_step_as_torchtitan_calls_it_equals_the_whole_batch_step():
    no_complaints(_pre_split, 2, timeout=60)


def _declared_grads_and_defer(rank: int, world: int) -> list[str]:
    """output_grads/input_grads checked against what runs; defer_pp_recv and torch's positional order exact."""
    import torch.distributed as dist

    bad: list[str] = []
    x, y = make_batch("mlp", 8, seed=7)
    # gradients declared as they are: accepted, exact
    modules, ref = build("mlp", world), build("mlp", world)
    grads = dict(output_grads=(torch.empty(2, 16),)) if rank == 0 else dict(input_grads=torch.empty(2, 16))
    sched = pe.Schedule1F1B(pe.PipelineStage(modules[rank], rank, world, "cpu", **grads), 4, loss_fn=loss_fn)
    _step(sched, rank, world, x, y)
    _ref_grads(ref, x, y)
    bad += [f"declared gradients: {b}" for b in _grads_equal(modules, ref, [rank])]
    # declared gradients unlike the stage's outputs: refused naming the stage, the microbatch and both sides
    # (on a one-rank group, as the input_args check above)
    alone = [dist.new_group([r]) for r in range(world)][rank]
    solo = pe.PipelineStage(build("mlp", 1)[0], 0, 1, "cpu", output_grads=torch.empty(3, 4), group=alone)
    try:
        pe.ScheduleGPipe(solo, 4, loss_fn=loss_fn).step(x, target=y)
        bad.append("output_grads unlike the outputs were accepted")
    except pe.PipeliningMetadataError as exc:
        if "stage 0, microbatch 0: output_grads[0] has shape (3, 4), the stage's outputs[0] has shape (2, 4)" \
                not in str(exc):
            bad.append(f"output_grads mismatch message: {exc}")
    # defer_pp_recv=True: accepted, the same step bit for bit as without it, and the unsplit model's
    n = 2 * world
    runs = {}
    for defer in (False, True):
        modules, ref = build("mlp", n), build("mlp", n)
        mine = [s for s in range(n) if s % world == rank]
        sched = pe.ScheduleInterleaved1F1B([pe.PipelineStage(modules[s], s, n, "cpu") for s in mine], 4,
                                           loss_fn=loss_fn, defer_pp_recv=defer)
        if sched.defer_pp_recv is not defer:
            bad.append("defer_pp_recv is not kept")
        sched.step(*((x,) if 0 in mine else ()), **({"target": y} if n - 1 in mine else {}))
        _ref_grads(ref, x, y)
        bad += [f"defer_pp_recv={defer}: {b}" for b in _grads_equal(modules, ref, mine)]
        runs[defer] = [p.grad for s in mine for p in modules[s].parameters()]
    if not all(torch.equal(a, b) for a, b in zip(runs[False], runs[True])):
        bad.append("defer_pp_recv=True changed the gradients")
    # torch's positional order: (stages, n, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
    # scale_grads, backward_requires_autograd, defer_pp_recv); scale_grads=False sums the microbatch losses
    modules, ref = build("mlp", n), build("mlp", n)
    sched = pe.ScheduleInterleaved1F1B([pe.PipelineStage(modules[s], s, n, "cpu") for s in mine], 4, loss_fn,
                                       None, None, None, False, True, True)
    sched.step(*((x,) if 0 in mine else ()), **({"target": y} if n - 1 in mine else {}))
    _ref_grads(ref, x, y, scale=4.0)
    bad += [f"positional scale_grads=False: {b}" for b in _grads_equal(modules, ref, mine)]
    if sched.defer_pp_recv is not True:
        bad.append("positional defer_pp_recv was not taken")
    return bad


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_declared_gradients_are_checked_and_defer_pp_recv_is_exact():
    no_complaints(_declared_grads_and_defer, 2, timeout=90)


# -- torch's modules, module for module (issue 55, item 5) ------------------------------------------------------

#: torch's pipelining modules and their twins here: ``torch.distributed.pipelining`` -> ``pipeline_ext.pipelining``
TWINS = ["", ".schedules", ".stage", ".microbatch"]


def _torchs_own_names(module) -> set[str]:
    """Every name of a torch pipelining module that belongs to torch's pipelining, private ones included.

    A module's ``dir()`` also holds what it imported from elsewhere (``typing``,
    ``logging``, ``FSDPModule``, ``DTensor``): those are not its interface and
    are found at their own homes, so a name counts when its object is defined
    in ``torch.distributed.pipelining`` (or is one of its modules), or is a
    plain constant (``DEFAULT_CHUNK_DIM``).
    """
    import types

    names = set()
    for name in dir(module):
        if name.startswith("__"):
            continue
        value = getattr(module, name)
        if isinstance(value, (bool, int, float, str)):
            names.add(name)
            continue
        home = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
        if isinstance(home, str) and home.startswith("torch.distributed.pipelining"):
            names.add(name)
    return names


@pytest.mark.parametrize("suffix", TWINS)
def test_every_name_of_torchs_module_is_ours_or_refused_with_the_reason(suffix):
    """Replacing ``torch.distributed.pipelining`` by ``pipeline_ext.pipelining`` in an import gives the name, or
    a ``NotProvidedError`` that says why not (the module's ``_GAPS``, listed in docs/parity.md)."""
    import importlib

    from pipeline_ext._lazy import NotProvidedError

    theirs = importlib.import_module("torch.distributed.pipelining" + suffix)
    ours = importlib.import_module("pipeline_ext.pipelining" + suffix)
    gaps = getattr(ours, "_GAPS", {})
    wanted = _torchs_own_names(theirs)
    assert set(gaps) <= wanted, f"refused names torch does not have: {sorted(set(gaps) - wanted)}"
    missing = []
    for name in sorted(wanted - set(gaps)):
        try:
            getattr(ours, name)
        except AttributeError:
            missing.append(name)
    assert not missing, f"pipeline_ext.pipelining{suffix} lacks torch's {missing}"
    assert not (wanted - set(gaps)) - set(dir(ours)), "a provided name is missing from dir()"
    assert set(theirs.__all__) <= set(ours.__all__), "import * gives less than torch's"
    for name, why in gaps.items():
        with pytest.raises(NotProvidedError, match=f"does not provide {name}: ") as refused:
            exec(f"from pipeline_ext.pipelining{suffix} import {name}", {})
        assert why in str(refused.value) and name not in dir(ours)


TORCHTITAN_IMPORTS = """
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    ScheduleZBVZeroBubble, get_schedule_class, PipelineScheduleSingle, PipelineScheduleMulti, ScheduleDualPipeV,
    _PipelineSchedule, _PipelineScheduleRuntime, _Action, _PipelineContext, _wait_batch_p2p, FORWARD, FULL_BACKWARD,
    BACKWARD_INPUT, BACKWARD_WEIGHT, OVERLAP_F_B, UNSHARD, RESHARD, REDUCE_GRAD)
from torch.distributed.pipelining.stage import PipelineStage as PipelineStage2, _normalize_model_output_as_tuple
from torch.distributed.pipelining.microbatch import _split_block_mask
"""


def test_torchtitans_imports_work_with_pipeline_ext_and_mean_the_same():
    """torchtitan 0.3.0's trainer and its graph_pp experiments import these; with the import swapped they are ours
    where they are classes that run (same objects as at the top), torch's own where they are torch's action and
    context objects, which our schedules hand out (``pipeline_order``, custom functions)."""
    import torch.distributed.pipelining.microbatch as tmb
    import torch.distributed.pipelining.schedules as ts
    import torch.distributed.pipelining.stage as tst

    mine: dict = {}
    exec(TORCHTITAN_IMPORTS.replace("torch.distributed.pipelining", "pipeline_ext.pipelining"), mine)
    assert mine["PipelineStage"] is mine["PipelineStage2"] is pe.PipelineStage
    for name in ("ScheduleZBVZeroBubble", "get_schedule_class", "PipelineScheduleSingle", "PipelineScheduleMulti",
                 "ScheduleDualPipeV", "_PipelineScheduleRuntime"):
        assert mine[name] is getattr(pe, name), name
    assert mine["_PipelineSchedule"] is pe.PipelineSchedule
    assert issubclass(pe.ScheduleDualPipeV, mine["_PipelineScheduleRuntime"])
    assert issubclass(pe.ScheduleDualPipeV, ts._PipelineSchedule)  # and torch's base class, registered
    for name in ("_Action", "_PipelineContext", "_wait_batch_p2p", "FORWARD", "FULL_BACKWARD", "BACKWARD_INPUT",
                 "BACKWARD_WEIGHT", "OVERLAP_F_B", "UNSHARD", "RESHARD", "REDUCE_GRAD"):
        assert mine[name] is getattr(ts, name), name
    assert mine["_split_block_mask"] is tmb._split_block_mask
    # our stages' convention, which is torch's: a tuple or list is its entries, anything else one value
    norm = mine["_normalize_model_output_as_tuple"]
    for out in (torch.ones(2), (torch.ones(2), 3), [torch.ones(1)], None):
        assert norm(out) == tst._normalize_model_output_as_tuple(out) or all(
            a is b for a, b in zip(norm(out), tst._normalize_model_output_as_tuple(out)))
    # the orders our schedules hand out are made of the _Action and kinds torchtitan imports
    sched = pe.ScheduleDualPipeV([_StandIn(4, 2) for _ in range(2)], 4)
    kinds = {a.computation_type for acts in sched.pipeline_order.values() for a in acts}
    assert all(isinstance(a, mine["_Action"]) for acts in sched.pipeline_order.values() for a in acts)
    assert {mine["FORWARD"], mine["OVERLAP_F_B"]} <= kinds


def test_torchs_microbatch_specs_split_and_merge_here():
    from pipeline_ext.pipelining.microbatch import (DEFAULT_CHUNK_DIM, TensorChunkSpec, _CustomReducer, _Replicate,
                                                    merge_chunks, split_args_kwargs_into_chunks, sum_reducer)

    x, mask = torch.arange(8.0).reshape(4, 2), torch.ones(3)
    for replicate in (_Replicate, _Replicate()):  # torch writes the class itself; an instance works too
        args, _ = split_args_kwargs_into_chunks((x, mask), {}, 2, (TensorChunkSpec(DEFAULT_CHUNK_DIM), replicate))
        assert [a[0].shape[0] for a in args] == [2, 2] and all(a[1] is mask for a in args)
    parts = [torch.tensor(1.0), torch.tensor(2.0)]
    assert merge_chunks(parts, sum_reducer) == 3.0
    assert merge_chunks(parts, _CustomReducer(torch.tensor(0.0), max)) == 2.0
