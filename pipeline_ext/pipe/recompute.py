"""Activation recomputation modes, the RNG replay that makes recomputation exact, and its phase flags.

``checkpoint="always" | "except_last" | "never"`` (torchgpipe's names): a
checkpointed microbatch keeps only its stage inputs between forward and
backward and runs its forward again right before the backward. "except_last"
skips the last microbatch, whose backward follows its forward at once. As in
torchgpipe, nothing recomputes in eval mode.

Recomputation must redraw the same random numbers (``nn.Dropout``, but also
``F.dropout`` or ``torch.rand`` inside any forward: we cannot tell from the
module types), and in a single process several worker threads share torch's
CPU generator (and the stages of one GPU share its generator), so the order in
which they draw depends on timing. ``CallRng`` therefore runs every forward
with the generators it may draw from (the CPU one, and its GPU's) held
exclusively and seeded from (call, stage, microbatch), saving and restoring
their states with torch's own ``get_state``/``set_state`` as
``torch.utils.checkpoint`` does. One seed is drawn per ``step()`` or ``pipe(x)``
call from the caller's generator and kept by that call (``CallRng.draw``),
so two ``pipe(x)`` calls before one ``backward()`` each recompute with their own
seeds. Masks no longer depend on thread timing, and all three checkpoint modes
give the same gradients.

A backward may touch those generators too: the user's own
``torch.utils.checkpoint`` inside a stage (plain, reentrant or selective)
stashes the generator states in the forward and, when its region recomputes
in the backward, sets them and restores them afterwards (torch's
``fork_rng``). Run unlocked on a worker thread, that restore rewinds the
generator under another worker's seeded forward, and a concurrent draw moves
it under the recomputation: dropout masks that differ from the forward's,
wrong gradients. So in a seeded call every backward action (B, I and W: under
a zero-bubble schedule both halves may recompute) holds the same locks as a
forward (``RngHeldBackward``), without reseeding: the recomputation replays
the state its checkpoint stashed.

``is_checkpointing()`` / ``is_recomputing()`` tell a layer which pass it is in
(torchgpipe's functions): the first, activation-free forward of a checkpointed
microbatch, or its recomputation before the backward.
"""
from __future__ import annotations

import threading
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

__all__ = [
    "CHECKPOINT_MODES",
    "checkpoint_predicate",
    "CallRng",
    "RngHeldBackward",
    "uses_randomness",
    "is_checkpointing",
    "is_recomputing",
    "checkpoint_phase",
]

CHECKPOINT_MODES = ("always", "except_last", "never")

# A device's generator is shared by every stage on that device (torch's CPU
# generator by the whole process; a GPU's by every worker thread placed on it):
# a seeded forward holds it exclusively. Locks are taken CPU first, then the GPU.
_RNG_LOCKS: dict[torch.device, threading.RLock] = {}
_RNG_LOCKS_GUARD = threading.Lock()


def _rng_lock(device: torch.device) -> threading.RLock:
    with _RNG_LOCKS_GUARD:
        return _RNG_LOCKS.setdefault(device, threading.RLock())


