"""Every CUDA path against the unsplit model, on a real GPU (skipped cleanly without one).

``tools/gpu_check.sh`` runs these (``pytest -m cuda``) whenever a GPU is lent.
They cover what CPU runs cannot: ``Pipe`` on ``cuda:0`` under every schedule,
checkpoint mode and autocast bf16; stages split between the GPU and the CPU,
so activations and gradients cross devices on the copy streams; dropout
recomputed exactly when two worker threads share one GPU's generator; no
host-device synchronisation inside a step; and the multi-process channel on a
CUDA device (what NCCL runs), over a loopback process group because NCCL
refuses two ranks on one GPU.
"""
from __future__ import annotations

import datetime
import time

import pytest
import torch
from torch import nn

import pipeline_ext as pe
from loopback_pg import Loopback
from models import build, loss_fn, make_batch, unsplit
from pipeline_ext.pipe.recompute import CHECKPOINT_MODES
from pipeline_ext.comm.transport import DistChannel
from pipeline_ext.comm.comm_plan import PlanCache, StepMessages

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(300),
]

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zb_h2", "zbv", "dualpipev"]
P, M, N = 2, 4, 18  # ranks, microbatches, rows (18 rows into 4 microbatches: uneven)
#: (rtol, atol): fp32 differs from the unsplit model only by summation order;
#: under bf16 autocast every matmul output is rounded to 8 bits of mantissa.
TOLERANCE = {"fp32": (1e-4, 1e-5), "bf16": (3e-2, 3e-3)}


def _stages(name: str, model: str = "blocks") -> list[nn.Module]:
    v = 2 if name in pe.pipe.MULTI_STAGE_SCHEDULES else 1
    return build(model, P * v)


def _autocast(precision: str):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16")


def _reference(stages: list[nn.Module], x: torch.Tensor, y: torch.Tensor, device: str, precision: str):
    """Loss and gradients of the unsplit model on the whole batch, on ``device``, under the run's autocast."""
    return unsplit(stages, x, y, device=device, autocast=lambda: _autocast(precision))


def _assert_matches(loss, params, ref_loss, ref_grads, tol, where):
    rtol, atol = tol
    torch.testing.assert_close(loss.float().cpu(), ref_loss.float().cpu(), rtol=rtol, atol=atol, msg=where)
    for i, (p, g) in enumerate(zip(params, ref_grads)):
        torch.testing.assert_close(p.grad.cpu(), g.cpu(), rtol=rtol, atol=atol, msg=f"{where}: parameter {i}")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpoint", CHECKPOINT_MODES)
@pytest.mark.parametrize("name", SCHEDULES)
def test_pipe_on_one_gpu_matches_unsplit(name, checkpoint, precision):
    stages = _stages(name)
    x, y = make_batch("blocks", N)
    ref_loss, ref_grads = _reference(stages, x, y, "cuda:0", precision)
    pipe = pe.Pipe(nn.Sequential(*stages), balance=[1] * len(stages), devices=["cuda:0"] * P, chunks=M,
                   schedule=name, checkpoint=checkpoint)
    with _autocast(precision):
        loss = pipe.step(x, target=y, loss_fn=loss_fn)
    assert loss.device.type == "cuda"
    _assert_matches(loss, list(pipe.parameters()), ref_loss, ref_grads, TOLERANCE[precision],
                    f"{name} checkpoint={checkpoint} {precision}")


@pytest.mark.parametrize("name", SCHEDULES)
def test_stages_split_between_gpu_and_cpu(name):
    """Activations go GPU->CPU->GPU on the copy streams, gradients back the same way."""
    stages = _stages(name, "tuple")
    x, y = make_batch("tuple", N)
    ref_loss, ref_grads = _reference(stages, x, y, "cpu", "fp32")
    pipe = pe.Pipe(nn.Sequential(*stages), balance=[1] * len(stages), devices=["cuda:0", "cpu"], chunks=M,
                   schedule=name, unpack_tuples=True)  # the "tuple" model's stages take a tuple as arguments
    loss = pipe.step(x, target=y, loss_fn=loss_fn)
    _assert_matches(loss, list(pipe.parameters()), ref_loss, ref_grads, TOLERANCE["fp32"], name)


@pytest.mark.parametrize("devices", [["cuda:0", "cpu"], ["cpu", "cuda:0"], ["cuda:0", "cuda:0"]])
def test_connected_forward_across_devices(devices):
    """``pipe(x)`` then ``loss.backward()``: Reattach copies gradients back across devices."""
    stages = build("blocks", 2)
    x, y = make_batch("blocks", N)
    ref_loss, ref_grads = _reference(stages, x, y, "cpu", "fp32")
    pipe = pe.Pipe(nn.Sequential(*stages), balance=[1, 1], devices=devices, chunks=M)
    out = pipe(x)
    assert out.device == torch.device(devices[-1])
    loss = loss_fn(out, y.to(out.device))
    loss.backward()
    _assert_matches(loss, list(pipe.parameters()), ref_loss, ref_grads, TOLERANCE["fp32"], str(devices))


