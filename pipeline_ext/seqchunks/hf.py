"""Sequence-piece attention as a Hugging Face ``attn_implementation``.

``register_hf_attention(name)`` registers ``hf_piece_attention`` with
``transformers.AttentionInterface`` and ``hf_piece_mask`` with
``transformers.masking_utils.AttentionMaskInterface``: without a mask function
of its own, a custom implementation gets no mask from ``create_causal_mask``,
and padding would be dropped. The mask function hands the 2-D key padding
mask through as it is; the attention masks causally itself.

The carry comes from the context: the pipeline runs each piece's forward in
``with carry.active(piece=p, offset=o):`` and the attention takes
``current_carry()``, with ``module.layer_idx`` as the layer id (the module
itself where it has none). Outside ``active`` it is causal attention over the
whole input, so the same model runs unsplit. Each piece's ``position_ids``
must be its own positions (``piece_positions``).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from pipeline_ext.seqchunks.attention import chunked_causal_attention
from pipeline_ext.seqchunks.carry import DEFAULT_HF_NAME, PiecesNotSupportedError, check_rope, current_carry

__all__ = ["register_hf_attention", "hf_piece_attention", "hf_piece_mask"]

#: attention keyword arguments of other mask patterns or score terms than causal + key padding
_REFUSED_KWARGS = ("sliding_window", "softcap", "s_aux", "position_bias", "cu_seq_lens_q", "cu_seq_lens_k")


#: the names ``register_hf_attention`` registered in this process
_REGISTERED: set[str] = set()


def hf_attention_not_carrying(module: torch.nn.Module) -> Optional[str]:
    """The ``attn_implementation`` of a Hugging Face model in ``module`` whose attention does not carry pieces
    (not a name ``register_hf_attention`` registered), else None: a pipeline refuses such a stage when it is
    built, on every rank, before any step."""
    for m in module.modules():
        impl = getattr(getattr(m, "config", None), "_attn_implementation", None)
        if isinstance(impl, str) and impl not in _REGISTERED:
            return impl
    return None


def register_hf_attention(name: str = DEFAULT_HF_NAME) -> str:
    """Registers the piece attention (and its mask function) under ``name``; returns ``name``.

    Then ``model.set_attn_implementation(name)`` (or the config's
    ``attn_implementation``) makes a model's attention carry pieces.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(name, hf_piece_attention)
    _REGISTERED.add(name)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # older transformers: the model builds a 4-D causal mask, which the attention refuses
        pass
    else:
        AttentionMaskInterface.register(name, hf_piece_mask)
    return name


def hf_piece_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                       dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` function: query (B, Hq, L, D), key/value (B, Hkv, L, D) -> ((B, L, Hq, D), None)."""
    refused = [n for n in _REFUSED_KWARGS if kwargs.get(n) is not None]
    if getattr(module, "sliding_window", None) is not None and "sliding_window" not in refused:
        refused.append("sliding_window")
    if refused:
        raise PiecesNotSupportedError(f"{type(module).__name__} passes {refused} to its attention: sequence pieces "
                                      f"carry causal attention with a key padding mask only")
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        raise PiecesNotSupportedError(f"{type(module).__name__} is bidirectional (is_causal=False): sequence pieces "
                                      f"carry causal attention only")
    carry = current_carry()
    if carry is not None and carry.pieces > 1:
        config = getattr(module, "config", None)
        if config is not None:
            check_rope(config)
        if not carry.recorded_layers:  # once per piece: it reads a value off the device
            _check_positions(kwargs.get("position_ids"), carry.offset)
    layer = getattr(module, "layer_idx", None)
    out = chunked_causal_attention(query, key, value, carry, module if layer is None else layer, scaling,
                                   attn_mask=attention_mask, dropout=dropout)
    return out.transpose(1, 2).contiguous(), None


def _check_positions(position_ids: Optional[torch.Tensor], offset: int) -> None:
    """Refuses a later piece whose positions restart at 0: rotary embeddings would see the sequence's start."""
    if offset > 0 and position_ids is not None and bool((position_ids[..., :1] == 0).all()):
        raise ValueError(f"a piece at offset {offset} has position_ids starting at 0: pass each piece's own "
                         f"positions (pipeline_ext.seqchunks.piece_positions(carry, length, device))")


def hf_piece_mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: Any = 0,
                  mask_function: Any = None, attention_mask: Optional[torch.Tensor] = None,
                  **kwargs: Any) -> Optional[torch.Tensor]:
    """The ``AttentionMaskInterface`` function: the 2-D key padding mask as it came (or None), causal left to us."""
    from transformers.masking_utils import causal_mask_function

    if mask_function is not None and mask_function is not causal_mask_function:
        raise PiecesNotSupportedError(
            "the model asks for a mask other than causal + key padding (packed sequences, i.e. position_ids "
            "restarting within a row, a sliding window, or an added mask pattern): sequence pieces do not carry it")
    if not (isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == kv_offset == 0):
        raise PiecesNotSupportedError("a cache (query or key offsets) with sequence pieces: pieces are for "
                                      "training, where the carry holds the earlier pieces' keys")
    return attention_mask