def checkpoint_predicate(mode: str, n_microbatches: int) -> Optional[Callable[[int], bool]]:
    """``pred(mb)`` is True when microbatch ``mb`` recomputes; None when nothing does."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint is not one of 'always', 'except_last', or 'never' (got {mode!r})")
    if mode == "never":
        return None
    if mode == "always":
        return lambda mb: True
    return lambda mb: mb != n_microbatches - 1


def uses_randomness(module: nn.Module) -> bool:
    """Whether the module has dropout-like layers (known randomness, worth seeding even without recomputation)."""
    for m in module.modules():
        if isinstance(m, (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)):
            if m.p > 0:
                return True
        if isinstance(m, nn.MultiheadAttention) and m.dropout > 0:
            return True
    return False


# -- which pass a forward is in ----------------------------------------------------------------
_phase = threading.local()


def is_checkpointing() -> bool:
    """True inside the first forward of a checkpointed microbatch (it keeps no activations)."""
    return getattr(_phase, "value", None) == "checkpointing"


def is_recomputing() -> bool:
    """True inside the recomputation of a checkpointed microbatch, right before its backward."""
    return getattr(_phase, "value", None) == "recomputing"


@contextmanager
def checkpoint_phase(value: Optional[str]) -> Iterator[None]:
    """Set what ``is_checkpointing``/``is_recomputing`` say on this thread (None: neither)."""
    saved = getattr(_phase, "value", None)
    _phase.value = value
    try:
        yield
    finally:
        _phase.value = saved


# -- RNG ---------------------------------------------------------------------------------------
def _generators(device: torch.device) -> list[tuple[torch.device, torch.Generator]]:
    """The generators a forward on ``device`` may draw from: the CPU's always, its GPU's too."""
    out = [(torch.device("cpu"), torch.default_generator)]
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        out.append((torch.device("cuda", index), torch.cuda.default_generators[index]))
    return out


class CallRng:
    """The seeds of one ``step()`` or ``pipe(x)`` call; kept by that call's forwards and recomputations.

    Seeded, a forward holds the CPU generator's lock (and its GPU's) while it
    runs, and so does a backward (``RngHeldBackward``), which serialises the
    computation of all stages in the process: the price of exact
    recomputation. Forwards and backwards mostly launch kernels on GPUs, so
    there the cost is small; on CUDA, seeding and restoring a generator is host-side state
    and never synchronises the device. Not seeded (``base`` None), forwards draw
    from the shared generators as usual.
    """

    def __init__(self, base: Optional[int]) -> None:
        self.base = base

    @classmethod
    def draw(cls, seeded: bool) -> "CallRng":
        """This call's base seed, from the caller's generator (so torch.manual_seed controls it)."""
        return cls(int(torch.randint(0, 2**62, (1,)).item()) if seeded else None)

    @property
    def seeded(self) -> bool:
        """Whether this call's forwards hold the RNG lock (so they run one at a time: ``lockstep.py``'s note)."""
        return self.base is not None

    def seed(self, stage: int, mb: int, offset: int = 0) -> int:
        assert self.base is not None
        return (self.base * 1_000_003 + stage * 10_007 + mb * 101 + offset) % (2**63 - 1)

    @contextmanager
    def held(self, device: torch.device) -> Iterator[None]:
        """Hold the generators a computation on ``device`` may touch, unchanged (nothing when not seeded)."""
        if self.base is None:
            yield
            return
        with ExitStack() as stack:
            for dev, _ in _generators(device):  # CPU first, then the GPU: the one order, no deadlock
                stack.enter_context(_rng_lock(dev))
            yield

    @contextmanager
    def __call__(self, stage: int, mb: int, device: torch.device) -> Iterator[None]:
        """Run a forward of (stage, mb) with its generators held, seeded, and restored afterwards."""
        if self.base is None:
            yield
            return
        gens = _generators(device)
        with self.held(device):
            saved = [g.get_state() for _, g in gens]
            for i, (_, g) in enumerate(gens):
                g.manual_seed(self.seed(stage, mb, i))
            try:
                yield
            finally:
                for (_, g), state in zip(gens, saved):
                    g.set_state(state)


class RngHeldBackward:
    """A stage runner whose backward actions (B, I, W) hold the call's generators, as its forwards do.

    The backward of a stage that uses ``torch.utils.checkpoint`` itself sets
    and restores the process-wide generator states while it recomputes; held,
    that cannot happen under another worker's forward or recomputation. The
    executor reads everything else (``forward``, ``is_last``, ...) from the
    wrapped runner.
    """

    def __init__(self, runner: Any, rng: CallRng, device: torch.device) -> None:
        self.runner = runner
        self.rng = rng
        self.device = device

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        with self.rng.held(self.device):
            return self.runner.backward(*args, **kwargs)

    def backward_input(self, *args: Any, **kwargs: Any) -> Any:
        with self.rng.held(self.device):
            return self.runner.backward_input(*args, **kwargs)

    def backward_weight(self, *args: Any, **kwargs: Any) -> Any:
        with self.rng.held(self.device):
            return self.runner.backward_weight(*args, **kwargs)
