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

from pipeline_ext._lazy import exports, lazy_names

#: the modules' ``__all__``, read unimported (``_lazy.exports``); ``stages`` is the tools' own, not listed
_EXPORTS = exports(__name__, ["tied", "clip", "checkpoint", "loss", "profiling"])
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_names(__name__, _EXPORTS, __all__)
