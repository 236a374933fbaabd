"""Pipe's silent wrong answers of issue 13, each in the user's loop against the unsplit nn.Sequential.

Randomness is compared with the unsplit model by replay: the ``Noisy`` layer
draws its mask with ``torch.rand`` (functional randomness, no nn.Dropout for
the pipe to notice) and records the masks of each real forward (not of
recomputations); the reference runs the unsplit model on the whole batch with
those masks. Gradients from recomputation with other masks would differ.
"""
from __future__ import annotations

import _thread
import sys
import threading

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import pipeline_ext as pe
from pipeline_ext import schedules as S
from pipeline_ext.pipe.recompute import CallRng, is_recomputing
from models import ATOL, RTOL, sac_context, unsplit



class Noisy(nn.Module):
    """Linear, then a random mask drawn inside forward; records (or replays) its masks."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.masks: list[torch.Tensor] = []
        self.replay: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.replay:
            mask = self.replay.pop(0)
        else:
            mask = (torch.rand_like(h) > 0.5).to(h.dtype) * 2.0
            if not is_recomputing():
                self.masks.append(mask)
        return torch.nn.functional.dropout(h * mask, p=0.0)


def _noisy(n: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Noisy() for _ in range(n)])


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _replayed_reference(model: nn.Sequential, xs: list[torch.Tensor], masks: list[list[torch.Tensor]]):
    """Outputs and grads of the unsplit model on each whole batch, with the pipe's masks (per call)."""
    ref = _noisy(len(model))
    outs = []
    for call, x in enumerate(xs):
        for layer, layer_masks in zip(ref, masks):
            layer.replay = [torch.cat(layer_masks[call])]
        outs.append(ref(x))
    sum(o.sum() for o in outs).backward()
    return [o.detach() for o in outs], _grads(ref)


def _masks_per_call(model: nn.Sequential, calls: int, chunks: int) -> list[list[list[torch.Tensor]]]:
    return [[layer.masks[c * chunks : (c + 1) * chunks] for c in range(calls)] for layer in model]


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_functional_randomness_under_checkpointing_matches_unsplit_model(checkpoint):
    model = _noisy()
    pipe = pe.Pipe(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=4, checkpoint=checkpoint)
    x = torch.randn(12, 8)
    out = pipe(x)
    out.sum().backward()
    ref_out, ref_grads = _replayed_reference(model, [x], _masks_per_call(model, 1, 4))
    torch.testing.assert_close(out, ref_out[0], rtol=RTOL, atol=ATOL)
    for a, b in zip(_grads(model), ref_grads):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_functional_randomness_in_step_matches_unsplit_model(schedule):
    model = _noisy()
    pipe = pe.Pipe(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=4, schedule=schedule, checkpoint="always")
    x, y = torch.randn(12, 8), torch.randn(12, 8)
    loss = pipe.step(x, target=y, loss_fn=lambda out, t: (out * t).sum())
    masks = _masks_per_call(model, 1, 4)
    ref = _noisy()
    for layer, m in zip(ref, masks):
        layer.replay = [torch.cat(m[0])]
    ref_loss = (ref(x) * y).sum()
    ref_loss.backward()
    # the step's loss is the microbatch-weighted mean of sum losses: a quarter of the whole batch's sum
    torch.testing.assert_close(loss * 4, ref_loss.detach(), rtol=RTOL, atol=1e-4)
    for a, b in zip(_grads(model), _grads(ref)):
        torch.testing.assert_close(a * 4, b, rtol=RTOL, atol=1e-4)


