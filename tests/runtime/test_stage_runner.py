"""StageRunner and split backward, without any schedule or communication.

Two or three runners are chained by hand; the reference is the unsplit model on
the whole batch: same losses, same input and weight gradients.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipeline_ext.runtime.split import backward_input, backward_weight
from pipeline_ext.runtime.stage import StageError, StageRunner
from models import TOL, unsplit


class Block(nn.Module):
    """LayerNorm + residual MLP: the shape of a transformer block's second half."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class TwoOut(nn.Module):
    """Returns a tuple: activations and an integer tensor that needs no gradient."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x, ids=None):
        return torch.tanh(self.lin(x)), (x[:, 0] > 0).long()


class TwoIn(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x, ids):
        return self.lin(x) + ids.unsqueeze(1).float()


def stages_fwd(model, x):
    out = x
    for m in model:
        out = m(*out) if isinstance(out, tuple) else m(out)
    return out


@pytest.mark.parametrize("split", [False, True], ids=["B", "I+W"])
@pytest.mark.parametrize("kind", ["blocks", "tuple"])
def test_chained_runners_match_unsplit_model(split, kind):
    torch.manual_seed(0)
    d, n, m = 8, 10, 4
    if kind == "blocks":
        stages = [Block(d), Block(d), nn.Sequential(Block(d), nn.Linear(d, 3))]
    else:
        stages = [TwoOut(d), TwoIn(d), nn.Linear(d, 3)]
    x, y = torch.randn(n, d), torch.randn(n, 3)
    loss_fn = nn.functional.mse_loss
    ref_loss, ref_grads = unsplit(stages, x, y, loss_fn)

    runners = [StageRunner(s, i, 3, loss_fn=loss_fn) for i, s in enumerate(stages)]
    xs, ys = torch.tensor_split(x, m), torch.tensor_split(y, m)
    weights = [c.shape[0] / n for c in xs]
    for mb in range(m):  # GPipe order: all F, then all backward
        acts = (xs[mb],)
        for r in runners:
            acts = r.forward(mb, acts, target=ys[mb], loss_weight=weights[mb])
    assert [r.live_microbatches for r in runners] == [m, m, m]
    for mb in reversed(range(m)):
        grads = None
        for r in reversed(runners):
            grads = r.backward_input(mb, grads) if split else r.backward(mb, grads)
        if split:
            assert all(p.grad is None for p in runners[1].module.parameters()) or mb < m - 1
            for r in runners:
                r.backward_weight(mb)
    assert [r.live_microbatches for r in runners] == [0, 0, 0]
    loss = sum(w * runners[-1].losses[mb] for mb, w in enumerate(weights))
    torch.testing.assert_close(loss, ref_loss, **TOL)
    got = [p.grad for s in stages for p in s.parameters()]
    for g, r in zip(got, ref_grads):
        torch.testing.assert_close(g, r, **TOL)


def test_input_grad_half_leaves_weights_alone():
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.LayerNorm(4), nn.Linear(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    out = net(x)
    g = torch.randn_like(out)
    (gx,), deferred = backward_input([out], [g], [x])
    assert all(p.grad is None for p in net.parameters())
    backward_weight(deferred)
    x2 = x.detach().clone().requires_grad_(True)
    ref = copy.deepcopy(net)
    ref.zero_grad()
    ref(x2).backward(g)
    torch.testing.assert_close(gx, x2.grad)
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_tied_weights_are_counted_once():
    torch.manual_seed(2)
    lin = nn.Linear(5, 5)
    x = torch.randn(2, 5, requires_grad=True)
    out = lin(torch.tanh(lin(x))) + 2 * lin.bias
    g = torch.randn_like(out)
    _, deferred = backward_input([out], [g], [x])
    backward_weight(deferred)
    got = [p.grad.clone() for p in lin.parameters()]
    lin.zero_grad()
    (lin(torch.tanh(lin(x))) + 2 * lin.bias).backward(g)
    for a, b in zip(got, lin.parameters()):
        torch.testing.assert_close(a, b.grad)


def test_misordered_actions_name_stage_and_microbatch():
    r = StageRunner(nn.Linear(2, 2), 1, 3)
    with pytest.raises(StageError, match="stage 1: B of microbatch 0 has no forward state"):
        r.backward(0, [torch.ones(1, 2)])
    r.forward(0, (torch.ones(1, 2),))
    with pytest.raises(StageError, match="stage 1: W of microbatch 0 ran before its I"):
        r.backward_weight(0)
    with pytest.raises(StageError, match="gradient for output 0 has shape"):
        r.backward(0, [torch.ones(3, 2)])


def test_non_tensor_output_is_a_clear_error():
    class Bad(nn.Module):
        def forward(self, x):
            return x, "oops"

    r = StageRunner(Bad(), 0, 2)
    with pytest.raises(TypeError, match="stage 0 returned a str at output position 1"):
        r.forward(0, (torch.ones(2),))


@pytest.mark.parametrize("split", [False, True], ids=["B", "I+W"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight", [1 / 3, 0.125, torch.tensor(0.3712345), torch.tensor(1 / 7, dtype=torch.float64)],
                         ids=["third", "eighth", "tensor32", "tensor64"])
def test_the_loss_weight_gives_bitwise_the_gradients_of_the_weighted_loss(split, dtype, weight):
    """The last stage seeds its backward with the loss weight: exactly ``(loss * weight).backward()``."""
    torch.manual_seed(0)
    block = Block(8).to(dtype)
    ref = copy.deepcopy(block)
    x, y = torch.randn(5, 8, dtype=dtype), torch.randn(5, 8, dtype=dtype)
    runner = StageRunner(block, 0, 1, loss_fn=nn.functional.mse_loss)
    runner.forward(0, (x,), target=y, loss_weight=weight)
    if split:
        runner.backward_input(0)
        runner.backward_weight(0)
    else:
        runner.backward(0)
    (nn.functional.mse_loss(ref(x), y) * weight).backward()
    for p, q in zip(block.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert torch.equal(runner.losses[0], nn.functional.mse_loss(ref(x), y).detach())  # the loss itself, unweighted


def _graph(seed: int = 0):
    torch.manual_seed(seed)
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    h = x @ w
    return w, x, [h.relu(), h.tanh() * 2]


@pytest.mark.parametrize("as_edges", [False, True])
def test_run_backward_gives_bitwise_torchs_gradients(as_edges):
    """The runner's backward goes to the engine directly when every gradient is a plain tensor: the same call
    torch.autograd.backward ends in, so the same bits, for tensor roots and for released outputs' edges."""
    from torch.autograd.graph import get_gradient_edge

    from pipeline_ext.runtime.stage import run_backward

    grads = [torch.randn(3, 4), torch.randn(3, 4, dtype=torch.float64)]  # a float64 gradient is cast, as torch does
    got, want = [], []
    for fn, out in ((run_backward, got), (torch.autograd.backward, want)):
        w, x, roots = _graph()
        fn([get_gradient_edge(r) for r in roots] if as_edges else roots, grads)
        out.extend([w.grad, x.grad])
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_run_backward_checks_what_torch_checks():
    from pipeline_ext.runtime.stage import run_backward

    _, _, roots = _graph()
    with pytest.raises(RuntimeError, match=r"\[3, 5\].*\[3, 4\]"):  # a gradient of the wrong shape, named
        run_backward(roots[:1], [torch.ones(3, 5)])
    w, x, roots = _graph()
    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar outputs"):
        run_backward(roots[:1], [None])  # no gradient: torch's own path and error
    loss = (x @ w).sum()
    run_backward([loss], [None])  # a scalar root without a gradient: torch's path seeds it with 1
    w2, x2, _ = _graph()
    (x2 @ w2).sum().backward()
    assert torch.equal(w.grad, w2.grad)
