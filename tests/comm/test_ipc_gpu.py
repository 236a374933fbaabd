"""The CUDA IPC transport on a GPU: 2 to 4 processes sharing cuda:0 (``transport="ipc"``).

``tools/gpu_check.sh`` runs these (step ``ipc_suites``) whenever a GPU is
lent; without one they are skipped. CPU runs test the transport's choice and
its handle cache (test_ipc_transport.py). What only a device shows:

- the channel itself: messages of several layouts and tags, out of order, with
  and without their layout first, an empty one; blocks recycled from the pool
  and handles opened once (the cache), a CPU tensor refused;
- pipelines on cuda:0 over it match the unsplit model (several schedules, 2
  and 4 ranks), and skip connections between processes work on GPU;
- SIGKILL of either rank mid-step: a named error on the survivor within the
  timeout, no hang, nothing in /dev/shm.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipeline_ext as pe
from models import build, loss_fn, make_batch, reference
from mp_utils import run_ranks
from test_ipc_transport import error_of
from test_shm_transport import KillAt
from pipeline_ext.runtime._ext import _C

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or not getattr(_C, "with_cuda", False),
                       reason="needs a CUDA GPU and a CUDA build of pipeline_ext._C"),
]

DEV = "cuda:0"
RTOL, ATOL = 1e-4, 1e-5


def _messages(rank: int, world: int) -> dict:
    from pipeline_ext.comm.transport import make_channel

    ch = make_channel(None, DEV, 2, "ipc", timeout=30.0)
    out = {"transport": ch.connect()}
    peer = 1 - rank
    shapes = [[(4, 8)], [(3,), (2, 5, 7)], [(1 << 20,)]]  # one tensor, two, 4 MiB (a bigger block)
    for rnd in range(20):  # enough rounds that blocks are recycled and handles found in the cache
        ch.begin_step(rnd)
        for i, shape in enumerate(shapes):
            tensors = [torch.full(s, float(rnd * 10 + i), device=DEV) for s in shape]
            tag = 10 + i
            if rank == 0:
                ch.send(tensors, peer, tag, with_layout=(i == 1))[0].wait(30.0, "send")
            elif i == 1:  # its layout first, as a discovery step receives
                words = ch.recv_layout(peer, tag).wait(30.0, "layout")[0]
                layout = _C.PackLayout.from_tensor(words)
                got = ch.recv(layout, peer, tag).wait(30.0, "recv")
                out.setdefault("bad", []).extend(
                    f"round {rnd} msg {i}" for g, t in zip(got, tensors) if not torch.equal(g, t))
            else:
                got = ch.recv(_C.layout_of(tensors), peer, tag).wait(30.0, "recv")
                out.setdefault("bad", []).extend(
                    f"round {rnd} msg {i}" for g, t in zip(got, tensors) if not torch.equal(g, t))
        # an empty message and tags received in the other order than sent
        if rank == 0:
            ch.send([torch.empty(0, device=DEV)], peer, 30)[0].wait(30.0, "send")
            ch.send([torch.ones(2, device=DEV)], peer, 31)[0].wait(30.0, "send")
            ch.send([torch.zeros(2, device=DEV)], peer, 32)[0].wait(30.0, "send")
        else:
            late = ch.recv(_C.layout_of([torch.zeros(2)]), peer, 32)
            assert torch.equal(ch.recv(_C.layout_of([torch.zeros(2)]), peer, 31).wait(30.0, "31")[0].cpu(),
                               torch.ones(2))
            assert torch.equal(late.wait(30.0, "32")[0].cpu(), torch.zeros(2))
            ch.recv(_C.layout_of([torch.empty(0)]), peer, 30).wait(30.0, "empty")
    torch.cuda.synchronize()
    c = ch._pg
    out.update(exported=c.blocks_exported, in_flight=c.blocks_in_flight, cached=c.handles_cached)
    out["cpu"] = error_of(lambda: ch.send([torch.zeros(2)], peer, 40), ValueError)
    return out


@pytest.mark.timeout(120)
def test_messages_over_ipc_are_exact_recycle_blocks_and_cache_handles():
    res = {r: v for r, (_, v) in run_ranks(_messages, 2, timeout=100).items()}
    for rank in (0, 1):
        assert res[rank]["transport"] == "ipc"
        assert not res[rank].get("bad"), res[rank]["bad"]
        assert "this channel moves cuda:0 tensors" in res[rank]["cpu"]
    # 20 rounds x 5 messages with a payload: blocks come back and are reused (at most 4 idle are kept, so a
    # round with 5 in flight may export one more), and the receiver's cache stays within its bound
    assert 1 <= res[0]["exported"] < 50, res[0]
    assert 1 <= res[1]["cached"] <= 64, res[1]


def _pipeline(rank: int, world: int, name: str) -> list[str]:
    v = pe.schedules.default_stages_per_rank(name)
    ns, m = world * v, 4
    x, y = make_batch("mlp", 8)
    ref_loss, ref_grads, _ = reference("mlp", ns, x, y)
    modules = [mod.to(DEV) for mod in build("mlp", ns)]
    placement = pe.schedules.build(name, world, m, stages_per_rank=v).stage_to_rank
    mine = [s for s, r in enumerate(placement) if r == rank]
    sched = pe.PipelineSchedule([pe.PipelineStage(modules[s], s, ns, DEV) for s in mine], name, m,
                                loss_fn=loss_fn, transport="ipc")
    bad = []
    for step in range(2):
        for mod in modules:
            mod.zero_grad()
        losses: list = []
        sched.step(*((x.to(DEV),) if 0 in mine else ()), target=y.to(DEV) if ns - 1 in mine else None, losses=losses)
        if ns - 1 in mine:
            loss = sum(losses).cpu() / m
            if not torch.allclose(loss, ref_loss, rtol=RTOL, atol=ATOL):
                bad.append(f"{name} world {world} step {step}: loss {float(loss)} != {float(ref_loss)}")
        for s in mine:
            for p, q in zip(modules[s].parameters(), ref_grads[s]):
                if p.grad is None or not torch.allclose(p.grad.cpu(), q, rtol=RTOL, atol=ATOL):
                    bad.append(f"{name} world {world} step {step}: stage {s}'s gradient differs")
    return bad


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1", "interleaved_1f1b"])
def test_pipeline_on_one_gpu_over_ipc_matches_the_unsplit_model(name, world):
    for rank, (_, bad) in run_ranks(_pipeline, world, name, timeout=240).items():
        assert bad == [], (rank, bad)


def _skips(rank: int, world: int) -> list[str]:
    from test_skip_connections import _stage_modules, batch, unet

    name, m = "1f1b", 4
    model, ref = unet().to(DEV), unet().to(DEV)
    stages = _stage_modules(model, world)
    sched = pe.PipelineSchedule(pe.PipelineStage(stages[rank], rank, world, DEV), name, m, loss_fn=F.mse_loss,
                                transport="ipc")
    x, y = (t.to(DEV) for t in batch(8))
    losses: list = []
    sched.step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None, losses=losses)
    F.mse_loss(ref(x), y).backward()
    held = {id(p) for p in stages[rank].parameters()}
    return [f"rank {rank}: a gradient differs" for p, q in zip(model.parameters(), ref.parameters())
            if id(p) in held and (p.grad is None or not torch.allclose(p.grad, q.grad, rtol=RTOL, atol=ATOL))]


@pytest.mark.timeout(120)
def test_skip_connections_between_processes_on_gpu():
    for rank, (_, bad) in run_ranks(_skips, 3, timeout=100).items():
        assert bad == [], (rank, bad)


def _killed(rank: int, world: int, victim: int) -> str:
    torch.manual_seed(0)
    modules = build("mlp", world)
    if rank == victim:
        modules[rank] = nn.Sequential(KillAt(when=7), modules[rank])
    stage = pe.PipelineStage(modules[rank].to(DEV), rank, world, DEV)
    sched = pe.PipelineSchedule(stage, "1f1b", 4, loss_fn=loss_fn, timeout=20.0, transport="ipc")
    x, y = (t.to(DEV) for t in make_batch("mlp", 8))
    try:
        for _ in range(2):
            sched.step(x) if rank == 0 else sched.step(target=y)
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.isolated
@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", [0, 1])
def test_sigkill_of_either_rank_mid_step_is_named_and_leaves_nothing(victim):
    before = set(os.listdir("/dev/shm"))
    results = run_ranks(_killed, 2, victim, timeout=90, expect_errors=True)
    assert results[victim][0] == "died", results[victim]
    status, message = results[1 - victim]
    assert status == "ok", message
    assert f"rank {victim} (pid" in message and "exited" in message, message
    assert set(os.listdir("/dev/shm")) - before == set()
