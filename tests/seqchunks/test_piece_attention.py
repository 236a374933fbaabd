"""Sequence-piece attention (pipeline_ext.seqchunks) against the unsplit sequence, in the pipeline's order.

Every test runs what the pipeline will: the pieces' forwards in order, each
inside ``carry.active``, then their backwards in reverse, each with the
carry's extra roots, then ``release``; and compares outputs and gradients
with one forward and backward of the whole sequence.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

try:
    import transformers
except ImportError:  # the Hugging Face tests skip; the rest runs
    transformers = None

from pipeline_ext.seqchunks import (PiecesNotSupportedError, SequenceCarry, check_rope, chunked_causal_attention,
                                    current_carry, piece_positions, register_hf_attention)

TOL = dict(rtol=1e-5, atol=1e-6)
needs_hf = pytest.mark.skipif(transformers is None, reason="transformers is not installed")
SPLITS = [[11], [5, 6], [3, 5, 3], [1, 4, 2, 4]]


def _bounds(lengths):
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return [(s, s + n) for s, n in zip(starts, lengths)]


def run_pieces(lengths, forward, dout, model=None):
    """The pipeline's order on one stage: forwards 0..K-1, backwards K-1..0 with extra roots; returns the outputs.

    ``forward(carry, s, e)`` runs the piece covering positions s..e; ``dout(out, s, e)`` is its output's gradient.
    """
    carry = SequenceCarry(len(lengths), sum(lengths))
    bounds = _bounds(lengths)
    outs = []
    for p, (s, e) in enumerate(bounds):
        with carry.active(piece=p, offset=s):
            assert current_carry() is carry
            outs.append(forward(carry, s, e))
        assert current_carry() is None
        carry.check_carried(p, model)
    assert carry.held_pieces == tuple(range(len(lengths)))
    for p in reversed(range(len(lengths))):
        s, e = bounds[p]
        roots = carry.extra_roots(p)
        assert (len(roots) > 0) == (p < len(lengths) - 1)
        torch.autograd.backward([outs[p], *(t for t, _ in roots)], [dout(outs[p], s, e), *(g for _, g in roots)])
        carry.release(p)
        assert carry.held_pieces == tuple(range(p))
    return outs


def _repeat_kv(x, groups):
    return x.repeat_interleave(groups, dim=1)


# ---------------------------------------------------------------- the bare function

def _reference_attention(q, k, v, keep):
    """Eager causal attention with a key padding mask; masked scores get the dtype's minimum (no NaN)."""
    groups = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    length = q.shape[-2]
    allowed = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    if keep is not None:
        allowed = allowed & keep[:, None, None, :]
    s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
    return torch.softmax(s, -1) @ v, allowed.any(-1)  # the rows that see a key


def _key_mask(kind, length):
    """Batch row 0 left-padded by 2 (its first two queries see no key), row 1 right-padded by 3."""
    keep = torch.ones(2, length, dtype=torch.bool)
    keep[0, :2] = False
    keep[1, -3:] = False
    if kind == "additive":
        return keep, torch.zeros(2, length).masked_fill(~keep, float("-inf"))
    return keep, keep.long() if kind == "integer" else keep


@pytest.mark.parametrize("dv", [8, 6], ids=["kernel", "torch-ops"])  # values of another head size: no CPU kernel
@pytest.mark.parametrize("mask", [None, "bool", "additive", "integer", "piece_slices"])
@pytest.mark.parametrize("lengths", SPLITS, ids=str)
def test_bare_function_matches_whole_causal_attention(lengths, mask, dv):
    torch.manual_seed(0)
    length = sum(lengths)
    q = torch.randn(2, 4, length, 8, requires_grad=True)
    k = torch.randn(2, 2, length, 8, requires_grad=True)
    v = torch.randn(2, 2, length, dv, requires_grad=True)
    keep, attn_mask = _key_mask(mask, length) if mask else (None, None)
    ref, seen = _reference_attention(q, k, v, keep)
    dout = torch.randn_like(ref) * seen[..., None]  # rows that see no key: no gradient (their values differ)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)

    def forward(carry, s, e):
        m = attn_mask[:, s:e] if mask == "piece_slices" else attn_mask
        return chunked_causal_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], carry, "layer0", attn_mask=m)

    out = torch.cat(run_pieces(lengths, forward, lambda o, s, e: dout[:, :, s:e]), dim=2)
    torch.testing.assert_close(out * seen[..., None], ref * seen[..., None], **TOL)
    assert (out[~seen.expand_as(out[..., 0])] == 0).all()  # a query that sees no key gets zeros
    for got, want in zip((q.grad, k.grad, v.grad), ref_grads):
        torch.testing.assert_close(got, want, **TOL)


