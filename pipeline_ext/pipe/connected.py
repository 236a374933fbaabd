"""Forward inside the caller's autograd graph: what ``Pipe.__call__`` runs.

``pipe(x)`` must return an output that ``loss.backward()`` can flow back
through, every stage, in the right order, like an ordinary module's. The
executor and channels move *detached* tensors (that is what makes them cheap
and lets the copies run on copy streams). ``ConnectedRunner`` therefore keeps
each stage's graph-connected outputs in a shared table and, on the receiving
stage, re-attaches the received tensor to them with ``Reattach``: its forward
is the received data (already on this stage's device), its backward hands the
gradient to the producing stage's device. Autograd then sees one graph across
all stages and threads. Skips (``pipeline_ext.skip``) are re-attached the same
way, from the stashing stage's connected tensor, under (skip key, microbatch).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from pipeline_ext.runtime._ext import _C
from pipeline_ext.runtime.stage import Skips, StagePosition, as_output_tuple, detach_tree, is_differentiable
from pipeline_ext.skip.skippable import has_skippables
from pipeline_ext.skip.tracker import call_with_skips

__all__ = ["Reattach", "ConnectedRunner"]


class Reattach(torch.autograd.Function):
    """The received tensor, made the output of ``source`` (the producer's output) for autograd.

    The received tensor is handed in inside a list, not as an input: an input
    returned from a custom Function is a view of it, which autograd forbids to
    modify in place, and a stage may start with an in-place layer
    (``nn.ReLU(inplace=True)``). It is returned as itself: no copy.
    """

    @staticmethod
    def forward(ctx: Any, source: torch.Tensor, received: list[torch.Tensor]) -> torch.Tensor:
        ctx.src_device = source.device
        return received[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if grad.device == ctx.src_device:
            return grad, None
        # The same protocol as activations going forward (LocalChannel): copy on
        # the copy streams after the work that produced the gradient; the source
        # device's current stream waits for the copy and owns the result.
        (out,) = _C.copy_between_devices([grad], grad.device, ctx.src_device)
        return out, None


class ConnectedRunner(StagePosition):
    """Runs one stage's forward without detaching, for ``Pipe.__call__`` (forward-only schedules).

    ``links`` is shared by every stage of the pipe: a stage puts its connected
    outputs there under (stage, microbatch); the next stage takes them after the
    channel delivered the data, which orders the two.
    """

    def __init__(
        self,
        module: nn.Module,
        stage_index: int,
        num_stages: int,
        links: dict[tuple[Any, int], Any],
        call: Callable[[int, nn.Module, Sequence[Any], dict[str, Any]], Any],
        checkpoint: Optional[Callable[[int], bool]] = None,
    ) -> None:
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.links = links
        self.call = call
        self.checkpoint = checkpoint
        self.outputs: dict[int, Any] = {}
        self._skippable = has_skippables(module)
        self._stashed: dict[int, Skips] = {}

    def forward(
        self, mb: int, args: Sequence[Any], kwargs: Optional[dict[str, Any]] = None, target: Any = None,
        loss_weight: float = 1.0, skips: Optional[Skips] = None,
    ) -> tuple[torch.Tensor, ...]:
        if self.stage_index > 0:
            sources = self.links.pop((self.stage_index - 1, mb))
            args = tuple(_connect(r, s) for r, s in zip(args, sources))
        popped = {k: _connect(r, self.links.pop((k, mb))) for k, r in (skips or {}).items()}
        kwargs = kwargs or {}
        stashed: Skips = {}

        def run(*a: Any) -> Any:  # a recomputation pops the same skips again; its stashes are not used
            if not (self._skippable or popped):
                return self.call(mb, self.module, a, kwargs)
            out, left = call_with_skips(lambda: self.call(mb, self.module, a, kwargs), popped)
            if not stashed:
                stashed.update(left)
            return out

        if torch.is_grad_enabled() and self.checkpoint is not None and self.checkpoint(mb):
            # The whole stage recomputes (no early stop): a layer's forward hooks then run in the
            # recomputation too (deferred batch norm puts its running statistics back in one).
            with torch_checkpoint.set_checkpoint_early_stop(False):
                out = torch_checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=False)
        else:
            out = run(*args)
        if stashed:
            for k, v in stashed.items():
                self.links[(k, mb)] = v
            self._stashed[mb] = detach_tree(stashed)
        if self.is_last:
            self.outputs[mb] = out
            return ()
        outs = as_output_tuple(out, self.stage_index, mb)
        self.links[(self.stage_index, mb)] = outs
        return tuple(o.detach() for o in outs)

    def take_stashed(self, mb: int) -> Skips:
        """The skips microbatch ``mb`` stashed for later stages (detached: the channel's part)."""
        return self._stashed.pop(mb, {})


def _connect(received: Any, source: Any) -> Any:
    """The received tensor, attached to the producer's graph when the producer's tensor needs a gradient."""
    if is_differentiable(source) and source.requires_grad:
        return Reattach.apply(source, [received])
    return received
