"""Multi-process API (PipelineStage + Schedule*) against the unsplit model, over Gloo.

Reference for every schedule: the unsplit model on the whole batch. Each rank
builds the same seeded model, runs its stages under the schedule, and compares
its own stages' gradients (and, on the last stage, the loss) with the reference.
Many configurations run inside one group of processes to keep spawn costs low.
"""
from __future__ import annotations

import pytest
import torch

from mp_utils import run_ranks, device_under_test
from models import ATOL, build, D, loss_fn, make_batch, reference, RTOL, run_stages, TOL

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zb_h2", "zbv", "dualpipev", "v_half", "v_min"]
MULTI_STAGE = {"interleaved_1f1b", "looped_bfs", "zbv", "dualpipev", "v_half", "v_min"}


def _expect_no_mismatches(fn, world: int, *args, timeout: float = 100) -> None:
    """Run ``fn`` on ``world`` ranks; each returns a list of mismatch descriptions, all must be empty."""
    results = run_ranks(fn, world, *args, timeout=timeout)
    bad = [b for _, (_, errs) in sorted(results.items()) for b in errs]
    assert not bad, "\n".join(bad[:20])


def _stages_per_rank(name: str) -> int:
    return 2 if name in MULTI_STAGE else 1


def _make_schedule(name: str, rank: int, world: int, m: int, modules: list, **kw):
    import pipeline_ext as pe
    from pipeline_ext import schedules as S

    v = _stages_per_rank(name)
    placement = S.build(name, world, m, stages_per_rank=v).stage_to_rank
    mine = [s for s, r in enumerate(placement) if r == rank]
    stages = [pe.PipelineStage(modules[s], s, world * v, device_under_test()) for s in mine]
    cls = pe.get_schedule_class(name)
    return cls(stages if v > 1 else stages[0], m, loss_fn=loss_fn, **kw), mine


def _step(sched, mine: list[int], num_stages: int, x, y, losses=None):
    args = (x,) if 0 in mine else ()
    target = y if num_stages - 1 in mine else None
    return sched.step(*args, target=target, losses=losses)


def _check_step(rank: int, world: int, name: str, model: str, m: int, n: int) -> list[str]:
    """One training step under schedule ``name``; returns mismatches (empty if all equal)."""
    v = _stages_per_rank(name)
    ns = world * v
    x, y = make_batch(model, n)
    ref_loss, ref_grads, _ = reference(model, ns, x, y)
    modules = build(model, ns)
    sched, mine = _make_schedule(name, rank, world, m, modules)
    losses: list[torch.Tensor] = []
    out = _step(sched, mine, ns, x, y, losses)
    where = f"{name} p={world} m={m} n={n} {model} rank {rank}"
    bad = []
    if ns - 1 in mine:
        sizes = [len(c) for c in torch.tensor_split(torch.arange(n), m)]
        loss = sum(l * s / n for l, s in zip(losses, sizes))
        if len(losses) != m or not torch.allclose(loss, ref_loss, rtol=RTOL, atol=ATOL):
            bad.append(f"{where}: loss {loss} vs {ref_loss} ({len(losses)} losses)")
        ref_out = run_stages(build(model, ns), x)
        if not torch.allclose(out, ref_out, rtol=RTOL, atol=ATOL):
            bad.append(f"{where}: merged output differs")
    return bad + _grad_mismatches(modules, mine, ref_grads, where)


def _grad_mismatches(modules, mine: list[int], ref_grads, where: str) -> list[str]:
    bad = []
    for s in mine:
        for i, (p, g) in enumerate(zip(modules[s].parameters(), ref_grads[s])):
            if p.grad is None or not torch.allclose(p.grad, g, rtol=RTOL, atol=ATOL):
                err = "missing" if p.grad is None else f"max err {(p.grad - g).abs().max():.3g}"
                bad.append(f"{where}: stage {s} param {i} grad {err}")
    return bad


