"""Pipeline x tensor parallel: a DTensor the next stage cannot take is refused by its sender, before it moves.

4 Gloo CPU ranks, mesh (pp=2, tp=2), the blocks of tests/test_tensor_parallel.py.
Stage 0 returns a Replicate DTensor on its ("tp",) mesh of shape (2,); stage 1
cannot take it (no mesh of those dim names and shape, or its ``input_args``
declares a plain tensor or other placements). Every stage's receiving side is
known to its sender (exchanged once per schedule), so stage 0 raises after its
forward and before its message is sent; every rank raises naming the stage,
the input and both sides, and no activation message is sent on any rank.
See [Note: DTensors between stages] in pipeline_ext/runtime/dtensor_wire.py.
"""
from __future__ import annotations

import pytest
import torch

from mp_utils import no_complaints, run_ranks
from test_tensor_parallel import D, M, ROWS, SEQ, Stage, _fresh_dtensor_caches, _loss, _parallelize

_BEFORE = "refused on stage 0, before this activation was sent"


def _refused(rank: int, world: int, kind: str, timeout: float = 60.0) -> tuple[str, int]:
    """What this rank raised in the step, and how many messages it sent in it."""
    import pipeline_ext as pe
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

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
    elif kind == "declared_plain":  # a plain tensor declared where a Replicate DTensor arrives
        module, extra = _parallelize(Stage(), 1, 2, "replicate", tp), {"input_args": torch.empty(ROWS // M, SEQ, D)}
    else:  # other placements declared: sequence parallel's Shard(1) where a Replicate DTensor arrives
        declared = DTensor.from_local(torch.empty(ROWS // M, SEQ // 2, D), tp, [Shard(1)], run_check=False)
        module, extra = _parallelize(Stage(), 1, 2, "replicate", tp), {"input_args": declared}
    stage = pe.PipelineStage(module, index, 2, "cpu", group=pp, **extra)
    sched = pe.Schedule1F1B(stage, M, loss_fn=_loss, timeout=timeout)
    channel = sched._session.channel
    sent = []
    send = channel.send
    channel.send = lambda *a, **k: (sent.append(a[1:3]), send(*a, **k))[1]  # (peer, tag) of every message
    x, y = torch.randn(ROWS, SEQ, D), torch.randn(ROWS, SEQ, D)
    try:
        sched.step(x) if index == 0 else sched.step(target=y)
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return f"{type(exc).__name__}: {exc}", len(sent)
    return "no error", len(sent)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["mesh_shape", "declared_plain", "declared_placements"])
def test_a_dtensor_the_receiver_cannot_take_is_refused_by_its_sender_before_it_moves(kind):
    said = {r: v for r, (_, v) in run_ranks(_refused, 4, kind, timeout=240).items()}
    got = "(Replicate(),) on mesh ('tp',) of shape (2,)"
    want = {
        "mesh_shape": "stage 1's input 0, microbatch 0 is a DTensor from stage 0 on mesh ('tp',) of shape (2,) with "
                      "placements (Replicate(),), but stage 1 has no such mesh (its meshes: mesh ('tp',) of shape (1,))",
        "declared_plain": f"stage 1, microbatch 0: input 0 is a DTensor with placements {got}, input_args has a "
                          "plain tensor",
        "declared_placements": f"stage 1, microbatch 0: input 0 is a DTensor with placements {got}, input_args has a "
                               "DTensor with placements (Shard(dim=1),) on mesh ('tp',) of shape (2,)",
    }[kind]
    for r in range(4):
        text, sends = said[r]
        assert want in text and _BEFORE in text, f"rank {r}: {text}"
        assert sends == 0, f"rank {r} sent {sends} messages in the refused step: {text}"
    for r in (2, 3):  # the receivers were told by their sender (stage 0 on ranks 0 and 1)
        assert "failed on rank" in said[r][0], f"rank {r}: {said[r][0]}"


@pytest.mark.isolated  # fresh ranks: Gloo closes a group whose wait timed out
@pytest.mark.timeout(300)
def test_over_gloo_the_sender_refuses_and_the_receivers_wait_ends_naming_the_message(monkeypatch):
    """A process group's posted receive cannot be woken: the receivers' wait for the activation that was never
    sent ends at their timeout (or when the sender's connection closes), naming that message."""
    from pipeline_ext.comm.transport import TRANSPORT_ENV

    monkeypatch.setenv(TRANSPORT_ENV, "process_group")
    said = {r: v for r, (_, v) in run_ranks(_refused, 4, "mesh_shape", 5.0, timeout=240).items()}
    for r in range(4):
        text, sends = said[r]
        assert sends == 0, f"rank {r} sent {sends} messages in the refused step: {text}"
        if r < 2:
            assert "but stage 1 has no such mesh" in text and _BEFORE in text, f"rank {r}: {text}"
        else:
            assert "RECV_F of stage 1 microbatch 0 with peer rank 0" in text, f"rank {r}: {text}"


def _checked_once_per_layout(rank: int, world: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from pipeline_ext.runtime import dtensor_wire as W

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    asked, checks = [], []
    ns = W.NextStage(1, lambda: asked.append(1) or W.receiving_side(1, W.MeshFinder(None, mesh), None))
    check = ns.check
    ns.check = lambda *a: (checks.append(a[2]), check(*a))[1]
    bad: list[str] = []
    for mb in range(3):
        W.to_wire([DTensor.from_local(torch.ones(2, 4), mesh, [Replicate()], run_check=False)], 0, mb, ns)
    if (len(asked), checks) != (1, [0]):
        bad.append(f"a known layout was checked again: side asked {len(asked)} times, checks for microbatches {checks}")
    W.to_wire([DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)], run_check=False)], 0, 3, ns)
    if checks != [0, 3]:
        bad.append(f"a new placement was not checked: checks for microbatches {checks}")
    elsewhere = W.NextStage(1, lambda: W.receiving_side(1, None, None))  # a receiver without any mesh
    try:
        W.to_wire([DTensor.from_local(torch.ones(2, 4), mesh, [Replicate()], run_check=False)], 0, 0, elsewhere)
        bad.append("a DTensor for a receiver without its mesh was not refused")
    except TypeError as exc:
        if "but stage 1 has no such mesh (its meshes: none (no DTensor parameter, no mesh= given))" not in str(exc):
            bad.append(f"unexpected refusal: {exc}")
    return bad


@pytest.mark.timeout(120)
def test_a_layout_is_checked_against_its_receiver_once_and_a_new_one_again():
    """The sender's check runs where a layout is encoded for the first time: a known step pays nothing."""
    no_complaints(_checked_once_per_layout, 1, timeout=100)
