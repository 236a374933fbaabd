"""The I/W split over regions it used to give up on (issue 40), exact against the unsplit model.

Zero-bubble schedules split each stage's backward into I (input grads) and W
(weight grads). Selective activation checkpointing (SAC), once-only
saved-tensor hooks and custom autograd Functions with weights made it fall
back to a whole backward at I. Now:

- SAC and plain non-reentrant checkpoints split: with SAC the region is
  recomputed once (at I) and I keeps what W reads ([Note: what I keeps for W]);
- a once-only offload hook wrapped in ``pe.once_only_hooks`` splits: its
  unpack runs once per saved tensor, at I, and W reads what I kept; around a
  plain checkpoint (the hooks then save the region's inputs, which I and W
  each recompute from) the inputs are unpacked once and kept until W;
- a ``pe.SplitFunction`` (here attention with its projections inside the
  Function) splits: I runs its ``backward_input``, W its ``backward_weight``;
- a reentrant checkpoint, an unknown hook or an unknown Function on a node
  that runs at both I and W still fall back, exactly, and say why;
- a ``pe.SplitFunction`` whose "weight" argument is an activation (a gate
  computed from the stage input, its gradient given by ``backward_weight``)
  stays exact: I runs both halves of that node and passes the gate's
  gradient on (issue 45);
- a weight used twice in a ``Pipe`` stage keeps the split: the Pipe's own
  identity Function on the stage input is known to it (issue 45).

Each case checks the split really held (no ``UnsplitBackwardWarning``, no
weight gradient after I) and trains three SGD steps with momentum under
ZB-H1, ZB-H2, ZBV and DualPipeV in the single-process ``Pipe`` (one thread
per rank), comparing losses, gradients and parameters with the unsplit model.
Two multi-process cases run on Gloo ranks.
"""
from __future__ import annotations

import copy
import itertools
import math
import threading
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import pipeline_ext as pe
from pipeline_ext.runtime.split import UnsplitBackwardWarning, backward_input, backward_weight
from pipeline_ext.runtime.stage import StageRunner
from models import sac_context, split_vs_whole

D, HEADS, T = 8, 2, 4
ZB = ["zb_h1", "zb_h2", "zbv", "dualpipev"]
KINDS = ["sac", "checkpoint", "reentrant", "offload", "attention", "offload_checkpoint", "pool_checkpoint",
         "gated", "tied"]
SPLITS = {"sac", "checkpoint", "offload", "attention", "offload_checkpoint", "pool_checkpoint",
          "gated", "tied"}  # whose split holds
#: the kinds that fall back, and a word their reason names
FALLS = {"reentrant": "reentrant", "unknown_hook_checkpoint": "checkpoint region"}


# -- what the stages contain -------------------------------------------------------------------------
class Offload:
    """An offload-and-delete hook pair: pack moves the tensor into a store, unpack takes it out (once only)."""

    def __init__(self) -> None:
        self.store: dict[int, torch.Tensor] = {}
        self.keys = itertools.count()
        self.lock = threading.Lock()
        self.unpacks = self.packed = 0

    def __deepcopy__(self, memo: dict) -> "Offload":  # a copied model (the reference) offloads into its own store
        return memo.setdefault(id(self), Offload())

    def pack(self, t: torch.Tensor) -> int:
        with self.lock:
            key = next(self.keys)
            self.packed += 1
        self.store[key] = t.detach().clone()  # "offloaded": a copy elsewhere, the original can go
        return key

    def unpack(self, key: int) -> torch.Tensor:
        with self.lock:
            self.unpacks += 1
            return self.store.pop(key)  # a second unpack of the same tensor is a KeyError


class Pool(Offload):
    """An offload pair over a buffer pool: unpack hands the slot back, and the next pack reuses it (a second
    unpack of the same tensor reads whatever was packed into the slot since)."""

    def __init__(self) -> None:
        super().__init__()
        self.free: list[int] = []

    def __deepcopy__(self, memo: dict) -> "Pool":
        return memo.setdefault(id(self), Pool())

    def pack(self, t: torch.Tensor) -> int:
        with self.lock:
            key = self.free.pop() if self.free else next(self.keys)
            self.packed += 1
        self.store[key] = t.detach().clone()
        return key

    def unpack(self, key: int) -> torch.Tensor:
        with self.lock:
            self.unpacks += 1
            self.free.append(key)
            return self.store[key]


