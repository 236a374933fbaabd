"""Activation recomputation modes and the RNG scope that makes recomputation exact.

``checkpoint="always" | "except_last" | "never"`` (torchgpipe's names): a
checkpointed microbatch keeps only its stage inputs between forward and
backward and runs its forward again right before the backward. "except_last"
skips the last microbatch, whose backward follows its forward at once.

Recomputation must redraw the same random numbers (dropout masks), and in a
single process several worker threads share torch's CPU generator, so the
order in which they draw depends on timing. ``RngScope`` gives each (stage,
microbatch) forward its own seed, derived from one seed drawn per step from the
caller's generator: masks no longer depend on thread timing, recomputation
reproduces them, and all three checkpoint modes give the same gradients.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch
from torch import nn

__all__ = ["CHECKPOINT_MODES", "checkpoint_predicate", "RngScope", "uses_randomness"]

CHECKPOINT_MODES = ("always", "except_last", "never")

# A device's generator is shared by every stage on that device (torch's CPU
# generator by the whole process; a GPU's by every worker thread placed on it):
# a seeded forward holds it exclusively.
_RNG_LOCKS: dict[torch.device, threading.RLock] = {}
_RNG_LOCKS_GUARD = threading.Lock()


def _rng_lock(device: torch.device) -> threading.RLock:
    with _RNG_LOCKS_GUARD:
        return _RNG_LOCKS.setdefault(device, threading.RLock())


def checkpoint_predicate(mode: str, n_microbatches: int) -> Optional[Callable[[int], bool]]:
    """``pred(mb)`` is True when microbatch ``mb`` recomputes; None when nothing does."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {mode!r}")
    if mode == "never":
        return None
    if mode == "always":
        return lambda mb: True
    return lambda mb: mb != n_microbatches - 1


def uses_randomness(module: nn.Module) -> bool:
    """Whether the module has dropout-like layers (the common source of forward randomness)."""
    for m in module.modules():
        if isinstance(m, (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)):
            if m.p > 0:
                return True
        if isinstance(m, nn.MultiheadAttention) and m.dropout > 0:
            return True
    return False


class RngScope:
    """Seeds the generator of a stage's device per (step, stage, microbatch) around its forward.

    Disabled, it costs nothing and forwards draw from the shared generators as
    usual. Enabled, a forward holds its device generator's lock while it runs,
    which serialises the forwards of stages that share a device (all CPU stages
    share torch's global generator; two stages on one GPU share its generator):
    the price of reproducible randomness. Stages on different GPUs do not
    contend. On CUDA, seeding and restoring the generator is host-side state
    (seed and offset), so it never synchronises the device.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._base = 0

    def new_step(self) -> None:
        """Draw this step's base seed from the caller's generator (so torch.manual_seed controls it)."""
        if self.enabled:
            self._base = int(torch.randint(0, 2**62, (1,)).item())

    def seed(self, stage: int, mb: int) -> int:
        return (self._base * 1_000_003 + stage * 10_007 + mb) % (2**63 - 1)

    @contextmanager
    def __call__(self, stage: int, mb: int, device: torch.device) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        if device.type == "cuda":
            device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
            gen = torch.cuda.default_generators[device.index]
        else:
            device, gen = torch.device("cpu"), torch.default_generator
        with _rng_lock(device):
            saved = gen.get_state()
            gen.manual_seed(self.seed(stage, mb))
            try:
                yield
            finally:
                gen.set_state(saved)
