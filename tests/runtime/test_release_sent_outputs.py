"""Releasing sent outputs (``StageRunner(release_outputs=True)``): exact, and it frees memory.

The runner keeps a released output's autograd edge instead of the tensor
(``runtime/stage.ReleasedOutput``). Single-process tests drive one middle
stage by hand, once with and once without the release, and compare input and
weight gradients bitwise, for plain B and for split I/W, over the outputs that
could go wrong: one the last op saves (ReLU, sigmoid, tanh), views of inputs
and parameters, the input itself, tuples (an output saved by a later output's
op, the same tensor twice), outputs that need no gradient, non-contiguous ones,
an output the module keeps, checkpointed microbatches. Multi-process tests
run 1F1B and ZB-H1 on two ranks over Gloo against the unsplit model, and count
activation bytes (``runtime/memory.ActivationMeter``) with and without.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from mp_utils import run_ranks
from models import build, loss_fn, make_batch, run_stages, TOL
import pipeline_ext as pe
from pipeline_ext.runtime.stage import ReleasedOutput, StageRunner

D = 6


class Last(nn.Module):
    """Linear, then an optional activation as the stage's last op."""

    def __init__(self, act=None) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.act = act

    def forward(self, x):
        y = self.lin(x)
        return self.act(y) if self.act is not None else y


class ViewOfInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return x[:, :3], self.lin(x)


class ViewOfParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D))

    def forward(self, x):
        return x @ self.w, self.w.t()  # the second: a view of a parameter (same shape each microbatch)