class ProjectedAttention(pe.SplitFunction):
    """Causal multi-head self-attention with its projections inside one Function (FlexAttention-like: the
    backward recomputes the scores from q and k instead of saving the probabilities).

    ``out = softmax(q k^T / sqrt(dh) + causal) v @ w_o`` with ``[q k v] = x @ w_qkv``. I computes the input
    gradient (and dq, dk, dv on the way); W the weight gradients from what I stashed.
    """

    calls = {"input": 0, "weight": 0}

    @staticmethod
    def forward(ctx, x, w_qkv, w_o, heads):
        ctx.heads = heads
        ctx.save_for_backward(x, w_qkv, w_o)
        _, _, _, _, a = ProjectedAttention._attend(x, w_qkv, heads)
        return a @ w_o

    @staticmethod
    def _attend(x, w_qkv, heads):
        b, t, d = x.shape
        q, k, v = (z.reshape(b, t, heads, d // heads).transpose(1, 2) for z in (x @ w_qkv).split(d, -1))
        s = q @ k.transpose(-1, -2) / math.sqrt(d // heads)
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        p = s.softmax(-1)
        a = (p @ v).transpose(1, 2).reshape(b, t, d)
        return q, k, v, p, a

    @staticmethod
    def backward_input(ctx, g):
        ProjectedAttention.calls["input"] += 1
        x, w_qkv, w_o = pe.SplitFunction.saved(ctx)
        b, t, d = x.shape
        h = ctx.heads
        q, k, v, p, a = ProjectedAttention._attend(x, w_qkv, h)
        da = (g @ w_o.t()).reshape(b, t, h, d // h).transpose(1, 2)
        dp = da @ v.transpose(-1, -2)
        dv = p.transpose(-1, -2) @ da
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) / math.sqrt(d // h)
        dq, dk = ds @ k, ds.transpose(-1, -2) @ q
        dqkv = torch.cat([z.transpose(1, 2).reshape(b, t, d) for z in (dq, dk, dv)], -1)
        pe.SplitFunction.save_for_weight(ctx, dqkv, a)
        return dqkv @ w_qkv.t(), None, None, None

    @staticmethod
    def backward_weight(ctx, g):
        ProjectedAttention.calls["weight"] += 1
        x, _, _ = pe.SplitFunction.saved(ctx)
        dqkv, a = pe.SplitFunction.saved_for_weight(ctx)
        d = x.shape[-1]
        return None, x.reshape(-1, d).t() @ dqkv.reshape(-1, 3 * d), a.reshape(-1, d).t() @ g.reshape(-1, d), None


class GatedLinear(pe.SplitFunction):
    """``(x @ w.T) * scale * gate`` with the gate an activation (``sigmoid(Linear(x))``) passed beside the weight,
    and its gradient returned by ``backward_weight`` as if it were one (it works unsplit). ``scale``, a number,
    sits between them: the gradients are indexed by forward input, the graph's edges leave it out."""

    @staticmethod
    def forward(ctx, x, w, scale, gate):
        ctx.save_for_backward(x, w, gate)
        ctx.scale = scale
        return (x @ w.t()) * scale * gate

    @staticmethod
    def backward_input(ctx, g):
        x, w, gate = pe.SplitFunction.saved(ctx)
        return (g * ctx.scale * gate) @ w, None, None, None

    @staticmethod
    def backward_weight(ctx, g):
        x, w, gate = pe.SplitFunction.saved(ctx)
        d = x.shape[-1]
        return None, (g * ctx.scale * gate).reshape(-1, d).t() @ x.reshape(-1, d), None, g * ctx.scale * (x @ w.t())


class WeightGradAtInput(GatedLinear):
    """The mirror mistake: ``backward_input`` returns the weight's gradient too (and the gate's, rightly)."""

    @staticmethod
    def backward_input(ctx, g):
        x, w, gate = pe.SplitFunction.saved(ctx)
        d, gs = x.shape[-1], g * ctx.scale
        return (gs * gate) @ w, (gs * gate).reshape(-1, d).t() @ x.reshape(-1, d), None, gs * (x @ w.t())

    @staticmethod
    def backward_weight(ctx, g):
        return None, None, None, None


class OpaqueAttention(torch.autograd.Function):
    """The same attention as an ordinary Function: one ``backward`` for everything (unknown to the split)."""

    @staticmethod
    def forward(ctx, x, w_qkv, w_o, heads):
        return ProjectedAttention.forward(ctx, x, w_qkv, w_o, heads)

    @staticmethod
    def backward(ctx, g):
        gx = ProjectedAttention.backward_input(ctx, g)[0]
        return (gx, *ProjectedAttention.backward_weight(ctx, g)[1:])


class Stage(nn.Module):
    """A pre-norm residual MLP on (batch, T, D) activations, its body wrapped as ``kind`` says."""

    def __init__(self, kind: str, offload: Offload | None = None) -> None:
        super().__init__()
        self.kind, self.offload = kind, offload
        self.norm = nn.LayerNorm(D)
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        if kind in ("attention", "opaque_attention"):
            self.w_qkv = nn.Parameter(torch.randn(D, 3 * D) / math.sqrt(D))
            self.w_o = nn.Parameter(torch.randn(D, D) / math.sqrt(D))
        if kind == "gated":
            self.w = nn.Parameter(torch.randn(D, D) / math.sqrt(D))
            self.gate = nn.Linear(D, D)
        if kind == "tied":
            self.tied = nn.Linear(D, D)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.kind
        if k == "sac":
            return x + checkpoint(self.body, x, use_reentrant=False, context_fn=sac_context)
        if k == "checkpoint":
            return x + checkpoint(self.body, x, use_reentrant=False)
        if k == "reentrant":
            return x + checkpoint(self.body, x, use_reentrant=True)
        if k in ("offload", "unknown_hook"):
            hooks = (pe.once_only_hooks if k == "offload" else torch.autograd.graph.saved_tensors_hooks)
            with hooks(self.offload.pack, self.offload.unpack):
                return x + self.body(x)
        if k in ("offload_checkpoint", "pool_checkpoint", "unknown_hook_checkpoint"):  # docs/schedules.md's
            hooks = (torch.autograd.graph.saved_tensors_hooks if k == "unknown_hook_checkpoint" else pe.once_only_hooks)
            with hooks(self.offload.pack, self.offload.unpack):
                out = checkpoint(self.body, x, use_reentrant=False)
            return x + out
        if k == "gated":
            h = self.norm(x)
            x = x + GatedLinear.apply(h, self.w, 0.5, torch.sigmoid(self.gate(h)))
            return x + self.down(nn.functional.gelu(self.up(x)))
        if k == "tied":  # one Linear twice: W is one backward over the parameters, re-running the input region
            x = x + self.tied(torch.tanh(self.tied(self.norm(x))))
            return x + self.down(nn.functional.gelu(self.up(x)))
        if k in ("attention", "opaque_attention"):
            fn = ProjectedAttention if k == "attention" else OpaqueAttention
            x = x + fn.apply(self.norm(x), self.w_qkv, self.w_o, HEADS)
            return x + self.down(nn.functional.gelu(self.up(x)))
        return x + self.body(x)


def make_stages(kind: str, n: int, seed: int = 0) -> list[Stage]:
    """``n`` stages of ``kind``; a reentrant checkpoint's first stage is plain (its input needs no grad, and then
    torch gives a reentrant region's parameters no gradient at all, unsplit too)."""
    torch.manual_seed(seed)
    offload = Pool() if kind == "pool_checkpoint" else Offload()
    return [Stage("plain" if kind == "reentrant" and s == 0 else kind, offload) for s in range(n)]


def batch(rows: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, T, D, generator=g), torch.randn(rows, T, D, generator=g)


# -- one stage, I then W by hand ---------------------------------------------------------------------
def _i_then_w(kind: str):
    """I and W of one stage against one plain backward; returns (deferred.unsplit, grads after I were empty)."""
    stage = make_stages(kind, 2)[1]
    x, _ = batch(3)
    run = split_vs_whole(stage, x.requires_grad_(True), list(stage.parameters()))
    return run.unsplit, run.no_weight_grad_after_i


@pytest.mark.parametrize("kind", sorted(SPLITS))
def test_split_holds_and_i_computes_no_weight_grad(kind):
    unsplit, empty_after_i = _i_then_w(kind)
    assert unsplit is None and empty_after_i


@pytest.mark.parametrize("kind,why", [("reentrant", "reentrant"), ("unknown_hook", "once_only_hooks"),
                                      ("unknown_hook_checkpoint", "once_only_hooks"),
                                      ("opaque_attention", "SplitFunction")])
def test_what_cannot_split_falls_back_exactly_and_says_why(kind, why):
    unsplit, empty_after_i = _i_then_w(kind)
    assert unsplit is not None and why in unsplit and not empty_after_i, unsplit


@pytest.mark.parametrize("kind", ["sac", "offload"])
def test_tied_weights_keep_the_split_too(kind):
    """A weight used twice makes W one backward over the parameters, which runs the whole input region again:
    every region node's values are kept from I (SAC: no second recomputation; once-only: no second unpack)."""
    torch.manual_seed(0)
    lin, offload, calls = nn.Linear(D, D), Offload(), [0]

    def body(x):
        calls[0] += 1
        return lin(torch.tanh(lin(x))) + 2 * lin.bias

    def run(x):
        if kind == "sac":
            return checkpoint(body, x, use_reentrant=False, context_fn=sac_context)
        with pe.once_only_hooks(offload.pack, offload.unpack):
            return body(x)

    split = split_vs_whole(run, torch.randn(3, D, requires_grad=True), list(lin.parameters()), reference=body)
    assert split.unsplit is None and split.fallback and split.no_weight_grad_after_i
    assert calls[0] == (3 if kind == "sac" else 2) and not offload.store  # sac: forward, I's recomputation, reference


def test_sac_region_is_recomputed_once_and_what_w_reads_is_freed_after_w():
    """SAC: forward + one recomputation (at I), none at W; between I and W the frame holds W's values only,
    after W nothing of the recomputation is left."""
    torch.manual_seed(0)
    stage, calls = Stage("plain"), [0]

    def body(x):
        calls[0] += 1
        return stage.body(x)

    x = torch.randn(3, T, D, requires_grad=True)
    out = x + checkpoint(body, x, use_reentrant=False, context_fn=sac_context)
    (_,), deferred = backward_input([out], [torch.randn_like(out)], [x])
    assert deferred.unsplit is None and deferred.group is not None and calls[0] == 2
    theirs = {t.untyped_storage().data_ptr() for t in (x, *stage.parameters())}
    kept = [t for t in deferred.kept_tensors() if t.untyped_storage().data_ptr() not in theirs]
    # W reads what the weight grads need: LayerNorm's mean and rstd, up's input (norm's output) and down's
    # input (gelu's output), all recomputed at I; gelu's own input went at I (only the input grad needs it)
    assert sorted(tuple(t.shape) for t in kept) == [(3, T, 1), (3, T, 1), (3 * T, D), (3 * T, 2 * D)], \
        [t.shape for t in kept]
    frame = deferred.keep.frames[0]
    backward_weight(deferred)
    assert calls[0] == 2 and all(p.grad is not None for p in stage.parameters())
    assert deferred.group not in frame.recomputed and not any(
        h().handles.get(deferred.group) for h in frame.weak_holders if h() is not None)


def test_once_only_hook_unpacks_each_saved_tensor_once():
    stage = make_stages("offload", 2)[1]
    x = torch.randn(3, T, D, requires_grad=True)
    out = stage(x)
    saved = len(stage.offload.store)
    (_,), deferred = backward_input([out], [torch.randn_like(out)], [x])
    kept = deferred.kept_tensors()
    # everything the boundary nodes (LayerNorm, up, down: their weights too, the hook packs every saved tensor)
    # saved; not gelu's input, which only the input grad needs
    assert deferred.unsplit is None and saved == 10 and len(kept) == 9
    backward_weight(deferred)
    assert stage.offload.unpacks == saved and not stage.offload.store
    assert deferred.kept_tensors() == []


def _around_checkpoints(shape: str, lin: nn.Linear, lin2: nn.Linear, c: torch.Tensor):
    """Graphs where once-only hooks save checkpointed regions' inputs, which I and W (or two of W's calls) each
    recompute from; ``run(x, offload)`` returns the stage's outputs."""
    def ck(fn, *args):
        return checkpoint(fn, *args, use_reentrant=False)

    bodies = {
        # W re-enters lin's node (weight branch) and backpropagates lin2(c), which no input leads to (W's second
        # call): I and both W calls recompute the region
        "outputs_independent_of_the_input": lambda x: ck(lambda x, c: (lin(x), lin2(c).tanh()), x, c),
        # lin used twice: W is one backward over the parameters, through the whole region again
        "tied_weights": lambda x: (ck(lambda x: lin(torch.tanh(lin(x))), x),),
        # the inner region's inputs are the outer one's holders; the outer region's inputs are the hooks'
        "nested": lambda x: (ck(lambda x: lin2(torch.tanh(ck(lambda y: lin(y).tanh(), x))), x),),
        "two_regions": lambda x: (ck(lambda h: lin2(h).tanh(), ck(lambda x: lin(x).tanh(), x)),),
        # no weight in the region: recomputed at I only, nothing kept
        "input_only": lambda x: (lin(ck(lambda x: torch.tanh(x) * 2, x)),),
    }

    def run(x: torch.Tensor, offload: Offload) -> list[torch.Tensor]:
        with pe.once_only_hooks(offload.pack, offload.unpack):
            return list(bodies[shape](x))

    return run


@pytest.mark.parametrize("shape", ["outputs_independent_of_the_input", "tied_weights", "nested", "two_regions",
                                   "input_only"])
def test_once_only_hooks_around_checkpoints_unpack_each_input_once(shape):
    """docs/schedules.md's ``with once_only_hooks(...): checkpoint(block, x)``: the hooks save the region's inputs
    on the checkpoint frame and every recomputation unpacks them. Each is unpacked once (the pair pops: a second
    unpack is a KeyError), held from the first recomputation until W, then dropped; the split holds, exactly."""
    torch.manual_seed(0)
    lin, lin2, c = nn.Linear(D, D), nn.Linear(D, D), torch.randn(3, D)
    params = [*lin.parameters(), *lin2.parameters()]
    run, offload = _around_checkpoints(shape, lin, lin2, c), Offload()
    x = torch.randn(3, D, requires_grad=True)
    outs = run(x, offload)
    gs = [torch.randn_like(o) for o in outs]
    (gx,), deferred = backward_input(outs, gs, [x])
    assert deferred.unsplit is None and all(p.grad is None for p in params)
    # what I holds for the recomputations to come (the region's inputs; the memory accounting sees it)
    held = [b.kept for b in deferred.keep.held]
    assert (held == [] if shape == "input_only" else any(t is not None and t.shape == x.shape for t in held)), held
    assert all(any(t is k for k in deferred.kept_tensors()) for t in held if t is not None)
    backward_weight(deferred)
    assert offload.packed == offload.unpacks and not offload.store
    assert deferred.kept_tensors() == [] and deferred.keep.held == []
    got = [p.grad for p in params]
    for p in params:
        p.grad = None
    x2 = x.detach().clone().requires_grad_(True)
    torch.autograd.backward(run(x2, Offload()), gs)
    torch.testing.assert_close(gx, x2.grad)
    for a, p in zip(got, params):
        torch.testing.assert_close(a, p.grad)


def test_a_plain_checkpoint_inside_the_callers_graph_exec_group_falls_back_exactly_and_says_why():
    """Inside a caller's ``GraphExecGroup`` I and W share one recomputation, which hands each value out once, so a
    node that runs at I and at W could not read its value twice (CheckpointError): the whole backward runs at I."""
    from torch.utils.checkpoint import GraphExecGroup

    torch.manual_seed(0)
    stage = Stage("checkpoint")
    x = torch.randn(3, T, D, requires_grad=True)
    with GraphExecGroup():
        assert "caller's GraphExecGroup" in (pe.runtime.split_check(stage, x) or "")
        split = split_vs_whole(stage, x, list(stage.parameters()))
    assert split.unsplit is not None and "caller's GraphExecGroup" in split.unsplit


def test_split_function_runs_each_half_once_and_matches_autograd():
    """The attention Function's halves, each once per split backward, against the same math under autograd."""
    torch.manual_seed(0)
    x = torch.randn(2, T, D, dtype=torch.float64, requires_grad=True)
    w_qkv = torch.randn(D, 3 * D, dtype=torch.float64, requires_grad=True)
    w_o = torch.randn(D, D, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: ProjectedAttention.apply(*a, HEADS), (x, w_qkv, w_o))
    ProjectedAttention.calls.update(input=0, weight=0)
    out = ProjectedAttention.apply(x, w_qkv, w_o, HEADS)
    (gx,), deferred = backward_input([out], [torch.ones_like(out)], [x])
    assert ProjectedAttention.calls == {"input": 1, "weight": 0} and w_qkv.grad is None
    backward_weight(deferred)
    assert ProjectedAttention.calls == {"input": 1, "weight": 1}
    want = torch.autograd.grad(ProjectedAttention._attend(x, w_qkv, HEADS)[-1].matmul(w_o).sum(), [x, w_qkv, w_o])
    for got, exp in zip([gx, w_qkv.grad, w_o.grad], want):
        torch.testing.assert_close(got, exp)


@pytest.mark.parametrize("fn,said", [(GatedLinear, "forward input(s) [3], which lead to the stage input"),
                                     (WeightGradAtInput, "forward input(s) [1], which lead to no stage input")])
def test_split_function_halves_are_cut_where_its_inputs_lead(fn, said):
    """A SplitFunction whose halves do not match where its inputs lead (an activation's gradient from
    backward_weight, a weight's from backward_input) keeps the split exact: I runs both halves of that node,
    passes on what leads to the stage input, W gets the rest; one warning names the input to move."""
    from pipeline_ext.runtime.split import function as split_function

    torch.manual_seed(0)
    lin, w = nn.Linear(D, D), nn.Parameter(torch.randn(D, D) / math.sqrt(D))
    split_function._warned.discard(fn)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        split = split_vs_whole(lambda x: fn.apply(x, w, 0.5, torch.sigmoid(lin(x))),
                               torch.randn(3, D, requires_grad=True), [w, *lin.parameters()])
    assert split.unsplit is None and split.no_weight_grad_after_i and split.branches == 2 and not split.fallback
    told = [str(m.message) for m in got if fn.__qualname__ in str(m.message)]
    assert len(told) == 1 and said in told[0], told


def test_split_function_giving_one_input_two_gradients_is_refused_split_or_not():
    class Twice(GatedLinear):
        @staticmethod
        def backward_input(ctx, g):
            x, w, gate = pe.SplitFunction.saved(ctx)
            return (g * ctx.scale * gate) @ w, None, None, g * ctx.scale * (x @ w.t())

    lin, w = nn.Linear(D, D), nn.Parameter(torch.randn(D, D))
    for split in (False, True):
        x = torch.randn(3, D, requires_grad=True)
        out = Twice.apply(x, w, 0.5, torch.sigmoid(lin(x)))
        with pytest.raises(RuntimeError, match="both halves returned a gradient for forward input 3"):
            if split:
                backward_weight(backward_input([out], [torch.ones_like(out)], [x])[1])
            else:
                out.sum().backward()


def test_runner_accounts_for_what_i_keeps_until_w():
    """The ActivationMeter sees what I keeps (recomputed SAC values) and sees it go after W."""
    from pipeline_ext.runtime.memory import ActivationMeter

    torch.manual_seed(0)
    meter = ActivationMeter()
    runner = StageRunner(Stage("sac"), 1, 3)
    meter.watch(runner)
    runner.forward(0, (torch.randn(3, T, D),))
    at_forward = meter.live_bytes()
    runner.backward_input(0, [torch.randn(3, T, D)])
    params = {p.untyped_storage().data_ptr() for p in runner.module.parameters()}
    kept = [t for t in runner._states[0].deferred.kept_tensors() if t.untyped_storage().data_ptr() not in params]
    assert kept and meter.live_bytes() >= sum(t.untyped_storage().nbytes() for t in kept)
    del kept
    runner.backward_weight(0)
    assert meter.live_bytes() == 0 < at_forward and runner.split_seen and runner.split_fallback is None


def test_activation_bytes_counts_what_a_custom_function_saved():
    """A custom Function's node keeps its saved tensors as ``saved_tensors`` (a C++ node as ``_saved_<name>``): the
    meter reads both. It used to stop with an AttributeError on any custom Function, a ``SplitFunction`` or a
    region compiled by ``split_backend`` included."""
    torch.manual_seed(0)
    lin, w = nn.Linear(D, D), nn.Parameter(torch.randn(D, D))

    class Gated(nn.Module):
        def forward(self, x):
            return GatedLinear.apply(x, w, 0.5, torch.sigmoid(lin(x)))

    rows = 3 * D * 4  # one (3, D) float32 tensor
    # the input, the output and the gate (sigmoid's saved result); w only GatedLinear saved (no parameter of the
    # module, so counted: it stands for what only a custom Function keeps)
    assert pe.runtime.activation_bytes(Gated(), torch.randn(3, D)) == 3 * rows + D * D * 4


# -- every zero-bubble schedule, three optimizer steps, against the unsplit model -------------------
def _train_pipe(kind: str, name: str, p: int, m: int, steps: int = 3, checkpoint: str = "never") -> None:
    v = 2 if name in pe.pipe.MULTI_STAGE_SCHEDULES else 1
    stages = make_stages(kind, p * v)
    ref = nn.Sequential(*copy.deepcopy(stages))
    pipe = pe.Pipe(nn.Sequential(*stages), balance=[1] * (p * v), devices=["cpu"] * p, chunks=m, schedule=name,
                   checkpoint=checkpoint)
    offload = stages[0].offload
    opt = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    where = f"{kind} {name} p={p} m={m} checkpoint={checkpoint}"
    for step in range(steps):
        x, y = batch(2 * m, seed=step)
        opt.zero_grad()
        ref_opt.zero_grad()
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            loss = pipe.step(x, target=y, loss_fn=nn.functional.mse_loss)
        unsplit = [str(w.message) for w in said if issubclass(w.category, UnsplitBackwardWarning)]
        ref_loss = nn.functional.mse_loss(ref(x), y)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), msg=f"{where} step {step} loss")
        for (n_, a), b in zip(pipe.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, msg=f"{where} step {step} grad {n_}")
        opt.step()
        ref_opt.step()
        # the hooks' contract: each packed tensor unpacked once (none twice, none left behind)
        assert offload.unpacks == offload.packed and (kind == "pool_checkpoint" or not offload.store), where
        if kind in SPLITS:
            assert not unsplit, f"{where}: {unsplit}"
            assert set(pipe.split_report.values()) == {None}, f"{where}: {pipe.split_report}"
        else:
            assert pipe.split_report and all(why is not None and FALLS[kind] in why
                                             for s, why in pipe.split_report.items() if s > 0), pipe.split_report
    for (n_, a), b in zip(pipe.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, msg=f"{where} param {n_} after {steps} steps")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", KINDS)
def test_zero_bubble_schedules_train_exactly(kind):
    for name in ZB:
        _train_pipe(kind, name, 2, 4)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["offload_checkpoint", "pool_checkpoint", "unknown_hook_checkpoint"])
def test_offload_around_a_checkpoint_trains_exactly_under_the_pipes_checkpointing_too(kind):
    """docs/schedules.md's offload pair around a plain checkpoint, with the Pipe's own checkpointing (the stage
    runs again, under autograd, before its backward): the hooks save the region's inputs; I and W each
    recompute the region from them, and the pair's unpack still runs once per packed tensor."""
    for name in ZB:
        _train_pipe(kind, name, 2, 4, checkpoint="always")


@pytest.mark.timeout(240)
def test_an_unknown_hook_around_a_checkpoint_falls_back_exactly():
    for name in ZB:
        _train_pipe("unknown_hook_checkpoint", name, 2, 4)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", KINDS)
def test_zero_bubble_schedules_train_exactly_on_four_ranks(kind):
    for name in ZB:
        _train_pipe(kind, name, 4, 8)


# -- saying what happened: split_check, select(), the trace -------------------------------------------
@pytest.mark.parametrize("kind", KINDS + ["unknown_hook", "unknown_hook_checkpoint", "opaque_attention"])
def test_split_check_predicts_what_i_does(kind):
    """``split_check`` reads a stage's graph without running backward and says what I would do."""
    stage = make_stages(kind, 2)[1]
    x = torch.randn(2, T, D)
    predicted = pe.runtime.split_check(stage, x)
    actual, _ = _i_then_w(kind)
    assert predicted == actual
    assert all(p.grad is None for p in stage.parameters())


class NoWeightHalf(pe.SplitFunction):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward_input(ctx, g):
        x, w = pe.SplitFunction.saved(ctx)
        return g @ w.t(), None


class _HalfStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D))

    def forward(self, x):
        return NoWeightHalf.apply(x, self.w)


