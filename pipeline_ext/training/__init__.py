"""What training a real model on a pipeline needs beyond the schedule itself.

A schedule computes each stage's gradients. A training loop also needs:
- ``tied``: parameters shared by stages on different ranks (tied input/output
  embeddings), summed once per step and kept equal;
- ``clip``: gradient clipping by the norm of the *whole* model's gradients;
- ``checkpoint``: DCP checkpoints named as the unsplit model, so they load into
  it, or into a pipeline cut differently, and resume bitwise;
- ``loss``: what the per-microbatch losses mean, and an exact token mean;
- ``stages``: the one description of "this rank's stages" the tools share;
- ``profiling``: each layer's measured cost, and the cut into stages with the
  least simulated step time under the chosen schedule.

Names load lazily (as in ``pipeline_ext``): the schedules import
``training.loss`` without paying for torch.distributed.checkpoint.
"""
from __future__ import annotations

from pipeline_ext._lazy import lazy_names

_EXPORTS = {
    "TiedParameters": "tied",
    "tie_parameters": "tied",
    "clip_grad_norm_": "clip",
    "total_grad_norm": "clip",
    "save_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "unsplit_name": "checkpoint",
    "FQNMap": "checkpoint",
    "TokenMeanLoss": "loss",
    "loss_weights": "loss",
    "profile_layers": "profiling",
    "balance_layers": "profiling",
    "LayerChain": "profiling",
    "stage_modules": "profiling",
    "block_ranges": "profiling",
    "sizes_with_ends": "profiling",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_names(__name__, {n: f"pipeline_ext.training.{m}" for n, m in _EXPORTS.items()},
                                  __all__)
