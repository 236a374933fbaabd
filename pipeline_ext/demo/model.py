"""A small GPT-style model, cut into pipeline stages, and data it can learn fast.

The demo (``python -m pipeline_ext.demo``) needs a model that looks like what
people actually pipeline (token embedding, pre-norm causal transformer blocks,
an LM head) yet trains in seconds on a CPU, and data whose loss visibly falls
within a few dozen steps. The data is arithmetic token sequences,
``x[t+1] = (x[t] + stride) mod vocab`` with a random start and a stride from a
small set per sequence: the model first learns which few tokens can follow
(the loss drops from ln(vocab) towards ln(#strides)), then reads the stride off
the context with attention (it drops further).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["GPTConfig", "gpt_stages", "gpt_layers", "synthetic_batch", "lm_loss"]


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    seq_len: int = 32
    d_model: int = 128
    heads: int = 4
    layers: int = 4
    strides: tuple[int, ...] = (1, 2, 3, 5)


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, each with a residual."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = nn.MultiheadAttention(cfg.d_model, cfg.heads, batch_first=True, dropout=0.0)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model))
        mask = torch.triu(torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool), diagonal=1)
        self.register_buffer("causal", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=self.causal[:t, :t], need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPTStage(nn.Module):
    """A contiguous slice of the model: embeddings on the first stage, the head on the last."""

    def __init__(self, cfg: GPTConfig, n_blocks: int, first: bool, last: bool) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model) if first else None
        self.pos = nn.Parameter(torch.randn(cfg.seq_len, cfg.d_model) * 0.02) if first else None
        self.blocks = nn.Sequential(*(Block(cfg) for _ in range(n_blocks)))
        self.ln_f = nn.LayerNorm(cfg.d_model) if last else None
        self.head = nn.Linear(cfg.d_model, cfg.vocab) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None:
            x = self.tok(x) + self.pos[: x.shape[1]]
        x = self.blocks(x)
        if self.head is not None:
            x = self.head(self.ln_f(x))
        return x


def gpt_stages(cfg: GPTConfig, num_stages: int, seed: int = 0) -> list[nn.Module]:
    """The model as ``num_stages`` stages with the blocks spread evenly (same weights on every rank)."""
    if cfg.layers < num_stages:
        raise ValueError(f"{cfg.layers} transformer blocks cannot fill {num_stages} stages; use more layers")
    torch.manual_seed(seed)
    per = [cfg.layers // num_stages + (1 if i < cfg.layers % num_stages else 0) for i in range(num_stages)]
    return [GPTStage(cfg, n, i == 0, i == num_stages - 1) for i, n in enumerate(per)]


def gpt_layers(cfg: GPTConfig, seed: int = 0) -> list[nn.Module]:
    """The model as a flat layer list for ``pe.balance_layers``: the embedding, each block, the final norm and head.

    Each entry is a ``GPTStage`` (no blocks for the two ends) or a block, so
    any contiguous slice run in order is a stage of the same model; the ends
    cost unlike the blocks, which is what balancing by measured cost is for.
    """
    torch.manual_seed(seed)
    return [GPTStage(cfg, 0, True, False), *(Block(cfg) for _ in range(cfg.layers)), GPTStage(cfg, 0, False, True)]


def synthetic_batch(cfg: GPTConfig, batch: int, step: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, next-token targets), each (batch, seq_len) int64; the same on every rank for a step."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, cfg.vocab, (batch, 1), generator=g)
    stride = torch.tensor(cfg.strides)[torch.randint(0, len(cfg.strides), (batch, 1), generator=g)]
    seq = (start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab
    return seq[:, :-1], seq[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
