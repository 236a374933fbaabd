"""What the pipeline's loss means, and how to get an exact token mean.

Why this exists: a schedule runs ``loss_fn`` once per microbatch. By default
(``scale_grads=True``, as in torch) microbatch ``i``'s loss is weighted by its
share of the batch's *rows* before backward, so the gradients are those of

    sum_i rows_i / rows * loss_fn(output_i, target_i)

which is the whole batch's mean loss when ``loss_fn`` is a mean over rows. With
masked tokens (padding, ``ignore_index=-100``) a mean-reduced cross entropy is
a mean over each microbatch's *valid tokens*, and the weighted sum above is a
mean of per-microbatch token means: it differs from the unsplit model's token
mean whenever microbatches hold different numbers of valid tokens. ``losses``
on the last stage holds each microbatch's own ``loss_fn`` value (unweighted).

The fix: a ``loss_fn`` may say how its microbatches are weighted, through a
method ``microbatch_weights(targets) -> list[float]`` called on the last stage
with every microbatch's target before the step runs. ``TokenMeanLoss`` weights
each microbatch by its share of valid tokens, which makes the gradients (and
``combine(losses)``) exactly the token mean over the whole batch, and with
``dp_group`` over the whole *global* batch of every data-parallel replica.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.nn import functional as F

from pipeline_ext.runtime.microbatch import loss_weights  # noqa: F401  (training.loss_weights)

__all__ = ["TokenMeanLoss", "loss_weights"]


class TokenMeanLoss:
    """Cross entropy averaged over the valid tokens of the whole batch, exactly, under any microbatching.

    ``loss = pe.TokenMeanLoss(ignore_index=-100)`` and
    ``pe.Schedule1F1B(stage, n, loss_fn=loss)``: gradients then equal those
    of ``F.cross_entropy(logits.flatten(0, -2), labels.flatten(),
    ignore_index=-100)`` on the unsplit batch (Hugging Face's causal-LM loss
    with pre-shifted labels). ``loss.combine(losses)`` turns the step's
    per-microbatch losses into that token mean.

    With data parallelism, pass ``dp_group`` (the group of last-stage ranks
    that replicate this one, e.g. ``mesh["dp"].get_group()``): the valid tokens
    are then counted over the global batch and the weights are scaled by the
    DP size, so that the DP *average* of the replicas' gradients (DDP, FSDP2 or
    a manual all-reduce divided by the DP size) is the global token mean. That
    adds one small all-reduce per step over ``dp_group``.

    ``per_token`` may replace cross entropy: ``per_token(output, target) ->
    per-token losses`` with the target's shape (masked positions are ignored).
    """

    def __init__(self, ignore_index: int = -100,
                 per_token: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
                 dp_group: Optional[dist.ProcessGroup] = None) -> None:
        self.ignore_index = ignore_index
        self.per_token = per_token
        self.dp_group = dp_group
        #: the weights of the last step's microbatches, a 1-D tensor on the targets' device (set by
        #: ``microbatch_weights``)
        self.last_weights: torch.Tensor = torch.zeros(0)

    def count(self, target: torch.Tensor) -> torch.Tensor:
        """Valid (unmasked) tokens in ``target``."""
        return (target != self.ignore_index).sum()

    def microbatch_weights(self, targets: Sequence[torch.Tensor]) -> torch.Tensor:
        """Each microbatch's share of the batch's valid tokens (times the DP size, over the global batch).

        A tensor on the targets' device, computed without reading anything on
        the host: on GPU targets a ``.tolist()`` or a ``float(total)`` here
        would stall every step until the GPU caught up.
        """
        counts = torch.stack([self.count(t) for t in targets]).to(torch.float64)
        total = counts.sum()
        scale = 1
        if self.dp_group is not None:
            dist.all_reduce(total, group=self.dp_group)
            scale = dist.get_world_size(self.dp_group)
        # A batch without valid tokens contributes nothing (the unsplit mean would be 0/0): its counts are
        # all 0, so dividing by max(total, 1) gives 0 weights. Raising here, after the ranks agreed on the
        # step, would leave the other ranks waiting.
        self.last_weights = (counts * scale / total.clamp(min=1)).to(torch.float32)
        return self.last_weights

    def __call__(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """This microbatch's mean loss over its valid tokens (0 when it has none)."""
        logits = output[0] if isinstance(output, (tuple, list)) else output
        if self.per_token is None:
            per_token = F.cross_entropy(logits.flatten(0, -2).float(), target.flatten(),
                                        ignore_index=self.ignore_index, reduction="none")
        else:
            per_token = self.per_token(logits, target).flatten()
        mask = (target != self.ignore_index).flatten()
        return (per_token * mask).sum() / mask.sum().clamp(min=1)

    def combine(self, losses: Sequence[torch.Tensor]) -> torch.Tensor:
        """The step's token-mean loss from its per-microbatch ``losses`` (this replica's share with ``dp_group``).

        With ``dp_group`` it is this replica's term of the DP average:
        ``all_reduce(combine(losses)) / dp_size`` is the global token mean.
        """
        if len(losses) != len(self.last_weights):
            raise ValueError(f"{len(losses)} losses but the last step had {len(self.last_weights)} microbatches")
        return sum(w * l for w, l in zip(self.last_weights, losses))  # type: ignore[return-value]