def _matrix(rank: int, world: int, model: str) -> tuple[int, list[str]]:
    from pipeline_ext.schedules import ScheduleError, build as build_schedule

    ran, bad = 0, []
    for name in SCHEDULES:
        # fewer microbatches than ranks too, where a schedule allows it (GPipe, ZB-V, as in torch)
        for m, n in ((world - 1, 4 * world), (world, 4 * world), (2 * world, 8 * world), (2 * world, 8 * world + 3)):
            try:
                build_schedule(name, world, m, stages_per_rank=_stages_per_rank(name))
            except ScheduleError:
                continue  # this schedule does not allow this m
            bad += _check_step(rank, world, name, model, m, n)
            ran += 1
    return ran, bad


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model", ["mlp", "blocks", "tuple"])
@pytest.mark.usefixtures("rank_device")
def test_every_schedule_matches_unsplit_model(world, model):
    results = run_ranks(_matrix, world, model, timeout=200)
    ran = {r: v[1][0] for r, v in results.items()}
    bad = [b for _, (_, (_, errs)) in sorted(results.items()) for b in errs]
    assert not bad, "\n".join(bad[:20])
    # every schedule ran at least its m=2p cases on every rank
    assert all(n >= 2 * len(SCHEDULES) for n in ran.values()), ran


def _optimizer_steps(rank: int, world: int, name: str) -> list[str]:
    v = _stages_per_rank(name)
    ns = world * v
    modules, ref = build("blocks", ns), build("blocks", ns)
    m = 2 * world
    sched, mine = _make_schedule(name, rank, world, m, modules)
    # SGD with momentum, not Adam: Adam divides by sqrt(v), which turns the ~1e-9 rounding noise
    # of exactly-zero gradients (attention's key bias) into full-size steps in either run.
    opt = torch.optim.SGD([p for s in mine for p in modules[s].parameters()], lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD([p for s in ref for p in s.parameters()], lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = make_batch("blocks", 4 * m + 1, seed=step)
        opt.zero_grad()
        _step(sched, mine, ns, x, y)
        opt.step()
        ref_opt.zero_grad()
        loss_fn(run_stages(ref, x), y).backward()
        ref_opt.step()
    return [
        f"{name} rank {rank} stage {s} param {i} differs after 3 steps"
        for s in mine
        for i, (p, q) in enumerate(zip(modules[s].parameters(), ref[s].parameters()))
        if not torch.allclose(p, q, **TOL)
    ]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["1f1b", "zb_h1", "interleaved_1f1b", "v_half", "v_min"])
@pytest.mark.usefixtures("rank_device")
def test_three_optimizer_steps_match(name):
    _expect_no_mismatches(_optimizer_steps, 2, name)


def _shape_changes(rank: int, world: int) -> list[str]:
    """Same schedule object, new batch size, new sequence length, then back."""
    modules = build("blocks", world)
    sched, mine = _make_schedule("1f1b", rank, world, 4, modules)
    bad = []
    for n, seq in ((8, 3), (11, 3), (8, 5), (8, 3)):
        g = torch.Generator().manual_seed(10 * n + seq)
        x, y = (t.to(device_under_test()) for t in (torch.randn(n, seq, D, generator=g), torch.randn(n, 4, generator=g)))
        _, ref_grads, _ = reference("blocks", world, x, y)
        for mod in modules:
            mod.zero_grad()
        _step(sched, mine, world, x, y)
        bad += _grad_mismatches(modules, mine, ref_grads, f"n={n} seq={seq} rank {rank}")
    return bad


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.usefixtures("stage_device")
def test_step_with_new_batch_size_and_sequence_length():
    _expect_no_mismatches(_shape_changes, 2)


def _eval_and_kwargs(rank: int, world: int) -> list[str]:
    import pipeline_ext as pe
    from torch import nn

    bad = []
    modules = build("mlp", world)
    sched, mine = _make_schedule("1f1b", rank, world, 4, modules)
    x, _ = make_batch("mlp", 10)
    out = sched.eval(x) if 0 in mine else sched.eval()
    if world - 1 in mine and not torch.allclose(out, run_stages(build("mlp", world), x)):
        bad.append("eval output differs")
    if any(p.grad is not None for s in mine for p in modules[s].parameters()):
        bad.append("eval produced gradients")

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, *, scale):
            return self.lin(x) * scale

    torch.manual_seed(0)
    first, last = Scaled(), nn.Linear(4, 2)
    stage = pe.PipelineStage(first if rank == 0 else last, rank, 2, "cpu")
    sched = pe.ScheduleGPipe(stage, 3, loss_fn=loss_fn)
    x, y, scale = torch.randn(7, 4), torch.randn(7, 2), torch.randn(7, 1)
    if rank == 0:
        sched.step(x, scale=scale)
    else:
        sched.step(target=y)
    torch.manual_seed(0)
    rf, rl = Scaled(), nn.Linear(4, 2)
    loss_fn(rl(rf(x, scale=scale)), y).backward()
    mod, ref = (first, rf) if rank == 0 else (last, rl)
    if not all(torch.allclose(p.grad, q.grad, rtol=RTOL, atol=ATOL) for p, q in zip(mod.parameters(), ref.parameters())):
        bad.append("kwargs on the first stage: gradients differ")
    return bad


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_eval_and_first_stage_kwargs():
    _expect_no_mismatches(_eval_and_kwargs, 2)


