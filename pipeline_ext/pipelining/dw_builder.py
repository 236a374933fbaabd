"""A stage whose weight-gradient work is the user's own: torch's ``dw_builder``.

torch.distributed.pipelining lets a stage pass ``dw_builder``, a function that
builds a ``dw_runner`` callable doing the stage's weight-gradient work (for
example a fused kernel that computes weight gradients outside autograd). With
it, torch runs the whole autograd backward at I (or B) and calls the runner at
W (or right after B). This runner does the same on our executor, so such a
model moves over unchanged; without ``dw_builder`` our automatic I/W split is
used instead.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from pipeline_ext.runtime.stage import Skips, StageError, StageRunner

__all__ = ["DwBuilderRunner"]


class DwBuilderRunner(StageRunner):
    """``StageRunner`` whose W is ``dw_builder()()`` (built at I, run at W, as torch does)."""

    def __init__(self, *args: Any, dw_builder: Callable[[], Callable[[], None]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dw_builder = dw_builder
        self._dw_runners: dict[int, Callable[[], None]] = {}

    def reset(self, keep_outputs: bool = True) -> None:
        super().reset(keep_outputs)
        self._dw_runners.clear()

    def backward(self, mb: int, grad_outputs: Optional[Sequence[Optional[torch.Tensor]]] = None,
                 skip_grads: Optional[Skips] = None) -> list[torch.Tensor]:
        message = super().backward(mb, grad_outputs, skip_grads)
        self.dw_builder()()
        return message

    def backward_input(self, mb: int, grad_outputs: Optional[Sequence[Optional[torch.Tensor]]] = None,
                       skip_grads: Optional[Skips] = None) -> list[torch.Tensor]:
        # the whole autograd backward, as torch does with dw_builder
        message = super().backward(mb, grad_outputs, skip_grads)
        self._dw_runners[mb] = self.dw_builder()
        return message

    def backward_weight(self, mb: int) -> None:
        runner = self._dw_runners.pop(mb, None)
        if runner is None:
            raise StageError(f"stage {self.stage_index}: W of microbatch {mb} ran before its I")
        runner()