class Identity(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return x, self.lin(x)


class SavedByLater(nn.Module):
    """``y`` is saved by ``y * y``'s node as its input: the case a ``.data`` swap would corrupt."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        y = self.lin(x)
        return y, y * y, y


class NoGrad(nn.Module):
    """Outputs that need no gradient: integer, and floating point computed without autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("scale", torch.ones(4, D))

    def forward(self, x):
        return self.lin(x), (x[:, 0] > 0).long(), x.detach() * 2, self.scale


class NonContiguous(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        y = self.lin(x).reshape(2, 2, 1, D)
        return y.clone(memory_format=torch.channels_last)  # not contiguous, not a view


class Keeps(nn.Module):
    """Keeps its last output (a user's reference): releasing must neither change nor free it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.kept = None

    def forward(self, x):
        self.kept = torch.sigmoid(self.lin(x))
        return self.kept


CASES = {
    "linear": lambda: Last(),
    "relu": lambda: Last(nn.ReLU()),
    "sigmoid": lambda: Last(nn.Sigmoid()),
    "tanh": lambda: Last(nn.Tanh()),
    "view_of_input": ViewOfInput,
    "view_of_param": ViewOfParam,
    "identity": Identity,
    "saved_by_later": SavedByLater,
    "no_grad": NoGrad,
    "non_contiguous": NonContiguous,
    "keeps": Keeps,
}
# which outputs (in order, differentiable ones only) are released
RELEASED = {
    "linear": [True], "relu": [True], "sigmoid": [True], "tanh": [True],
    "view_of_input": [False, True], "view_of_param": [True, False], "identity": [False, True],
    "saved_by_later": [True, True, True], "non_contiguous": [False],
    # the buffer is let go of too (the module keeps it: nothing is freed, nothing changes)
    "no_grad": [True, True, True],
    "keeps": [True],
}


def _grads_of(outs):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(o.shape, generator=g) if o.is_floating_point() else None for o in outs]


def _run(make, release: bool, split: bool, stage: int = 1, checkpoint=None, n_mb: int = 2):
    """Forward and backward of ``n_mb`` microbatches on one stage; returns input grads, param grads, runner."""
    torch.manual_seed(0)
    module = make()
    runner = StageRunner(module, stage, 3, release_outputs=release, checkpoint=checkpoint)
    xs = [torch.randn(4, D, generator=torch.Generator().manual_seed(10 + m)) for m in range(n_mb)]
    x_before = [x.clone() for x in xs]
    sent = {m: runner.forward(m, (xs[m],)) for m in range(n_mb)}
    held = {m: list(runner.held()[m].outputs) for m in range(n_mb)}
    message = []
    for m in range(n_mb):
        grads = [g for g, o in zip(_grads_of(sent[m]), sent[m]) if o.is_floating_point()]
        if split:
            message.append(runner.backward_input(m, grads))
        else:
            message.append(runner.backward(m, grads))
    if split:
        for m in range(n_mb):
            runner.backward_weight(m)
    for x, b in zip(xs, x_before):
        assert torch.equal(x, b), "an input was changed"
    params = [p.grad.clone() for p in module.parameters()]
    return message, params, held, module


@pytest.mark.parametrize("split", [False, True], ids=["B", "IW"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_release_is_bitwise_exact(case, split):
    got, got_params, held, module = _run(CASES[case], True, split)
    want, want_params, held_off, _ = _run(CASES[case], False, split)
    for m, (a, b) in enumerate(zip(got, want)):
        assert len(a) == len(b)
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"{case}: input grad {i} of microbatch {m} differs"
    assert len(got_params) == len(want_params)
    for i, (p, q) in enumerate(zip(got_params, want_params)):
        assert torch.equal(p, q), f"{case}: param grad {i} differs"
    released = [isinstance(o, ReleasedOutput) for o in held[0]]
    assert released == RELEASED[case], released
    assert not any(isinstance(o, ReleasedOutput) for o in held_off[0])
    if case == "keeps":
        assert module.kept is not None and module.kept.requires_grad  # the user's tensor is as it was


@pytest.mark.parametrize("split", [False, True], ids=["B", "IW"])
def test_checkpointed_microbatches_exact(split):
    every = lambda mb: True  # noqa: E731
    for make in (CASES["sigmoid"], CASES["saved_by_later"]):
        got, got_params, _, _ = _run(make, True, split, checkpoint=every)
        want, want_params, _, _ = _run(make, False, split, checkpoint=every)
        ref, ref_params, _, _ = _run(make, False, split)
        for a, b, c in zip(got, want, ref):
            assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(a, b, c))
        assert all(torch.equal(p, q) and torch.equal(p, r) for p, q, r in zip(got_params, want_params, ref_params))


def test_first_stage_output_is_the_users_input():
    """Stage 0 returning the user's tensor (no grad) or a view of it keeps it; nothing of it changes."""

    class Pass(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x, y):
            return x, y[1:], self.lin(x)

    runner = StageRunner(Pass(), 0, 2)
    x = torch.randn(4, D)
    y = torch.randn(4, D, requires_grad=True) * 1.0  # a non-leaf of the user's graph
    before = (x.clone(), y.detach().clone(), x.data_ptr())
    runner.forward(0, (x, y))
    outs = runner.held()[0].outputs
    assert outs[0] is x and not isinstance(outs[1], ReleasedOutput) and isinstance(outs[2], ReleasedOutput)
    runner.backward(0, [torch.ones(4, D), torch.ones(3, D), torch.ones(4, D)])
    assert torch.equal(x, before[0]) and torch.equal(y.detach(), before[1]) and x.data_ptr() == before[2]


def test_released_storage_is_freed_when_the_sent_copy_goes():
    """The runner no longer keeps the bytes: once the sent tensor is dropped, the storage is gone
    (Linear last); an output the graph saved (sigmoid) stays until backward."""
    for act, freed in ((None, True), (nn.Sigmoid(), False)):
        for release in (True, False):
            runner = StageRunner(Last(act), 1, 3, release_outputs=release)
            (sent,) = runner.forward(0, (torch.randn(4, D),))
            ref = StorageWeakRef(sent.untyped_storage())
            del sent
            assert ref.expired() == (freed and release), (act, release)
            runner.backward(0, [torch.ones(4, D)])
            assert ref.expired()


def test_switch_off_keeps_every_output():
    assert StageRunner(Last(), 1, 3).release_outputs  # on by default
    runner = StageRunner(Last(), 1, 3, release_outputs=False)
    runner.forward(0, (torch.randn(4, D),))
    assert isinstance(runner.held()[0].outputs[0], torch.Tensor)


def test_wrong_gradient_shape_still_named():
    from pipeline_ext.runtime.stage import StageError

    runner = StageRunner(Last(), 1, 3)
    runner.forward(0, (torch.randn(4, D),))
    with pytest.raises(StageError, match="has shape"):
        runner.backward(0, [torch.ones(3, D)])


# -- multi-process: two ranks over Gloo -------------------------------------------------------------------------
def _schedule(name: str, rank: int, world: int, m: int, modules: list, release: bool):
    import pipeline_ext as pe

    stage = pe.PipelineStage(modules[rank], rank, world, "cpu", release_outputs=release)
    return pe.get_schedule_class(name)(stage, m, loss_fn=loss_fn)


def _step(sched, rank: int, world: int, x, y) -> None:
    sched.step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None)


def _three_steps(rank: int, world: int, name: str) -> list[str]:
    m = 2 * world
    on, off, ref = build("blocks", world), build("blocks", world), build("blocks", world)
    scheds = {True: _schedule(name, rank, world, m, on, True), False: _schedule(name, rank, world, m, off, False)}
    opts = {True: torch.optim.SGD(on[rank].parameters(), lr=0.1, momentum=0.9),
            False: torch.optim.SGD(off[rank].parameters(), lr=0.1, momentum=0.9)}
    ref_opt = torch.optim.SGD([p for s in ref for p in s.parameters()], lr=0.1, momentum=0.9)
    bad = []
    for step in range(3):
        x, y = make_batch("blocks", 4 * m + 1, seed=step)
        for release in (True, False):
            opts[release].zero_grad()
            _step(scheds[release], rank, world, x, y)
        for i, (p, q) in enumerate(zip(on[rank].parameters(), off[rank].parameters())):
            if not torch.equal(p.grad, q.grad):
                bad.append(f"{name} rank {rank} step {step} param {i}: grad differs with the release")
        for opt in opts.values():
            opt.step()
        ref_opt.zero_grad()
        loss_fn(run_stages(ref, x), y).backward()
        ref_opt.step()
    bad += [f"{name} rank {rank} param {i} differs from the unsplit model after 3 steps"
            for i, (p, q) in enumerate(zip(on[rank].parameters(), ref[rank].parameters()))
            if not torch.allclose(p, q, **TOL)]
    return bad


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["1f1b", "zb_h1"])
def test_three_optimizer_steps_match_unsplit_model(name):
    results = run_ranks(_three_steps, 2, name, timeout=100)
    bad = [b for _, (_, errs) in sorted(results.items()) for b in errs]
    assert not bad, "\n".join(bad)


