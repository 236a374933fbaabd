"""What the whole suite shares: small models cut into stages, the unsplit references, tolerances, the SAC policy.

Each factory returns ``num_stages`` modules that, applied in order, form the
unsplit reference model. They cover what pipelines get wrong: LayerNorm and
residuals (transformer blocks), stages that pass a tuple of tensors, and an
integer tensor that travels without a gradient. ``unsplit`` and ``reference``
run that model on the whole batch; ``TOL`` is how close a pipeline must come
to it in fp32 (``GPU_TOL`` on a GPU, where kernels reorder sums). Test files
live in feature folders below ``tests/``; ``ROOT`` is the repository.
"""
from __future__ import annotations

import copy
import contextlib
import os
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
from torch import nn

from mp_utils import device_under_test

D = 16

#: the repository's root (test files sit one folder below tests/)
ROOT = Path(__file__).resolve().parents[1]
#: how close a pipeline's loss, gradients and parameters must be to the unsplit model's, in fp32 on CPU
TOL = dict(rtol=1e-5, atol=1e-6)
RTOL, ATOL = TOL["rtol"], TOL["atol"]
#: the same on a GPU (its kernels sum in other orders than the reference's)
GPU_TOL = dict(rtol=1e-4, atol=1e-5)


def shm_names() -> set[str]:
    """This library's shared-memory segments now in /dev/shm (a test that made some checks they went)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith("pipeline_ext")} if os.path.isdir("/dev/shm") else set()


class Block(nn.Module):
    """Pre-norm transformer block: attention and MLP, each with a residual."""

    def __init__(self, d: int = D, heads: int = 2) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True, dropout=0.0)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class BlockStage(nn.Module):
    def __init__(self, last: bool = False) -> None:
        super().__init__()
        self.block = Block()
        self.head = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 4)) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block(x)
        return self.head(x.mean(dim=1)) if self.head is not None else x


class TupleStage(nn.Module):
    """Takes and returns (activations, skip); the first also emits integer bucket ids."""

    def __init__(self, first: bool = False, last: bool = False) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.lin = nn.Linear(D, D)
        self.emb = nn.Embedding(3, D)
        self.out = nn.Linear(D, 4) if last else None

    def forward(self, x: torch.Tensor, skip: torch.Tensor | None = None, ids: torch.Tensor | None = None):
        if self.first:
            skip, ids = x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
        h = torch.tanh(self.lin(x)) + 0.5 * skip + self.emb(ids)
        if self.last:
            return self.out(h)
        return h, skip, ids


def mlp(num_stages: int) -> list[nn.Module]:
    head = [nn.Linear(D, 4)]
    return [nn.Sequential(nn.Linear(D, D), nn.ReLU(), *(head if i == num_stages - 1 else [])) for i in range(num_stages)]


def blocks(num_stages: int) -> list[nn.Module]:
    return [BlockStage(last=i == num_stages - 1) for i in range(num_stages)]


def tuples(num_stages: int) -> list[nn.Module]:
    return [TupleStage(first=i == 0, last=i == num_stages - 1) for i in range(num_stages)]


MODELS: dict[str, Callable[[int], list[nn.Module]]] = {"mlp": mlp, "blocks": blocks, "tuple": tuples}


def make_batch(model: str, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded batch (drawn on the CPU, the same numbers everywhere) on the test's device."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, D, generator=g) if model == "blocks" else torch.randn(n, D, generator=g)
    return x.to(device_under_test()), torch.randn(n, 4, generator=g).to(device_under_test())


def build(model: str, num_stages: int, seed: int = 0) -> list[nn.Module]:
    """The seeded stages (initialised on the CPU, the same weights everywhere) on the test's device."""
    torch.manual_seed(seed)
    return [m.to(device_under_test()) for m in MODELS[model](num_stages)]


