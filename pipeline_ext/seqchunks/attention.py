"""Causal attention of one piece's queries over the keys of pieces 0..now, block by block, merged by log-sum-exp.

Block ``j < now`` (an earlier piece's keys) is attended unmasked, the diagonal
block (the piece's own keys) causally, aligned bottom-right: query ``i`` of
the piece is at absolute position ``offset + i`` and sees the keys up to it.
The blocks' softmaxes are merged online (running max and sum), so the result
is the softmax over all keys so far. Only q, the keys and values, the output
and the log-sum-exp are saved (and the (B, N) key padding bias, if any): no
queries x keys matrix; the backward recomputes each block's probabilities
from the log-sum-exp (flash attention's backward, in torch ops), so forward
and backward each do the work of causal attention over the whole sequence,
split by rows.
"""
from __future__ import annotations

from collections.abc import Hashable
from typing import Optional

import torch

from pipeline_ext.seqchunks.carry import PiecesNotSupportedError, SequenceCarry

__all__ = ["chunked_causal_attention"]


def chunked_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             carry: Optional[SequenceCarry] = None, layer: Optional[Hashable] = None,
                             scale: Optional[float] = None, *, attn_mask: Optional[torch.Tensor] = None,
                             dropout: float = 0.0) -> torch.Tensor:
    """Causal attention of the running piece's queries over the keys of every piece up to it.

    ``q``: (B, Hq, L, D), the piece's queries; ``k``, ``v``: (B, Hkv, L, D)
    and (B, Hkv, L, Dv), the piece's keys (after rotary embedding) and values,
    before grouped-query expansion (``Hq`` a multiple of ``Hkv``; the
    gradients come back per kv head). Returns (B, Hq, L, Dv).

    ``carry``/``layer``: the sequence's carry and this attention layer's id
    (unique on the stage); the piece's (k, v) are recorded in it. Without a
    carry this is causal attention over ``q``, ``k``, ``v`` alone.
    ``scale`` defaults to ``D ** -0.5``.

    ``attn_mask``: a key padding mask, (B, N) or (B, 1, 1, N): bool or
    integer (true/nonzero: attend) or float (added to the scores). It covers
    either the whole sequence (or at least up to the piece's last key; the
    piece's part is taken at its offset) or the piece's keys alone; earlier
    pieces' parts come from the carry. A padded key is masked for every query;
    a query that sees no key gets zeros. ``dropout`` must be 0.
    """
    if dropout:
        raise PiecesNotSupportedError(f"dropout={dropout} on the attention probabilities: sequence-piece attention "
                                      f"supports dropout 0 only")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v are (B, H, L, D); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    (b, hq, lq, d), (bk, hkv, lk, dk) = q.shape, k.shape
    if bk != b or v.shape[:3] != k.shape[:3] or dk != d or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: k and v need q's batch, "
                         f"k q's head dim, and the kv heads must divide the query heads")
    if lq != lk:
        raise ValueError(f"a piece's queries and keys are the same positions: {lq} queries, {lk} keys")
    if carry is not None and layer is None:
        raise ValueError("with a carry, pass the attention layer's id (layer=)")
    scale = d ** -0.5 if scale is None else float(scale)
    offset = 0 if carry is None else carry.offset
    cdt = _compute_dtype(q.dtype)
    bias = _piece_key_bias(attn_mask, b, offset, lk, cdt)
    if carry is None:
        ks, vs, biases = [k], [v], [bias]
    else:
        ks, vs, biases = carry.join(layer, k, v, bias)
    key_bias = None  # (B, keys so far); a piece without a mask has no padded key
    if any(x is not None for x in biases):
        key_bias = torch.cat([torch.zeros(b, kk.shape[-2], dtype=cdt, device=q.device) if x is None else x.to(q.device)
                              for x, kk in zip(biases, ks)], dim=-1)
    return _PieceAttention.apply(q, key_bias, scale, len(ks), *ks, *vs)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _piece_key_bias(mask: Optional[torch.Tensor], batch: int, offset: int, length: int, dtype: torch.dtype
                    ) -> Optional[torch.Tensor]:
    """The additive (B, length) bias of the piece's keys from a key padding mask, or None."""
    if mask is None:
        return None
    if mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1:
        mask = mask[:, 0, 0]
    if mask.dim() != 2:
        raise PiecesNotSupportedError(
            f"an attention mask of shape {tuple(mask.shape)}: sequence pieces take a key padding mask, (B, N) or "
            f"(B, 1, 1, N); a per-query mask cannot be cut into pieces")
    if mask.shape[0] not in (1, batch):
        raise ValueError(f"a key padding mask for {mask.shape[0]} sequences, the batch has {batch}")
    n = mask.shape[-1]
    if n >= offset + length:
        mask = mask[:, offset:offset + length]
    elif n != length:
        raise ValueError(f"a key padding mask of {n} keys for a piece at {offset}..{offset + length}: it must cover "
                         f"the sequence up to the piece's end, or be the piece's part alone")
    if mask.dtype.is_floating_point:
        return mask.to(dtype).expand(batch, length)
    keep = mask.to(torch.bool).expand(batch, length)
    return torch.zeros((), dtype=dtype, device=mask.device).masked_fill(~keep, float("-inf"))


