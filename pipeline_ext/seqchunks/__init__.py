"""Causal attention over a sequence cut into pieces (Seq1F1B): each piece attends to itself and the pieces before it.

A pipeline cuts each microbatch (one long sequence) into K pieces along the
sequence and runs their forwards in order 0..K-1 and their backwards in
reverse, K-1..0, on every stage. Piece p's queries attend to the keys and
values of pieces 0..p. This package is that attention; it imports only torch
(transformers lazily, for the Hugging Face hook).

* ``SequenceCarry`` (``carry.py``) holds, per microbatch per stage and per
  attention layer, each piece's keys and values until that piece's own
  backward. A later piece joins a *detached leaf* of them
  (``detach().requires_grad_()``), not the tensors of the earlier piece's
  graph: the later piece's backward then stops at the leaf, leaving its share
  of the gradient in ``.grad`` (summed over all later pieces), instead of
  running the earlier piece's graph before that piece's own backward (and
  again for each later piece). The earlier piece's backward adds those
  gradients as extra roots (``extra_roots``): one backward per piece, each
  graph traversed once.
* ``chunked_causal_attention`` (``attention.py``) attends block by block:
  earlier pieces unmasked, the piece's own keys causally *aligned
  bottom-right* (query i of a piece at offset o is position o + i and sees
  the keys up to it; SDPA's ``is_causal`` with fewer queries than keys aligns
  top-left, which would hide the piece's own earlier keys). The blocks'
  softmaxes are merged by their *log-sum-exp*, so the result is the softmax
  over all keys so far, and the backward recomputes each block's
  probabilities from it: only q, k, v, the output and the log-sum-exp are
  saved, never a queries x keys matrix.
* Positions: a piece's rotary positions start at its offset
  (``piece_positions``); rope types whose frequencies follow the longest
  position seen are refused (``check_rope``).
* Hugging Face (``hf.py``): ``register_hf_attention()`` adds an
  ``attn_implementation`` that takes the carry from the context
  (``with carry.active(piece=p, offset=o):``, ``current_carry()``) and the
  layer id from ``module.layer_idx``.

The pipeline's part, per microbatch per stage::

    carry = SequenceCarry(pieces=K, total_length=L)
    for p in range(K):                                   # forwards, in order
        with carry.active(piece=p, offset=offsets[p]):
            out[p] = stage(x[p])
        carry.check_carried(p, model)                    # on a stage with attention
    for p in reversed(range(K)):                         # backwards, in reverse
        roots = carry.extra_roots(p)
        torch.autograd.backward([out[p], *(t for t, _ in roots)], [dout[p], *(g for _, g in roots)])
        carry.release(p)
"""
from pipeline_ext.seqchunks.attention import chunked_causal_attention
from pipeline_ext.seqchunks.carry import (DEFAULT_HF_NAME, PiecesNotSupportedError, SequenceCarry, check_rope,
                                          current_carry, piece_positions)
from pipeline_ext.seqchunks.hf import hf_piece_attention, hf_piece_mask, register_hf_attention

__all__ = ["SequenceCarry", "PiecesNotSupportedError", "chunked_causal_attention", "current_carry",
           "piece_positions", "check_rope", "register_hf_attention", "hf_piece_attention", "hf_piece_mask",
           "DEFAULT_HF_NAME"]