def test_half_precision_computes_in_float32():
    torch.manual_seed(6)
    q, k, v = (torch.randn(1, h, 9, 8, dtype=torch.bfloat16, requires_grad=True) for h in (4, 2, 2))
    full = [t.detach().float().requires_grad_() for t in (q, k, v)]
    want, _ = _reference_attention(*full, None)
    dout = torch.randn_like(want).bfloat16()
    want.backward(dout.float())
    out = torch.cat(run_pieces([2, 4, 3], lambda carry, s, e: chunked_causal_attention(
        q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], carry, 0), lambda o, s, e: dout[:, :, s:e]), dim=2)
    assert out.dtype == q.grad.dtype == k.grad.dtype == v.grad.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    for got, ref in zip((q, k, v), full):
        torch.testing.assert_close(got.grad.float(), ref.grad, rtol=5e-2, atol=5e-2)


def test_without_a_carry_it_is_causal_attention_over_its_input():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 7, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    want = F.scaled_dot_product_attention(q, _repeat_kv(k, 2), _repeat_kv(v, 2), is_causal=True)
    torch.testing.assert_close(chunked_causal_attention(q, k, v), want, **TOL)


def test_only_q_k_v_out_and_lse_are_saved():
    """Saved for the backward: the piece's q, every piece's keys and values so far, the output and the log-sum-exp."""
    torch.manual_seed(2)
    b, hq, hkv, d, lengths = 1, 4, 2, 16, [5, 3]
    q = torch.randn(b, hq, sum(lengths), d, requires_grad=True)
    k = torch.randn(b, hkv, sum(lengths), d, requires_grad=True)
    v = torch.randn(b, hkv, sum(lengths), d, requires_grad=True)
    carry = SequenceCarry(2)
    with carry.active(0):
        chunked_causal_attention(q[:, :, :5], k[:, :, :5], v[:, :, :5], carry, 0)
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.numel() * t.element_size(), t.data_ptr()))
        return t

    qp, kp, vp = q[:, :, 5:], k[:, :, 5:], v[:, :, 5:]
    with carry.active(1), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_causal_attention(qp, kp, vp, carry, 0)
    lq, lk, groups = 3, 8, hq // hkv
    assert not [s for s, _, _ in saved if len(s) >= 2 and s[-2] in (lq, groups * lq) and s[-1] in (lk, lq)]
    f32 = 4
    # the log-sum-exp per query head (torch's CPU flash kernels run each block: [Note: two blocks, torch's kernels,
    # one log-sum-exp] in seqchunks/attention.py)
    shapes = [(b, hq, lq, d), (b, hq, lq, d), (b, hq, lq)] + [(b, hkv, n, d) for n in lengths] * 2
    assert sorted((s, n) for s, n, _ in saved) == sorted((s, math.prod(s) * f32) for s in shapes)
    # the earlier piece's keys and values are saved as the carry holds them: no copy
    assert {k[:, :, :5].data_ptr(), v[:, :, :5].data_ptr(), kp.data_ptr(), vp.data_ptr()} <= {p for *_, p in saved}


# ---------------------------------------------------------------- a tiny transformer with rotary positions

