"""A stage's declared shapes (torch's ``input_args``/``output_args``): one microbatch's, checked on every one.

Declaring shapes is optional (they are discovered on the first step); when a
stage declares them, a microbatch that does not match raises
``PipeliningShapeError`` naming the stage, the microbatch and the value. The
first stage's inputs are checked by the session before the step is posted,
so every rank refuses the step together and nothing runs; outputs, and the
inputs of later stages, are checked around the stage's forward.

``PipeliningShapeError`` derives from torch's ``PipeliningMetadataError``, so
that ``except PipeliningMetadataError`` in code written for torch catches it
too. Importing torch's class imports ``torch.distributed.pipelining``
(dynamo, DTensor, sympy: seconds of a rank's start-up on a small machine),
so both classes are made when first asked for (``errors``), not on import.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Declared", "errors"]


@functools.lru_cache(maxsize=None)
def errors() -> dict[str, type]:
    """``PipeliningMetadataError`` (torch's class) and ``PipeliningShapeError`` (ours, a subclass of it)."""
    try:
        from torch.distributed.pipelining._utils import PipeliningMetadataError
    except ImportError:  # pragma: no cover - older torch
        class PipeliningMetadataError(RuntimeError):  # type: ignore[no-redef]
            """A stage's inputs or outputs are not what it declared."""

        PipeliningMetadataError.__module__ = "pipeline_ext.pipelining.stage"

    class PipeliningShapeError(ValueError, PipeliningMetadataError):
        """A microbatch does not match the stage's declared ``input_args``/``output_args`` (shape or dtype)."""

    # named where users import it from, so that it pickles and prints as pipeline_ext.pipelining.stage's
    PipeliningShapeError.__module__, PipeliningShapeError.__qualname__ = ("pipeline_ext.pipelining.stage",
                                                                          "PipeliningShapeError")
    return {"PipeliningMetadataError": PipeliningMetadataError, "PipeliningShapeError": PipeliningShapeError}


@dataclass(frozen=True)
class Declared:
    """Stage ``stage``'s declared ``inputs`` and ``outputs`` (one microbatch's; None: not declared)."""

    stage: int
    inputs: Any = None
    outputs: Any = None
    #: where the shapes come from, as errors name it: the stage's arguments, or its first step
    #: (``PipelineStage._runtime_validate``)
    source: str = "declared"

    def check(self, what: str, mb: int, actual: Any) -> None:
        """Raise ``PipeliningShapeError`` unless ``actual`` (microbatch ``mb``'s "inputs" or "outputs") matches."""
        from torch.utils import _pytree as pytree

        expected = self.inputs if what == "inputs" else self.outputs
        if expected is None:
            return
        expected = expected if isinstance(expected, tuple) or what == "outputs" else (expected,)
        got, want = pytree.tree_leaves(actual), pytree.tree_leaves(expected)
        source = f"{what[:-1]}_args" if self.source == "declared" else f"the first step's {what}"
        problem = None
        if len(got) != len(want):
            problem = f"{len(got)} values where {source} has {len(want)}"
        else:
            for i, (g, w) in enumerate(zip(got, want)):
                if not isinstance(w, torch.Tensor):
                    continue
                if not isinstance(g, torch.Tensor):
                    problem = f"{what[:-1]} {i} is a {type(g).__name__}, {source} has a tensor {tuple(w.shape)}"
                elif g.shape != w.shape:  # torch's words ("shape mismatch", "dtype mismatch"), which its users match
                    problem = f"{what[:-1]} {i}: shape mismatch: {tuple(g.shape)}, {source} has {tuple(w.shape)}"
                elif g.dtype != w.dtype:
                    problem = f"{what[:-1]} {i}: dtype mismatch: {g.dtype}, {source} has {w.dtype}"
                elif _distribution(g) != _distribution(w):
                    problem = (f"{what[:-1]} {i} is {_said(_distribution(g))}, {source} has "
                               f"{_said(_distribution(w))}")
                if problem:
                    break
        if problem:
            why = ("input_args/output_args describe one microbatch; leave them out to let shapes be discovered"
                   if self.source == "declared" else
                   "stage._runtime_validate holds every step to the first step's shapes; leave it unset to let "
                   "shapes change between steps")
            raise errors()["PipeliningShapeError"](f"stage {self.stage}, microbatch {mb}: {problem} ({why})")


def _distribution(t: torch.Tensor) -> Any:
    """None for a plain tensor; a DTensor's placements and mesh (dim names, shape)."""
    if type(t) is torch.Tensor or not hasattr(t, "placements") or not hasattr(t, "device_mesh"):
        return None
    mesh = t.device_mesh
    return tuple(t.placements), tuple(mesh.mesh_dim_names or ()), tuple(mesh.shape)


def _said(d: Any) -> str:
    if d is None:
        return "a plain tensor"
    placements, names, shape = d
    return f"a DTensor with placements {placements} on mesh {names} of shape {shape}"