def test_two_calls_before_one_backward_keep_their_own_seeds():
    model = _noisy()
    pipe = pe.Pipe(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=3, checkpoint="always")
    x1, x2 = torch.randn(6, 8), torch.randn(6, 8)
    out1, out2 = pipe(x1), pipe(x2)
    (out1.sum() + out2.sum()).backward()
    ref_outs, ref_grads = _replayed_reference(model, [x1, x2], _masks_per_call(model, 2, 3))
    torch.testing.assert_close(out1, ref_outs[0], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(out2, ref_outs[1], rtol=RTOL, atol=ATOL)
    for a, b in zip(_grads(model), ref_grads):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


# -- a module that appears twice ------------------------------------------------------------------
def _twice():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    return nn.Sequential(block, block, nn.Linear(8, 2))


@pytest.mark.parametrize("balance", [[2, 1], [1, 2]])
def test_module_used_twice_is_applied_twice(balance):
    model, ref = _twice(), _twice()
    pipe = pe.Pipe(model, balance=balance, devices=["cpu", "cpu"], chunks=2)
    x, y = torch.randn(6, 8), torch.randn(6, 2)
    torch.testing.assert_close(pipe(x), ref(x), rtol=RTOL, atol=ATOL)
    loss = pipe.step(x, target=y, loss_fn=nn.functional.mse_loss)
    ref_loss = nn.functional.mse_loss(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
    for a, b in zip(_grads(model), _grads(ref)):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    assert len(pipe) == 3 and pipe[0] is pipe[1] is model[0]


def test_module_shared_by_stages_on_different_devices_is_refused():
    block = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="layer '1' is also used by layer '0'.*different devices"):
        pe.Pipe(nn.Sequential(block, block), balance=[1, 1], devices=["cpu", "meta"])
    tied = nn.Linear(4, 4)
    other = nn.Linear(4, 4)
    other.weight = tied.weight
    with pytest.raises(ValueError, match="a parameter of layer '1'"):
        pe.Pipe(nn.Sequential(tied, other), balance=[1, 1], devices=["cpu", "meta"])


# -- a step cancelled by Ctrl-C leaves nothing behind ----------------------------------------------
def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)], nn.Linear(8, 2))


class Interrupt(nn.Module):
    """Raises KeyboardInterrupt (here, or in the main thread) on its ``at``-th forward; a no-op otherwise."""

    def __init__(self, at: int, main_thread: bool) -> None:
        super().__init__()
        self.at, self.main_thread, self.calls = at, main_thread, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            if not self.main_thread:
                raise KeyboardInterrupt
            _thread.interrupt_main()  # what Ctrl-C does to the caller of step()
        return x


@pytest.mark.usefixtures("sigint_raises")
@pytest.mark.parametrize("main_thread", [False, True])
@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_ctrl_c_cancels_the_step_and_a_retry_equals_the_unsplit_model(main_thread, schedule):
    model = _mlp()
    layers = list(model)
    # the interrupt fires in the last stage's forward of microbatch 3, after backwards already ran
    seq = nn.Sequential(*layers[:2], Interrupt(4, main_thread), *layers[2:])
    pipe = pe.Pipe(seq, balance=[2, 3], devices=["cpu", "cpu"], chunks=6, schedule=schedule)
    x, y = torch.randn(12, 8), torch.randn(12, 2)
    with pytest.raises(KeyboardInterrupt) as info:
        pipe.step(x, target=y, loss_fn=nn.functional.mse_loss)
    assert not [t for t in threading.enumerate() if t.name.startswith("pipe-worker")]  # every worker stopped
    assert all(p.grad is None for p in model.parameters())  # partial gradients discarded...
    assert any("partial gradients were discarded" in n for n in getattr(info.value, "__notes__", []))  # ...and said
    pipe.zero_grad()
    pipe.step(x, target=y, loss_fn=nn.functional.mse_loss)
    for a, b in zip(_grads(model), unsplit([_mlp()], x, y)[1]):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_failure_before_any_backward_keeps_accumulated_gradients():
    model = _mlp()
    seq = nn.Sequential(Interrupt(1, False), *model)
    pipe = pe.Pipe(seq, balance=[2, 3], devices=["cpu", "cpu"], chunks=2)
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(KeyboardInterrupt):
        pipe.step(x, target=y, loss_fn=nn.functional.mse_loss)
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in model.parameters())