def _rotary(x, positions):
    half = x.shape[-1] // 2
    freqs = positions[:, None].float() * (10000.0 ** (-torch.arange(half).float() / half))[None]
    cos, sin = freqs.cos(), freqs.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class TinyBlock(nn.Module):
    def __init__(self, layer, dim=16, hq=4, hkv=2, head=8):
        super().__init__()
        self.layer, self.hq, self.hkv, self.head = layer, hq, hkv, head
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q = nn.Linear(dim, hq * head)
        self.kv = nn.Linear(dim, 2 * hkv * head)
        self.o = nn.Linear(hq * head, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 32), nn.GELU(), nn.Linear(32, dim))

    def forward(self, x, positions, carry, pieces):
        b, length, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, length, self.hq, self.head).transpose(1, 2)
        k, v = self.kv(h).view(b, length, 2, self.hkv, self.head).permute(2, 0, 3, 1, 4)
        q, k = _rotary(q, positions), _rotary(k, positions)
        if pieces:
            a = chunked_causal_attention(q, k, v, carry, self.layer)
        else:  # the reference: torch's attention over the whole sequence
            groups = self.hq // self.hkv
            a = F.scaled_dot_product_attention(q, _repeat_kv(k, groups), _repeat_kv(v, groups), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, length, -1))
        return x + self.mlp(self.norm2(x))


class TinyModel(nn.Module):
    def __init__(self, pieces=True):
        super().__init__()
        self.pieces = pieces
        self.blocks = nn.ModuleList([TinyBlock(i) for i in range(2)])
        self.head = nn.Linear(16, 16)

    def forward(self, x, carry=None):
        positions = piece_positions(carry, x.shape[1], x.device)
        for block in self.blocks:
            x = block(x, positions, carry, self.pieces)
        return self.head(x)


@pytest.mark.parametrize("lengths", SPLITS, ids=str)
def test_tiny_transformer_matches_the_whole_sequence(lengths):
    torch.manual_seed(3)
    model = TinyModel()
    reference = copy.deepcopy(model)
    reference.pieces = False
    x = torch.randn(2, sum(lengths), 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    want = reference(x_ref)
    dout = torch.randn_like(want)
    want.backward(dout)

    outs = run_pieces(lengths, lambda carry, s, e: model(x[:, s:e], carry), lambda o, s, e: dout[:, s:e], model)
    torch.testing.assert_close(torch.cat(outs, dim=1), want, **TOL)
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, **TOL, msg=name)


# ---------------------------------------------------------------- refusals

def test_dropout_is_refused_by_name():
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    with pytest.raises(PiecesNotSupportedError, match="dropout=0.1"):
        chunked_causal_attention(q, k, v, dropout=0.1)


def test_position_dependent_rope_is_refused_by_name():
    for kind in ("dynamic", "longrope"):
        with pytest.raises(PiecesNotSupportedError, match=f"rope type '{kind}'"):
            check_rope({"rope_scaling": {"type": kind, "factor": 2.0}})
        with pytest.raises(PiecesNotSupportedError, match=f"rope type '{kind}'"):
            check_rope({"rope_parameters": {"full_attention": {"rope_type": kind}}})
    check_rope({"rope_type": "linear", "factor": 2.0})
    check_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})


def test_attention_that_ignores_the_carry_is_refused():
    tiny = TinyModel(pieces=False)
    with pytest.raises(PiecesNotSupportedError, match="does not carry sequence pieces.*chunked_causal_attention"):
        run_pieces([3, 3], lambda carry, s, e: tiny(torch.randn(1, e - s, 16), carry), None)
    run_pieces([6], lambda carry, s, e: tiny(torch.randn(1, e - s, 16), carry), lambda o, s, e: torch.ones_like(o))


def test_a_per_query_mask_is_refused():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(PiecesNotSupportedError, match="key padding mask"):
        chunked_causal_attention(q, q, q, attn_mask=torch.ones(1, 1, 4, 4, dtype=torch.bool))


def test_the_carry_refuses_another_order():
    carry = SequenceCarry(2)
    x = torch.randn(1, 2, 3, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="in order"):
        with carry.active(1, offset=3):
            pass
    with carry.active(0):
        chunked_causal_attention(x, x, x, carry, 0)
    with pytest.raises(RuntimeError, match="before every piece ran its forward"):
        carry.extra_roots(0)
    with pytest.raises(ValueError, match="offset 2, but layer 0 holds 3"):
        with carry.active(1, offset=2):
            chunked_causal_attention(x, x, x, carry, 0)
    with pytest.raises(RuntimeError, match="reverse order"):
        carry.release(0)
    with pytest.raises(RuntimeError, match="outside"):
        chunked_causal_attention(x, x, x, carry, 0)


