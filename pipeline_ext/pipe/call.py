"""One call of a ``Pipe`` (``step()`` or ``pipe(x)``): what its stages share, and how a stage runs a microbatch in it.

A call runs every stage on worker threads (``threads.py``), and they share:
the calling thread's autograd and autocast state, re-entered in every worker
(``CallerContext``); the call's own RNG seeds, which microbatches recompute
and which forward of a (stage, microbatch) is the recomputation, and how each
stage's output was shaped, so that the next stage gets it back as one
argument although the channels move flat tuples of tensors (``Call``).
``stage_call`` is how one stage runs its module on a microbatch within the
call: the torchgpipe convention, the checkpoint phase and the seeded
generators around the module, and the check that a checkpointed stage did
not modify its input in place (its recomputation would start from the
modified input). Its own module: this is torchgpipe's per-call semantics,
apart from how the pipe is built (``placement.py``) and driven (``pipe.py``).
"""
from __future__ import annotations

import threading
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from pipeline_ext.pipe.recompute import CallRng, checkpoint_phase
from pipeline_ext.runtime.split.function import SplitFunction

__all__ = ["Call", "CallerContext", "stage_call"]


class _Alias(SplitFunction):
    """Identity that is not a view: an in-place first layer may modify a stage's input (a leaf).

    A ``SplitFunction`` (all input half, no weights), so the I/W split knows it: where W re-runs the input
    region (a weight used twice in the stage) an unknown Function there would make the split fall back.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward_input(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad

    @staticmethod
    def backward_weight(ctx: Any, grad: torch.Tensor) -> None:
        return None


@dataclass
class CallerContext:
    """Autograd and autocast state of the calling thread, re-entered in every worker thread."""

    grad: bool
    autocast: list[tuple[str, torch.dtype]]

    @classmethod
    def capture(cls) -> "CallerContext":
        types = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        return cls(
            torch.is_grad_enabled(),
            [(t, torch.get_autocast_dtype(t)) for t in types if torch.is_autocast_enabled(t)],
        )

    def enter(self, stack: ExitStack) -> None:
        stack.enter_context(torch.set_grad_enabled(self.grad))
        for device_type, dtype in self.autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype))


class Call:
    """What one ``step()`` or ``pipe(x)`` call shares between its stages.

    Its own RNG seeds (recomputation after the call returned uses them), which
    microbatches recompute, which (stage, microbatch) forwards already ran (so
    the second one is the recomputation), and how each stage's output was
    shaped (a tensor, a tuple or a list), so that the next stage gets it back
    as one argument although the channels move flat tuples of tensors.
    """

    def __init__(self, rng: CallRng, ckpt: Optional[Callable[[int], bool]]) -> None:
        self.rng = rng
        self.ckpt = ckpt
        self.ran: set[tuple[int, int]] = set()
        self.shapes: dict[tuple[int, int], Optional[type]] = {}
        self.lock = threading.Lock()

    def phase(self, stage: int, mb: int) -> Optional[str]:
        if self.ckpt is None or not self.ckpt(mb):
            return None
        with self.lock:
            first = (stage, mb) not in self.ran
            self.ran.add((stage, mb))
        return "checkpointing" if first else "recomputing"


def stage_call(call: Call, stage: int, device: torch.device, unpack: bool,
               alias_inputs: bool) -> Callable[[int, nn.Module, Sequence[Any], dict[str, Any]], Any]:
    """How stage ``stage`` (on ``device``) runs its module on a microbatch within ``call``.

    ``unpack``: the pipe's ``unpack_tuples``; ``alias_inputs``: pass each
    input that requires grad through ``_Alias`` (``step()`` does on every
    stage after the first).
    """

    def run(mb: int, module: nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        if alias_inputs:
            args = [_Alias.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args]
        if stage > 0 and not unpack:
            shape = call.shapes[(stage - 1, mb)]
            args = [shape(args)] if shape is not None else list(args)
        phase = call.phase(stage, mb)
        versions = [a._version for a in args if isinstance(a, torch.Tensor)] if phase == "checkpointing" else None
        with checkpoint_phase(phase), call.rng(stage, mb, device):
            out = module(*args, **kwargs)
        if versions is not None and versions != [a._version for a in args if isinstance(a, torch.Tensor)]:
            raise RuntimeError(
                f"stage {stage} modified its input in place (microbatch {mb}) while being checkpointed: its "
                "recomputation would start from the modified input and give wrong gradients. Make the first "
                "operation out of place, or use checkpoint='never'"
            )
        call.shapes[(stage, mb)] = type(out) if isinstance(out, (tuple, list)) else None
        return out

    return run