def _peaks(rank: int, world: int, name: str) -> dict[bool, int]:
    from pipeline_ext.runtime.memory import ActivationMeter

    m = 2 * world
    x, y = make_batch("blocks", 4 * m, seed=0)
    peaks = {}
    for release in (False, True, False, True):
        meter = ActivationMeter()
        sched = _schedule(name, rank, world, m, build("blocks", world), release)
        for r in sched._runners.values():
            r.instrument(wrap_call=meter.wrap)  # its forwards recorded (what I keeps for W is not counted here)
        sched.register_action_hook(meter.on_action)  # a sample after every action
        _step(sched, rank, world, x, y)
        if release in peaks:
            assert peaks[release] == meter.peak_bytes, "the count is not deterministic"
        peaks[release] = meter.peak_bytes
    return peaks


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["1f1b", "zb_h1"])
def test_release_lowers_held_activation_bytes(name):
    results = run_ranks(_peaks, 2, name, timeout=100)
    first = results[0][1]  # stage 0 sends its outputs; the last stage sends none
    assert first[True] < first[False], first
    last = results[1][1]
    assert last[True] == last[False], last


def test_activation_bytes_counts_what_one_microbatch_leaves_for_backward():
    """Input, the two hidden activations GELU and the second Linear saved, the output; no parameter."""
    module = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(32, 64)
    assert pe.activation_bytes(module, x) == 4 * 32 * (64 + 256 + 256 + 64)
    assert all(p.grad is None for p in module.parameters())