def run_stages(stages: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    out = x
    for s in stages:
        out = s(*out) if isinstance(out, tuple) else s(out)
    return out


def unsplit(stages: Sequence[nn.Module], x: torch.Tensor, y: torch.Tensor, loss: Callable = None,
            device: Optional[str] = None, autocast=contextlib.nullcontext) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss and parameter gradients (in order, flat) of copies of ``stages`` run in order on the whole batch."""
    ref = [copy.deepcopy(s) if device is None else copy.deepcopy(s).to(device) for s in stages]
    if device is not None:
        x, y = x.to(device), y.to(device)
    with autocast():
        out = (loss or loss_fn)(run_stages(ref, x), y)
    out.backward()
    return out.detach(), [p.grad for s in ref for p in s.parameters()]


def reference(model: str, num_stages: int, x: torch.Tensor, y: torch.Tensor, seed: int = 0):
    """Loss and per-stage parameter gradients of the unsplit model on the whole batch."""
    stages = build(model, num_stages, seed)
    loss = nn.functional.mse_loss(run_stages(stages, x), y)
    loss.backward()
    return loss.detach(), [[p.grad.clone() for p in s.parameters()] for s in stages], copy.deepcopy(stages)


loss_fn = nn.functional.mse_loss

#: the ops selective activation checkpointing keeps (their outputs are saved; everything else is recomputed)
SAC_SAVED = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def sac_policy(ctx, func, *args, **kwargs):
    """The suite's selective-checkpointing policy: matmul outputs saved, the rest (dropout included) recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if func in SAC_SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def sac_context():
    """``context_fn`` for ``torch.utils.checkpoint``: selective activation checkpointing under ``sac_policy``."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(sac_policy)


class SplitRun(NamedTuple):
    """What an I/W split did, read right after I (``split_vs_whole``)."""

    unsplit: Optional[str]  # why I ran the whole backward (None: it split)
    branches: int  # weight branches W re-enters
    fallback: bool  # W is one backward over the parameters (weight-only subgraphs overlap)
    no_weight_grad_after_i: bool  # every parameter's .grad was still None after I


def split_vs_whole(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: Sequence[torch.Tensor],
                   reference: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> SplitRun:
    """I then W (``runtime/split/backward.py``) on ``run(x)``, against one whole backward of ``reference`` (default
    ``run``) on a copy of ``x``: the input's and every parameter's gradient must match. ``params`` start with no
    ``.grad``; they are left with the reference's."""
    from pipeline_ext.runtime.split import backward_input, backward_weight

    out = run(x)
    g = torch.randn_like(out)
    (gx,), deferred = backward_input([out], [g], [x])
    after_i = SplitRun(deferred.unsplit, len(deferred.branches), deferred.fallback_params is not None,
                       all(p.grad is None for p in params))
    backward_weight(deferred)
    got = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    x2 = x.detach().clone().requires_grad_(True)
    (reference or run)(x2).backward(g)
    torch.testing.assert_close(gx, x2.grad)
    for a, p in zip(got, params):
        torch.testing.assert_close(a, p.grad)
    return after_i


# -- shared by the sequence-piece tests and benchmarks/bench_long_context.py ----------------------------------
def rotary(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (..., L, D) at ``positions`` (L,): a piece's own positions, not 0..L-1."""
    half = x.shape[-1] // 2
    freqs = positions[:, None].float() * (10000.0 ** (-torch.arange(half).float() / half))[None]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat([x[..., :half] * cos - x[..., half:] * sin, x[..., :half] * sin + x[..., half:] * cos], dim=-1)


class PieceBlock(nn.Module):
    """Pre-norm block: grouped-query causal attention with rotary positions, carried across sequence pieces
    (``pipeline_ext.seqchunks``: outside a pipeline the carry is None and it is plain causal attention), an MLP."""

    def __init__(self, layer: int, dim: int = 16, hq: int = 4, hkv: int = 2, head: int = 4, mlp: int = 2) -> None:
        super().__init__()
        self.layer, self.hq, self.hkv, self.head = layer, hq, hkv, head
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.kv = nn.Linear(dim, hq * head), nn.Linear(dim, 2 * hkv * head)
        self.o = nn.Linear(hq * head, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp * dim), nn.GELU(), nn.Linear(mlp * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from pipeline_ext.seqchunks import chunked_causal_attention, current_carry, piece_positions

        b, length, _ = x.shape
        carry = current_carry()
        positions = piece_positions(carry, length, x.device)
        h = self.norm1(x)
        q = self.q(h).view(b, length, self.hq, self.head).transpose(1, 2)
        k, v = self.kv(h).view(b, length, 2, self.hkv, self.head).permute(2, 0, 3, 1, 4)
        a = chunked_causal_attention(rotary(q, positions), rotary(k, positions), v, carry, self.layer)
        x = x + self.o(a.transpose(1, 2).reshape(b, length, -1))
        return x + self.mlp(self.norm2(x))


# -- shared by the FSDP budget test and benchmarks/bench_fsdp_budget.py ----------------------------------------
def unsharded_bytes(groups: Sequence[Any]) -> int:
    """Bytes held now in FSDP2 groups' unsharded parameters (their storage: FSDP frees it by resizing to 0) plus
    their unsharded gradients: what a parameter budget bounds, without FSDP's transient communication buffers."""
    seen, total = set(), 0
    for g in groups:
        for fp in g.fsdp_params:
            up = getattr(fp, "_unsharded_param", None)
            if up is None:
                continue
            st = up.untyped_storage()
            if st.nbytes() and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
            if up.grad is not None:
                total += up.grad.numel() * up.grad.element_size()
    return total