class Noisy(nn.Module):
    """A linear layer followed by dropout, so recomputation must redraw the same mask."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(torch.tanh(self.lin(x)), p=0.5, training=True)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1", "zbv"])
def test_dropout_recomputation_exact_when_stages_share_a_gpu(name):
    """Two worker threads on cuda:0 share its generator: every checkpoint mode must agree."""
    v = 2 if name in pe.pipe.MULTI_STAGE_SCHEDULES else 1
    grads = {}
    for mode in CHECKPOINT_MODES:
        torch.manual_seed(0)
        model = nn.Sequential(*[Noisy() for _ in range(P * v)])
        pipe = pe.Pipe(model, balance=[1] * (P * v), devices=["cuda:0"] * P, chunks=M, schedule=name,
                       checkpoint=mode, deterministic=True)
        x = torch.randn(N, 16)
        torch.manual_seed(1)
        pipe.step(x, target=torch.zeros(N, 16), loss_fn=loss_fn)
        grads[mode] = [p.grad.clone() for p in pipe.parameters()]
    for mode in ("always", "except_last"):
        for a, b in zip(grads[mode], grads["never"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{name}: checkpoint={mode} vs never")


@pytest.fixture
def no_host_sync():
    """Any host-device synchronisation inside the block raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("name", SCHEDULES)
def test_pipe_step_never_synchronises_the_host(name, no_host_sync):
    torch.cuda.set_sync_debug_mode("default")
    stages = _stages(name)
    pipe = pe.Pipe(nn.Sequential(*stages), balance=[1] * len(stages), devices=["cuda:0"] * P, chunks=M,
                   schedule=name, checkpoint="except_last")
    x, y = make_batch("blocks", N)
    x, y = x.cuda(), y.cuda()
    pipe.step(x, target=y, loss_fn=loss_fn)  # warm-up: lazy CUDA init, cuBLAS handles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    loss = pipe.step(x, target=y, loss_fn=loss_fn)
    torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item()


# -- the multi-process channel on a CUDA device (the NCCL path) --------------------------------
def _exchange(messages: StepMessages, step: int) -> list[torch.Tensor]:
    sent = [torch.full((4, 8), float(step), device="cuda"), torch.arange(5, device="cuda") + step]
    send = messages.send(sent, 1, 0)
    got = messages.recv(1, 0).wait(10.0, "recv")
    send.wait(10.0, "send")
    return sent, got


def test_dist_channel_on_cuda_never_synchronises_known_steps(no_host_sync):
    torch.cuda.set_sync_debug_mode("default")
    pg = Loopback()
    channel, plans = DistChannel(pg, "cuda:0", num_stages=2), PlanCache()
    messages = plans.step(channel, [7])
    assert not messages.known  # discovery: layouts are read on the host once
    _exchange(messages, 0)
    plans.commit(messages)
    pg.waits.clear()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    for step in range(1, 4):
        messages = plans.step(channel, [7])
        assert messages.known
        sent, got = _exchange(messages, step)
        plans.commit(messages)
    torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(sent, got):
        assert b.device.type == "cuda" and torch.equal(a, b)
    # Device-side waits only: a timeout would make WorkNCCL::wait spin the host.
    assert pg.waits and all(t == datetime.timedelta(0) for t in pg.waits)


def test_dist_channel_on_cuda_sends_and_receives_on_its_own_streams():
    """Sends and receives are issued on the channel's two streams, never the compute stream, so a
    receive posted while compute is busy does not queue behind it (NCCL fences its stream with the
    current one); the consumer's stream waits for the data when it takes it."""
    pg = Loopback()
    channel = DistChannel(pg, "cuda:0", num_stages=2)
    compute = torch.cuda.current_stream()
    produced = torch.arange(1024, dtype=torch.float32, device="cuda") * 2  # on the compute stream
    send, layout = channel.send([produced], 1, 0)
    torch.cuda._sleep(2_000_000_000)  # the compute stream is busy for about a second
    recv = channel.recv(layout, 1, 0)
    send_stream, recv_stream = pg.streams
    assert compute not in (send_stream, recv_stream) and send_stream != recv_stream
    deadline = time.monotonic() + 0.5
    while not recv_stream.query() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert recv_stream.query() and not compute.query(), "the receive waited for the compute stream"
    got = recv.wait(10.0, "recv")[0]
    send.wait(10.0, "send")
    assert torch.equal(got, produced)  # read on the compute stream, after the receive's copy
