"""ShmChannel over 2 spawned ranks: any receive order, growing messages, many messages in flight
both ways (a full ring drains instead of deadlocking), timeouts that name what was awaited, no files
left in /dev/shm; and the front door's transport choice."""
from __future__ import annotations

import glob

import pytest
import torch

from mp_utils import run_ranks
from models import build, loss_fn, make_batch, reference

pytestmark = pytest.mark.skipif(
    not __import__("pipeline_ext.runtime.shm_channel", fromlist=["supported"]).supported(torch.device("cpu")),
    reason="shared-memory channel needs x86-64 Linux",
)


def _messages(rank: int, world: int) -> list[str]:
    from pipeline_ext.runtime.channels import ChannelTimeout
    from pipeline_ext.runtime.shm_channel import SLOTS, ShmChannel

    ch = ShmChannel.create()
    assert ch is not None
    peer = 1 - rank
    bad = []

    def payload(tag: int) -> list[torch.Tensor]:
        n = 4 ** (tag % 6)  # up to 4 KiB floats: slots must grow
        return [torch.full((n,), float(tag)), torch.tensor(tag), torch.empty(0, 3), torch.arange(tag, dtype=torch.int32)]

    # every rank sends 3 * SLOTS messages before receiving any: rings fill, senders drain
    tags = list(range(3 * SLOTS))
    for t in tags:
        ch.send(payload(t), peer, t)
    for t in reversed(tags):  # the opposite order to sending
        got = ch.recv(peer, t).wait(30.0, f"tag {t}")
        want = payload(t)
        if len(got) != len(want) or not all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want)):
            bad.append(f"rank {rank}: tag {t} arrived wrong")
    try:
        ch.recv(peer, 999).wait(0.3, "the message that never comes")
        bad.append("no timeout")
    except ChannelTimeout as exc:
        if "the message that never comes" not in str(exc):
            bad.append(f"timeout message does not say what: {exc}")
    import torch.distributed as dist

    dist.barrier()
    left = glob.glob(ch.prefix + "*")
    if left:
        bad.append(f"files left: {left}")
    return bad


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_shm_channel_messages():
    results = run_ranks(_messages, 2, timeout=100)
    bad = [b for _, (_, errs) in results.items() for b in errs]
    assert not bad, "\n".join(bad)


def _transports(rank: int, world: int) -> list[str]:
    import pipeline_ext as pe
    from pipeline_ext.runtime.channels import DistChannel
    from pipeline_ext.runtime.shm_channel import ShmChannel

    bad = []
    x, y = make_batch("mlp", 8)
    _, ref_grads, _ = reference("mlp", world, x, y)
    for transport, cls in (("auto", ShmChannel), ("shm", ShmChannel), ("process_group", DistChannel)):
        modules = build("mlp", world)
        stage = pe.PipelineStage(modules[rank], rank, world, "cpu")
        sched = pe.Schedule1F1B(stage, 4, loss_fn=loss_fn, transport=transport)
        if not isinstance(sched._channel, cls):
            bad.append(f"{transport}: got {type(sched._channel).__name__}")
        for _ in range(2):  # the second step runs on known shapes
            for p in modules[rank].parameters():
                p.grad = None
            sched.step(x) if rank == 0 else sched.step(target=y)
        for p, g in zip(modules[rank].parameters(), ref_grads[rank]):
            if not torch.allclose(p.grad, g, rtol=1e-5, atol=1e-6):
                bad.append(f"{transport}: rank {rank} gradient differs")
    try:
        pe.Schedule1F1B(pe.PipelineStage(build("mlp", world)[rank], rank, world, "cpu"), 4, transport="carrier pigeon")
        bad.append("unknown transport accepted")
    except ValueError:
        pass
    return bad


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_transport_choice_and_both_transports_match_the_unsplit_model():
    results = run_ranks(_transports, 2, timeout=100)
    bad = [b for _, (_, errs) in results.items() for b in errs]
    assert not bad, "\n".join(bad)