def _torch_style_script(rank: int, world: int, pipelining) -> tuple[list[float], list[torch.Tensor]]:
    """A training step written for torch.distributed.pipelining's manual API.

    Only the module passed as ``pipelining`` changes between the two runs:
    ``torch.distributed.pipelining`` or ``pipeline_ext``.
    """
    from torch import nn

    torch.manual_seed(0)
    full = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(2 * world)])
    chunk = nn.Sequential(*list(full.children())[2 * rank : 2 * rank + 2])
    stage = pipelining.PipelineStage(chunk, rank, world, torch.device("cpu"))
    schedule = pipelining.Schedule1F1B(stage, n_microbatches=4, loss_fn=nn.functional.mse_loss)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    losses: list[torch.Tensor] = []
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)
    return [float(l) for l in losses], [p.grad.clone() for p in chunk.parameters()]


def _drop_in(rank: int, world: int) -> list[str]:
    import torch.distributed.pipelining as torch_pipelining

    import pipeline_ext

    theirs = _torch_style_script(rank, world, torch_pipelining)
    ours = _torch_style_script(rank, world, pipeline_ext)
    bad = []
    if len(ours[0]) != len(theirs[0]) or not torch.allclose(torch.tensor(ours[0]), torch.tensor(theirs[0]), rtol=RTOL):
        bad.append(f"rank {rank} losses: ours {ours[0]} torch {theirs[0]}")
    for i, (a, b) in enumerate(zip(ours[1], theirs[1])):
        if not torch.allclose(a, b, rtol=RTOL, atol=ATOL):
            bad.append(f"rank {rank} param {i}: max err {(a - b).abs().max():.3g}")
    return bad


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_torch_pipelining_script_runs_unchanged_and_matches():
    _expect_no_mismatches(_drop_in, 2)


def _eval_then_step(rank: int, world: int, model: str) -> list[str]:
    """A validate-then-train loop: eval, step, eval, step, with the same shapes and then new ones."""
    bad = []
    for name in SCHEDULES:
        v = _stages_per_rank(name)
        ns, m = world * v, 2 * world
        modules, ref = build(model, ns), build(model, ns)
        sched, mine = _make_schedule(name, rank, world, m, modules)
        for i, n in enumerate((8 * world, 8 * world, 8 * world + 3, 8 * world + 3)):
            x, y = make_batch(model, n, seed=i)
            where = f"{name} {model} rank {rank} round {i} n={n}"
            out = sched.eval(*((x,) if 0 in mine else ()))
            if ns - 1 in mine:
                with torch.no_grad():
                    expected = run_stages(ref, x)
                if not torch.allclose(out, expected, rtol=RTOL, atol=ATOL):
                    bad.append(f"{where}: eval output differs")
            _step(sched, mine, ns, x, y)
            loss_fn(run_stages(ref, x), y).backward()
        bad += _grad_mismatches(modules, mine, [[p.grad for p in r.parameters()] for r in ref], f"{name} rank {rank}")
    return bad


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.usefixtures("rank_device")
def test_eval_then_step_every_schedule():
    """eval() and step() with one batch shape are different plans: neither may reuse the other's layouts."""
    _expect_no_mismatches(_eval_then_step, 2, "blocks", timeout=150)
