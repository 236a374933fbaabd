"""Counting activation bytes: a deterministic peak-memory measure that needs no device allocator.

On CUDA, ``torch.cuda.max_memory_allocated`` says how much a rank held at its
peak. On CPU there is no such counter, and a process's resident size moves
with the allocator's caching and with everything else in the process. What a
pipeline schedule changes is how many activations are alive at once, so that
is what ``ActivationMeter`` counts:

- at each forward of a stage (``wrap`` its runner's ``call``) it records the
  storages of the stage's tensor inputs, its outputs, and every tensor the
  autograd graph of that forward saved for backward (walking the graph from
  the outputs, down to the parameters' and inputs' leaves), but not the
  module's parameters and buffers (a Linear saves its weight);
- a storage is recorded once (by identity), with its size in bytes, as a
  weak reference: recording keeps nothing alive;
- ``live_bytes()`` is the sum over the recorded storages still alive, and
  ``sample()`` keeps the largest value seen; ``on_action``, registered with
  ``sched.register_action_hook(meter.on_action)``, samples after every action
  ([Note: one sample per action, after it] in runtime/trace.py).

- what a zero-bubble I keeps for its W beyond the graph's saved tensors
  (values of a selective checkpoint recomputed at I, once-only hooks' values,
  a ``SplitFunction``'s stash, the values a ``split_backend`` region's first
  part hands its rest; [Note: what I keeps for W]) is recorded when I hands it
  over: ``watch(runner)`` attaches to the runner (``StageRunner.instrument``:
  its forwards wrapped, what I keeps reported to ``track``).

Liveness is reference counting, so the count is the same on every run of the
same schedule. What it leaves out: parameters, gradients (the gradients I
records for W included), optimizer state, the channels' own buffers (packed
copies, receive buffers not yet handed to a stage), and the last stage's
loss. Saved tensors under a ``saved_tensors_hooks`` unpack hook are not
unpacked (that would recompute or move them); for a checkpointed region what
its frame holds is counted instead: the inputs it recomputes from and the
values a selective checkpoint's policy saved.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from pipeline_ext.runtime.split.obstacles import checkpoint_frame, frame_inputs, sac_storage_tensors
from pipeline_ext.runtime.stage import _storage_key

__all__ = ["ActivationMeter", "activation_bytes", "saved_tensors"]


def saved_tensors(roots: Sequence[Any]) -> Iterator[torch.Tensor]:
    """Every tensor saved for backward in the graph below ``roots`` (tensors), without running unpack hooks."""
    stack = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set[Any] = set()
    frames: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if not name.startswith("_raw_saved_"):
                continue
            try:
                raw = getattr(node, name)
                items = raw if isinstance(raw, (list, tuple)) else (raw,)
                hooked = [r.unpack_hook for r in items if getattr(r, "unpack_hook", None) is not None]
                if hooked:  # unpacking could recompute (checkpoint) or move (offload) it
                    for frame in map(checkpoint_frame, hooked):
                        if frame is not None and id(frame) not in frames:  # what the frame holds, once
                            frames.add(id(frame))
                            yield from frame_inputs(frame)
                            yield from sac_storage_tensors(frame)
                    continue
                unpacked = name[len("_raw"):]  # a C++ node's _raw_saved_self unpacks as _saved_self
                if not hasattr(node, unpacked):  # a custom Function's (a compiled region's) as saved_tensors
                    unpacked = unpacked[1:]
                value = getattr(node, unpacked)
            except RuntimeError:  # freed already (a backward ran)
                continue
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor):
                    yield t
        stack.extend(c for c, _ in node.next_functions if c is not None)


class ActivationMeter:
    """The bytes of recorded activation storages alive now, and the most seen alive at once (see the module doc)."""

    def __init__(self) -> None:
        self._refs: dict[int, tuple[StorageWeakRef, int]] = {}
        #: the most bytes alive at one sample
        self.peak_bytes = 0
        #: the most bytes one forward recorded (one stage, one microbatch)
        self.forward_bytes = 0

    def reset(self) -> None:
        """Forget everything recorded and the peak (between measured configurations)."""
        self._refs.clear()
        self.peak_bytes = 0
        self.forward_bytes = 0

    def track(self, tensors: Any) -> int:
        """Record the storages of ``tensors`` (nested tuples/lists/dicts); returns the bytes newly recorded."""
        added = 0
        for t in _flatten(tensors):
            if not isinstance(t, torch.Tensor) or _storage_key(t) is None:
                continue
            storage = t.untyped_storage()
            ref = StorageWeakRef(storage)
            if ref.cdata in self._refs and not self._refs[ref.cdata][0].expired():
                continue
            self._refs[ref.cdata] = (ref, storage.nbytes())
            added += storage.nbytes()
        return added

    def watch(self, runner: Any, inputs: bool = True) -> Any:
        """Measure a ``StageRunner``: its forwards (``wrap`` of its ``call``) and what its I keeps for W.

        Returns the runner's handle (``StageRunner.instrument``): ``remove()`` stops the measuring.
        """
        module = runner.module

        def kept(tensors: list) -> None:
            # a recomputation saves the parameters it reads too (detached views of them): no activations
            skip = {_storage_key(t) for t in (*module.parameters(), *module.buffers())}
            self.track([t for t in tensors if _storage_key(t) not in skip])

        return runner.instrument(wrap_call=lambda call: self.wrap(call, inputs=inputs), on_kept=kept)

    def wrap(self, call: Callable[..., Any], inputs: bool = True) -> Callable[..., Any]:
        """A runner's ``call`` that records each forward's inputs, outputs and saved tensors.

        ``inputs=False`` leaves the inputs' storages out, also where the graph
        saved them (a first stage's: the user's batch, alive the whole step
        whatever the schedule).
        """

        def measured(mb: int, module: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
            out = call(mb, module, args, kwargs)
            outs = list(_flatten(out))
            # the module's parameters and buffers are no activations (a Linear saves its weight)
            skip = {_storage_key(t) for t in (*module.parameters(), *module.buffers())}
            if not inputs:
                skip |= {_storage_key(t) for t in _flatten(args) if isinstance(t, torch.Tensor)}
            saved = [t for t in saved_tensors(outs) if _storage_key(t) not in skip]
            added = self.track(list(args)) if inputs else 0
            added += self.track(outs) + self.track(saved)
            self.forward_bytes = max(self.forward_bytes, added)
            return out

        return measured

    def live_bytes(self) -> int:
        """Bytes of the recorded storages still alive (expired ones are forgotten)."""
        total = 0
        for key in [k for k, (ref, _) in self._refs.items() if ref.expired()]:
            del self._refs[key]
        for _, nbytes in self._refs.values():
            total += nbytes
        return total

    def sample(self) -> int:
        live = self.live_bytes()
        self.peak_bytes = max(self.peak_bytes, live)
        return live

    def on_action(self, sample: Any) -> None:
        """The schedule's action hook (``sched.register_action_hook(meter.on_action)``): a sample after each
        action (``sample``, a ``runtime.trace.ActionSample``, says which; the count needs only the moment)."""
        self.sample()


def activation_bytes(module: torch.nn.Module, *args: Any, **kwargs: Any) -> int:
    """Bytes one microbatch leaves on a stage between its forward and its backward: its inputs, its outputs
    and what autograd saved, parameters and buffers left out.

    Run ``module`` (one rank's share of the model) on one example microbatch
    to get the unit ``schedules.select(budget_bytes=..., activation_bytes=...)``
    counts schedules' memory in. The forward runs with autograd on; its graph
    is dropped on return.
    """
    meter = ActivationMeter()
    with torch.enable_grad():
        meter.wrap(lambda mb, m, a, k: m(*a, **k))(0, module, args, kwargs)
    return meter.forward_bytes


def _flatten(x: Any) -> Iterator[Any]:
    if isinstance(x, (tuple, list)):
        for item in x:
            yield from _flatten(item)
    elif isinstance(x, dict):
        for item in x.values():
            yield from _flatten(item)
    else:
        yield x