# -- the user's own torch.utils.checkpoint inside a stage, with dropout ------------------------------
class UserCheckpointed(nn.Module):
    """A Linear, then a residual region with dropout under the user's own ``torch.utils.checkpoint``."""

    def __init__(self, kind: str, d: int = 8) -> None:
        super().__init__()
        self.kind = kind
        self.pre, self.a, self.b, self.drop = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d), nn.Dropout(0.5)

    def region(self, h: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.tanh(self.a(h))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        if self.kind == "sac":
            return h + checkpoint(self.region, h, use_reentrant=False, context_fn=sac_context)
        return h + checkpoint(self.region, h, use_reentrant=self.kind == "reentrant")


def _user_checkpointed(kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[UserCheckpointed(kind) for _ in range(4)])


def _accumulation_order(pipe: pe.Pipe) -> dict[int, list[int]]:
    """Per stage, the microbatches in the order the schedule adds their weight gradients into ``.grad``."""
    order: dict[int, list[int]] = {}
    for actions in pipe.schedule.actions:
        for a in actions:
            held = pipe.split_report.get(a.stage) is None  # else the whole backward ran at I
            if a.kind.name == "B" or a.kind.name == ("W" if held else "I"):
                order.setdefault(a.stage, []).append(a.microbatch)
    return order


def _seeded_reference_grads(ref: nn.Sequential, pipe: pe.Pipe, x, y, seed: int) -> list[torch.Tensor]:
    """The unsplit model's gradients for one step, each (stage, microbatch) forward seeded as the pipe seeds it.

    Each microbatch's backward runs on its own (weighted by its loss share, as
    the pipe does); the per-microbatch gradients are then added in the order
    the pipe's schedule adds them, so that equal gradients are bitwise equal.
    """
    torch.manual_seed(seed)
    rng = CallRng.draw(True)  # the pipe draws its call's seed from the caller's generator the same way
    stage_of = [s for s, b in enumerate(pipe.balance) for _ in range(b)]
    m = pipe.chunks
    xs, ys = x.chunk(m), y.chunk(m)
    per_mb = []
    for k in range(m):
        ref.zero_grad(set_to_none=True)
        h = xs[k]
        for i, (layer, s) in enumerate(zip(ref, stage_of)):
            if i == 0 or stage_of[i - 1] != s:  # a stage's forward starts: the pipe seeds it
                torch.manual_seed(rng.seed(s, k))
            h = layer(h)
        loss = nn.functional.mse_loss(h, ys[k])
        torch.autograd.backward(loss, torch.full_like(loss, 1.0 / m))
        per_mb.append([[p.grad for p in layer.parameters()] for layer in ref])
    order = _accumulation_order(pipe)
    grads = []
    for i, s in enumerate(stage_of):
        for j in range(len(per_mb[0][i])):
            g = per_mb[order[s][0]][i][j]
            for k in order[s][1:]:
                g = g + per_mb[k][i][j]
            grads.append(g)
    return grads


def _differences_from_unsplit(kind: str, schedule: str, steps: int = 16) -> list:
    """``steps`` training steps (SGD) of the pipe and of the unsplit model; the (schedule, step)s whose gradients or
    parameters differ (each step from equal parameters)."""
    model, ref = _user_checkpointed(kind), _user_checkpointed(kind)
    stages = 2 * S.default_stages_per_rank(schedule)
    # the pipe's own checkpointing on top of the user's, for the selective kind
    pipe = pe.Pipe(model, balance=[4 // stages] * stages, devices=["cpu", "cpu"], chunks=4, schedule=schedule,
                   checkpoint="except_last" if kind == "sac" else "never")
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    differ: list = []
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-3)  # worker threads change hands more often: the interleavings of a loaded machine
    try:
        for step in range(steps):
            x, y = torch.randn(8, 8), torch.randn(8, 8)
            opt.zero_grad()
            torch.manual_seed(1000 + step)
            pipe.step(x, target=y, loss_fn=nn.functional.mse_loss)
            expected = _seeded_reference_grads(ref, pipe, x, y, 1000 + step)
            grads_equal = all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected))
            for p, g in zip(ref.parameters(), expected):
                p.grad = g
            opt.step()
            ref_opt.step()
            if not grads_equal or not all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters())):
                differ.append((schedule, step))
                with torch.no_grad():  # the next step starts from the same parameters again: counted on its own
                    for a, b in zip(model.parameters(), ref.parameters()):
                        b.copy_(a)
    finally:
        sys.setswitchinterval(switch)
    return differ


# The user's checkpoint sets and restores the process-wide generator while its region recomputes in a
# backward; on a worker thread beside other workers' seeded forwards and recomputations that gave wrong masks.
@pytest.mark.parametrize("kind,schedules", [("plain", ["gpipe", "zb_h1", "zbv"]), ("sac", ["1f1b", "zb_h2", "dualpipev"])])
def test_users_checkpoint_with_dropout_matches_unsplit_model_bitwise(kind, schedules):
    differ = [d for schedule in schedules for d in _differences_from_unsplit(kind, schedule)]
    assert differ == [], f"gradients differ from the unsplit model's at (schedule, step): {differ}"


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("kind", ["plain", "sac", "reentrant"])
def test_users_checkpoint_with_dropout_matches_unsplit_model_bitwise_under_every_schedule(kind):
    differ = [d for schedule in S.available() for d in _differences_from_unsplit(kind, schedule)]
    assert differ == [], f"gradients differ from the unsplit model's at (schedule, step): {differ}"