# ---------------------------------------------------------------- a Hugging Face Llama, register_hf_attention

def _llama(**config):
    torch.manual_seed(4)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **config)
    return transformers.LlamaForCausalLM(cfg).eval()


def _hf_pieces(model, ids, mask, lengths, mask_mode=None):
    """The model run piece by piece: per-piece logits, with the loss of labels shifted before the split."""
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    if mask is not None:
        labels = labels.masked_fill(mask == 0, -100)
    count = (labels != -100).sum()
    logits = []

    def forward(carry, s, e):
        m = None if mask is None else (mask[:, s:e] if mask_mode == "piece_slices" else mask)
        piece_logits = model(input_ids=ids[:, s:e], attention_mask=m, use_cache=False,
                             position_ids=piece_positions(carry, e - s, ids.device)[None]).logits
        logits.append(piece_logits)
        return F.cross_entropy(piece_logits.flatten(0, 1), labels[:, s:e].flatten(), reduction="sum") / count

    losses = run_pieces(lengths, forward, lambda o, s, e: torch.ones_like(o), model)
    return sum(losses), torch.cat(logits, dim=1), labels, count


@needs_hf
@pytest.mark.parametrize("mask_mode", [None, "whole", "piece_slices"])
@pytest.mark.parametrize("lengths", [[12], [4, 5, 3]], ids=str)
def test_hf_llama_pieces_match_the_unsplit_model(lengths, mask_mode):
    name = register_hf_attention()
    reference = _llama()
    model = copy.deepcopy(reference)
    model.set_attn_implementation(name)
    reference.set_attn_implementation("eager")
    assert model.config._attn_implementation == name != reference.config._attn_implementation
    torch.manual_seed(5)
    ids = torch.randint(0, 64, (2, sum(lengths)))
    mask = None
    if mask_mode:
        mask = torch.ones_like(ids)
        mask[0, :2] = 0  # left padding: its first queries see no key
        mask[1, -3:] = 0  # right padding
    loss, logits, labels, count = _hf_pieces(model, ids, mask, lengths, mask_mode)

    want_logits = reference(input_ids=ids, attention_mask=mask).logits
    want = F.cross_entropy(want_logits.flatten(0, 1), labels.flatten(), reduction="sum") / count
    want.backward()
    valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    torch.testing.assert_close(loss, want, **TOL)
    torch.testing.assert_close(logits[valid], want_logits[valid], **TOL)
    for (n, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, **TOL, msg=n)
    # outside a carry the implementation is causal attention over the whole input
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits[valid], want_logits[valid], **TOL)


@needs_hf
def test_hf_refuses_what_pieces_cannot_carry():
    name = register_hf_attention()
    ids = torch.zeros(1, 6, dtype=torch.long)
    model = _llama(attention_dropout=0.1).train()
    model.set_attn_implementation(name)
    with pytest.raises(PiecesNotSupportedError, match="dropout=0.1"):
        model(input_ids=ids)
    model = _llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    model.set_attn_implementation(name)
    with pytest.raises(PiecesNotSupportedError, match="rope type 'dynamic'"):
        _hf_pieces(model, ids, None, [3, 3])
    check_rope(_llama().config)
    model = _llama()
    model.set_attn_implementation(name)
    with pytest.raises(PiecesNotSupportedError, match="packed sequences"):
        model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]), use_cache=False)
    carry = SequenceCarry(2)
    with carry.active(0):
        model(input_ids=ids[:, :3], position_ids=piece_positions(carry, 3)[None])
    with carry.active(1), pytest.raises(ValueError, match="position_ids starting at 0.*piece_positions"):
        model(input_ids=ids[:, 3:])  # HF's own positions: arange(3), the sequence's start


@needs_hf
def test_hf_attention_that_ignores_the_carry_is_refused():
    model = _llama()
    model.set_attn_implementation("sdpa")
    ids = torch.zeros(1, 6, dtype=torch.long)
    with pytest.raises(PiecesNotSupportedError, match=r"does not carry sequence pieces \(this model's "
                                                      r"attn_implementation is 'sdpa'\).*register_hf_attention"):
        _hf_pieces(model, ids, None, [3, 3])
    _hf_pieces(model, ids, None, [6])  # one piece: nothing to carry