def test_split_check_says_what_a_split_function_lacks():
    why = pe.runtime.split_check(_HalfStage(), torch.randn(2, D))
    assert why is not None and "NoWeightHalf" in why and "SplitFunction without backward_weight" in why, why
    assert "define backward_weight(ctx, *grad_outputs)" in why and "is no " not in why, why


def test_split_check_leaves_buffers_and_rng_as_they_were():
    """A user's loop with ``split_check`` before it trains exactly as one without: BatchNorm's running statistics
    and the RNG (dropout's masks) are untouched by the check."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D), nn.Dropout(0.3), nn.Linear(D, D))

    def train(check: bool):
        m = model()
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        torch.manual_seed(1)
        example = torch.randn(4, D)
        if check:
            buffers = {n: (b, b.clone()) for n, b in m.named_buffers()}
            rng = torch.get_rng_state()
            cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
            assert pe.runtime.split_check(m, example) is None
            assert torch.equal(torch.get_rng_state(), rng)
            assert all(torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all() if cuda_rng else [], cuda_rng))
            for n, b in m.named_buffers():
                assert b is buffers[n][0] and torch.equal(b, buffers[n][1]), n
        losses = []
        for step in range(3):
            x, y = batch(4, seed=step)
            loss = nn.functional.mse_loss(m(x[:, 0]), y[:, 0])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses, m.state_dict()

    (got, got_state), (want, want_state) = train(True), train(False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for k in want_state:
        assert torch.equal(got_state[k], want_state[k]), k


def test_select_simulates_a_fallen_back_split_and_says_where():
    from pipeline_ext import schedules as S

    why = pe.runtime.split_check(make_stages("reentrant", 2)[1], torch.randn(2, T, D))
    told = S.select(4, 8, costs=S.Costs(1.0, 1.0, 1.0), split=[None, why, None, None])
    plain = S.select(4, 8, costs=S.Costs(1.0, 1.0, 1.0))
    by_name = {c.name: c for c in told.candidates}
    assert by_name["zb_h1"].split == "falls back on stages [1]" and by_name["zbv"].split == "falls back on stages [2, 3]"
    assert by_name["1f1b"].split == "" and all(c.split == "" for c in plain.candidates)
    before = {c.name: c.makespan for c in plain.candidates}
    assert by_name["zb_h1"].makespan > before["zb_h1"] and by_name["1f1b"].makespan == before["1f1b"]
    assert told.split_reasons == {1: why} and "reentrant" in told.table() and "I/W split" in told.table()
    assert "I/W split" not in plain.table()
    assert S.select(4, 8, split=[None] * 4).chosen.split == "held"
    with pytest.raises(S.ScheduleError, match="one per rank share"):
        S.select(4, 8, split=[None, None])


def test_trace_report_says_per_stage_whether_the_split_held():
    from pipeline_ext import schedules as S
    from pipeline_ext.runtime.trace import TraceReport, Tracer

    sch = S.build("zb_h1", 2, 4)
    tracer = Tracer(0)
    tracer.note_split({0: None, 1: "it contains a reentrant torch.utils.checkpoint (use_reentrant=True), ..."})
    tracer.note_split({1: None})  # a fallback, once seen, stays
    report = TraceReport(sch, [S.simulate(sch).timeline], tracer.split)
    text = report.summary()
    assert "I/W split held on stages [0]" in text and "fell back to a whole backward at I on stage 1" in text
    assert report.chrome_trace()["traceEvents"][0]["args"]["split"] == {"0": "held", "1": tracer.split[1]}


# -- two Gloo ranks: the multi-process front end, traced ------------------------------------------------
def _mp_case(rank: int, world: int, kind: str, name: str) -> list[str]:
    """Two traced steps of ``name`` with ``kind`` stages against the unsplit model; the complaints, if any."""
    v = 2 if name in ("zbv", "dualpipev") else 1
    n, m = world * v, 4
    mine = [rank, 2 * world - 1 - rank] if v == 2 else [rank]
    modules = make_stages(kind, n)
    ref = nn.Sequential(*copy.deepcopy(modules))
    stages = [pe.PipelineStage(modules[s], s, n, "cpu") for s in mine]
    sched = pe.get_schedule_class(name)(stages if v > 1 else stages[0], m, loss_fn=nn.functional.mse_loss,
                                        trace=True)
    params = [p for s in mine for p in modules[s].parameters()]
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    bad: list[str] = []
    for step in range(2):
        x, y = batch(2 * m, seed=step)
        opt.zero_grad()
        ref_opt.zero_grad()
        losses: list[torch.Tensor] = []
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            sched.step(x if 0 in mine else None, target=y if n - 1 in mine else None, losses=losses)
        unsplit = [str(w.message) for w in said if issubclass(w.category, UnsplitBackwardWarning)]
        ref_loss = nn.functional.mse_loss(ref(x), y)
        ref_loss.backward()
        if n - 1 in mine and not torch.allclose(sum(losses) / len(losses), ref_loss.detach()):
            bad.append(f"{name} {kind} rank {rank} step {step}: loss differs")
        for s in mine:
            for a, b in zip(modules[s].parameters(), ref[s].parameters()):
                if not torch.allclose(a.grad, b.grad, rtol=1.3e-6, atol=1e-5):
                    bad.append(f"{name} {kind} stage {s} step {step}: grad differs")
        opt.step()
        ref_opt.step()
        if unsplit:
            bad.append(f"{name} {kind} rank {rank}: {unsplit}")
        offload = modules[0].offload
        if offload.unpacks != offload.packed or (kind != "pool_checkpoint" and offload.store):
            bad.append(f"{name} {kind} rank {rank} step {step}: {offload.packed} packed, {offload.unpacks} unpacked")
    if set(sched.split_report.values()) != {None}:
        bad.append(f"{name} {kind} rank {rank}: split_report {sched.split_report}")
    report = sched.trace_report(dst=0)
    if rank == 0 and (sorted(report.split) != list(range(n)) or set(report.split.values()) != {None}
                      or "I/W split held on stages" not in report.summary()):
        bad.append(f"{name} {kind}: trace split {report.split}")
    return bad


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind,name", [("sac", "zb_h1"), ("attention", "dualpipev"), ("gated", "zbv")])
def test_two_processes_split_exactly_and_trace_says_so(kind, name):
    from mp_utils import no_complaints

    no_complaints(_mp_case, 2, kind, name, timeout=150)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind,name", [("offload_checkpoint", "zb_h1"), ("pool_checkpoint", "dualpipev")])
def test_two_processes_offload_around_a_checkpoint_split_exactly(kind, name):
    """docs/schedules.md's offload pair around a plain checkpoint on two Gloo ranks: exact, split, each packed
    tensor unpacked once."""
    from mp_utils import no_complaints

    no_complaints(_mp_case, 2, kind, name, timeout=150)


def test_a_torch_whose_checkpoint_state_differs_falls_back_naming_it():
    """The SAC split reads torch's checkpoint frames and holders; anything else gets the whole backward at I."""
    from types import SimpleNamespace

    from pipeline_ext.runtime.split.obstacles import _unknown_checkpoint_internals

    frame = SimpleNamespace(recomputed={}, recomp_counter={}, is_recomputed={}, weak_holders=[])
    assert _unknown_checkpoint_internals([frame], [SimpleNamespace(handles={})]) is None
    why = _unknown_checkpoint_internals([SimpleNamespace(recomputed={}, weak_holders=[])], [SimpleNamespace()])
    assert why is not None and "is_recomputed" in why and "handles" in why and "recomp_counter" in why