def _block_scores(qf: torch.Tensor, kj: torch.Tensor, scale: float, bias: Optional[torch.Tensor], diagonal: bool,
                  groups: int) -> torch.Tensor:
    """(B, Hkv, G*Lq, Lj) scores of the queries (heads of a kv group folded into rows) against one block's keys."""
    s = torch.matmul(qf, kj.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias[:, None, None, :]
    if diagonal:  # the piece's own keys: query i sees keys 0..i of the piece (bottom-right aligned)
        lq, lj = s.shape[-2] // groups, s.shape[-1]
        above = torch.ones(lq, lj, dtype=torch.bool, device=s.device).triu(lj - lq + 1)
        s = s.unflatten(-2, (groups, lq)).masked_fill(above, float("-inf")).flatten(-3, -2)
    return s


class _PieceAttention(torch.autograd.Function):
    """Inputs: q, key_bias (B, N) or None, scale, n blocks, then the n blocks' keys and the n blocks' values."""

    #: no weights, and a backward that only reads what it saved: the zero-bubble split may run it at I and at W
    #: (``pipeline_ext.runtime.split.RERUNNABLE_BACKWARD``, spelt out: this package sits below the runtime)
    pipeline_ext_rerunnable_backward = True

    @staticmethod
    def forward(ctx, q, key_bias, scale, n, *kv):  # type: ignore[override]
        if _flash_ok(q, kv):
            return _flash_forward(ctx, q, key_bias, scale, n, kv)
        ctx.flash = False
        ks, vs = kv[:n], kv[n:]
        b, hq, lq, d = q.shape
        hkv = ks[0].shape[1]
        groups = hq // hkv
        cdt = _compute_dtype(q.dtype)
        qf = q.reshape(b, hkv, groups * lq, d).to(cdt)
        dv = vs[0].shape[-1]
        m = torch.full((b, hkv, groups * lq, 1), float("-inf"), dtype=cdt, device=q.device)
        total = torch.zeros_like(m)
        acc = torch.zeros(b, hkv, groups * lq, dv, dtype=cdt, device=q.device)
        start = 0
        for j, (kj, vj) in enumerate(zip(ks, vs)):
            lj = kj.shape[-2]
            if lj:
                bias = None if key_bias is None else key_bias[:, start:start + lj]
                s = _block_scores(qf, kj.to(cdt), scale, bias, j == n - 1, groups)
                m_new = torch.maximum(m, s.amax(-1, keepdim=True))
                ref = m_new.masked_fill(m_new == float("-inf"), 0.0)  # rows that saw only masked keys so far
                p = torch.exp(s - ref)
                alpha = torch.exp(m - ref)
                total = total * alpha + p.sum(-1, keepdim=True)
                acc = acc * alpha + torch.matmul(p, vj.to(cdt))
                m = m_new
            start += lj
        ref = m.masked_fill(m == float("-inf"), 0.0)
        lse = (ref + torch.log(total)).squeeze(-1)  # -inf where a query saw no key
        out = torch.where(total > 0, acc / total, torch.zeros((), dtype=cdt, device=q.device))
        out = out.reshape(b, hq, lq, dv).to(q.dtype)
        ctx.scale, ctx.n, ctx.groups = scale, n, groups
        ctx.save_for_backward(q, key_bias, out, lse, *ks, *vs)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        if ctx.flash:
            return _flash_backward(ctx, dout)
        q, key_bias, out, lse, *kv = ctx.saved_tensors
        n, scale, groups = ctx.n, ctx.scale, ctx.groups
        ks, vs = kv[:n], kv[n:]
        b, hq, lq, d = q.shape
        hkv, dv = ks[0].shape[1], vs[0].shape[-1]
        cdt = _compute_dtype(q.dtype)
        qf = q.reshape(b, hkv, groups * lq, d).to(cdt)
        do = dout.reshape(b, hkv, groups * lq, dv).to(cdt)
        delta = (do * out.reshape(b, hkv, groups * lq, dv).to(cdt)).sum(-1, keepdim=True)
        # a query that saw no key: exp(S - inf) = 0, no gradient
        lse = lse.masked_fill(lse == float("-inf"), float("inf")).unsqueeze(-1)
        need_k = ctx.needs_input_grad[4:4 + n]
        need_v = ctx.needs_input_grad[4 + n:]
        dq = torch.zeros_like(qf) if ctx.needs_input_grad[0] else None
        dks: list = [None] * n
        dvs: list = [None] * n
        start = 0
        for j, (kj, vj) in enumerate(zip(ks, vs)):
            lj = kj.shape[-2]
            if lj:
                kc, vc = kj.to(cdt), vj.to(cdt)
                bias = None if key_bias is None else key_bias[:, start:start + lj]
                p = torch.exp(_block_scores(qf, kc, scale, bias, j == n - 1, groups) - lse)
                if need_v[j]:
                    dvs[j] = torch.matmul(p.transpose(-1, -2), do).to(vj.dtype)
                ds = p * (torch.matmul(do, vc.transpose(-1, -2)) - delta)
                if dq is not None:
                    dq += torch.matmul(ds, kc)
                if need_k[j]:
                    dks[j] = (torch.matmul(ds.transpose(-1, -2), qf) * scale).to(kj.dtype)
            else:
                dks[j] = torch.zeros_like(kj) if need_k[j] else None
                dvs[j] = torch.zeros_like(vj) if need_v[j] else None
            start += lj
        if dq is not None:
            dq = (dq * scale).reshape(b, hq, lq, d).to(q.dtype)
        return (dq, None, None, None, *dks, *dvs)


# -- the CPU path: torch's flash attention kernels per block ----------------------------------------------------
# [Note: two blocks, torch's kernels, one log-sum-exp]
# On CPU, torch's flash attention kernel (``_scaled_dot_product_flash_attention_for_cpu``) computes a block's
# output and log-sum-exp without materialising the scores, and its backward takes the output and log-sum-exp
# to use: given the merged ones, it gives exactly that block's share of the whole softmax's gradient. So a
# piece is two kernel calls: the earlier pieces' keys, unmasked, and its own keys, causal (as many queries as
# keys: the kernel's top-left alignment is the bottom-right one here); merged by log-sum-exp. The kernel
# reports a log-sum-exp of 0 for a query that sees no key of a block (every key padded); that query's block
# weight is set to 0 from the mask. Grouped-query heads: the earlier keys are unmasked for every query, so
# the query heads of one kv head are folded into rows ((B, Hkv, G*Lq, D) against (B, Hkv, N, D)): no copy of
# the earlier keys per query head, and their gradients come back per kv head as they are. The piece's own
# block is causal by row, so there the kv heads are expanded and their gradients summed back.
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _flash_ok(q: torch.Tensor, kv: tuple) -> bool:
    return (_FLASH is not None and _FLASH_BACKWARD is not None and q.device.type == "cpu"
            and q.dtype in (torch.float32, torch.float64)
            and all(t.dtype == q.dtype and t.shape[-1] == q.shape[-1] for t in kv))  # the kernel: one head size


def _blocks(key_bias: Optional[torch.Tensor], n_prev: int, b: int, lq: int
            ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Per block (earlier keys, the piece's keys): the kernel's additive mask (B, 1, 1, keys) and which queries
    see at least one key of it ((B, 1, Lq) bool), None where nothing is padded."""
    if key_bias is None:
        return None, None, None, None
    prev, diag = key_bias[:, :n_prev], key_bias[:, n_prev:]
    seen_prev = (prev > float("-inf")).any(-1)[:, None, None].expand(b, 1, lq) if n_prev else None
    seen_diag = (diag > float("-inf")).cummax(-1).values[:, None, :]
    return (prev[:, None, None, :] if n_prev else None), diag[:, None, None, :], seen_prev, seen_diag


def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hq, L, ...) as (B, Hkv, G*L, ...): the query heads of one kv head as rows of one head."""
    return t if groups == 1 else t.reshape(t.shape[0], t.shape[1] // groups, groups * t.shape[2], *t.shape[3:])


def _unfold(t: torch.Tensor, groups: int) -> torch.Tensor:
    """``_fold`` undone: (B, Hkv, G*L, ...) as (B, Hq, L, ...)."""
    return t if groups == 1 else t.reshape(t.shape[0], t.shape[1] * groups, t.shape[2] // groups, *t.shape[3:])


def _flash_forward(ctx, q, key_bias, scale, n, kv):
    ks, vs = kv[:n], kv[n:]
    b, hq, lq, _ = q.shape
    groups = hq // ks[0].shape[1]
    n_prev = sum(k.shape[-2] for k in ks[:-1])
    mask_prev, mask_diag, seen_prev, seen_diag = _blocks(key_bias, n_prev, b, lq)
    out, lse = _FLASH(q, _expand(ks[-1], groups), _expand(vs[-1], groups), 0.0, True, attn_mask=mask_diag,
                      scale=scale)
    if seen_diag is not None:
        lse = lse.masked_fill(~seen_diag, float("-inf"))
    if n_prev:
        out_p, lse_p = _FLASH(_fold(q, groups), torch.cat(ks[:-1], dim=-2), torch.cat(vs[:-1], dim=-2), 0.0, False,
                              attn_mask=mask_prev, scale=scale)
        out_p, lse_p = _unfold(out_p, groups), _unfold(lse_p, groups)
        if seen_prev is not None:
            lse_p = lse_p.masked_fill(~seen_prev, float("-inf"))
        both = torch.logaddexp(lse, lse_p)
        if key_bias is None:  # every query sees its own key: both log-sum-exps are finite
            out = torch.lerp(out_p, out, torch.exp(lse - both)[..., None])
        else:
            finite = both > float("-inf")
            w_diag = torch.where(finite, torch.exp(lse - both), torch.zeros((), dtype=q.dtype))
            w_prev = torch.where(finite, torch.exp(lse_p - both), torch.zeros((), dtype=q.dtype))
            out = out * w_diag[..., None] + out_p * w_prev[..., None]
        lse = both
    if key_bias is not None:  # a query that saw no key (every key padded) gets zeros
        out = torch.where((lse > float("-inf"))[..., None], out, torch.zeros((), dtype=q.dtype))
    ctx.flash, ctx.scale, ctx.n, ctx.groups = True, scale, n, groups
    ctx.save_for_backward(q, key_bias, out, lse, *ks, *vs)
    return out


def _flash_backward(ctx, dout):
    q, key_bias, out, lse, *kv = ctx.saved_tensors
    n, scale, groups = ctx.n, ctx.scale, ctx.groups
    ks, vs = kv[:n], kv[n:]
    b, hq, lq, _ = q.shape
    n_prev = sum(k.shape[-2] for k in ks[:-1])
    mask_prev, mask_diag, _, _ = _blocks(key_bias, n_prev, b, lq)
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))  # a query that saw no key: no gradient
    dout = dout.contiguous()

    def summed(g: torch.Tensor) -> torch.Tensor:  # expanded heads' gradients summed back per kv head
        return g if groups == 1 else g.unflatten(1, (-1, groups)).sum(2)

    dq, dk, dv = _FLASH_BACKWARD(dout, q, _expand(ks[-1], groups), _expand(vs[-1], groups), out, lse, 0.0, True,
                                 attn_mask=mask_diag, scale=scale)
    dks, dvs = [None] * (n - 1) + [summed(dk)], [None] * (n - 1) + [summed(dv)]
    if n_prev:
        dq_p, dk_p, dv_p = _FLASH_BACKWARD(_fold(dout, groups), _fold(q, groups), torch.cat(ks[:-1], dim=-2),
                                           torch.cat(vs[:-1], dim=-2), _fold(out, groups), _fold(lse, groups), 0.0,
                                           False, attn_mask=mask_prev, scale=scale)
        dq = dq + _unfold(dq_p, groups)
        sizes = [k.shape[-2] for k in ks[:-1]]
        dks[:-1] = list(dk_p.split(sizes, dim=-2))
        dvs[:-1] = list(dv_p.split(sizes, dim=-2))
    need = ctx.needs_input_grad
    dks = [g if need[4 + j] else None for j, g in enumerate(dks)]
    dvs = [g if need[4 + n + j] else None for j, g in enumerate(dvs)]
    return (dq if need[0] else None, None, None, None, *dks, *dvs)
