"""torch's ``torch.distributed.pipelining.microbatch``, over this library's splitting and merging.

The splitting itself is ``runtime/microbatch.py`` (one place decides how a
batch is cut, for both front ends; uneven batches allowed). This module gives
it torch's names, so that replacing ``torch.distributed.pipelining`` by
``pipeline_ext.pipelining`` in an import keeps a script working: the specs
(``TensorChunkSpec``, ``_Replicate``, ``_CustomReducer``, ``sum_reducer``) are
the ones the schedules here understand, and torch's ``_split_block_mask`` (a
flex-attention ``BlockMask`` cut by batch rows: torchtitan calls it) is
torch's own, lent on first use. torch's internal helpers are refused, saying
what does their work here.
"""
from __future__ import annotations

import operator

import torch

from pipeline_ext._lazy import lazy_names
from pipeline_ext.runtime.microbatch import Reduce, Replicate, TensorChunkSpec, merge_chunks, split_args_kwargs_into_chunks

__all__ = ["TensorChunkSpec", "split_args_kwargs_into_chunks", "merge_chunks"]

#: the dimension a tensor is cut along when its spec does not say (torch's constant)
DEFAULT_CHUNK_DIM = 0


class _Replicate(Replicate):
    """torch's name for "every microbatch gets the whole value"; the class itself or an instance, as in torch."""


#: torch's reducer spec for ``output_merge_spec``: ``_CustomReducer(init_value, reduce_fn)``
_CustomReducer = Reduce


class _LossReducer(Reduce):
    """torch's reducer class of ``sum_reducer``."""


#: torch's merge spec that sums the microbatch values (from a 0-dim zero)
sum_reducer = _LossReducer(torch.tensor(0.0), operator.add)

_GAPS = {
    "_split_tensor": "torch's cut of one tensor; split_args_kwargs_into_chunks cuts each tensor here, as "
                     "torch.tensor_split does (uneven batches allowed: runtime/microbatch.py)",
    "_shard_dict_of_args": "torch's cut of a dict of arguments; use split_args_kwargs_into_chunks",
    "_debug_mask_minibatches": "torch's debugging switch (masking instead of cutting); microbatches here are "
                               "always cut",
}
__getattr__, __dir__ = lazy_names(__name__, {"_split_block_mask": "torch.distributed.pipelining.microbatch"},
                                  gaps=_GAPS)
