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
from typing import Any, Optional

import torch

__all__ = ["Declared", "errors", "check_grads"]


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
    """Stage ``stage``'s declared ``inputs`` and ``outputs`` (one microbatch's; None: not declared), and the
    gradients torch's ``output_grads`` / ``input_grads`` describe (see [Note: declared gradients])."""

    stage: int
    inputs: Any = None
    outputs: Any = None
    #: where the shapes come from, as errors name it: the stage's arguments, or its first step
    #: (``PipelineStage._runtime_validate``)
    source: str = "declared"
    output_grads: Any = None
    input_grads: Any = None

    def check(self, what: str, mb: int, actual: Any) -> None:
        """Raise ``PipeliningShapeError`` unless ``actual`` (microbatch ``mb``'s "inputs" or "outputs") matches.

        The declared gradients of those inputs (outputs) are checked against them too ([Note: declared gradients]).
        """
        self._check_values(what, mb, actual)
        grads = self.input_grads if what == "inputs" else self.output_grads
        if grads is not None:
            check_grads(self.stage, f"{what[:-1]}_grads", grads, actual, f"the stage's {what}", mb)

    def _check_values(self, what: str, mb: int, actual: Any) -> None:
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


# [Note: declared gradients]
# torch's PipelineStage takes ``output_grads`` (the gradients of its outputs, received from the next stage) and
# ``input_grads`` (those of its inputs, sent to the previous one): static metadata that sizes torch's gradient
# buffers and, for DTensors, says how to rebuild them. Here a gradient needs no metadata of its own: it travels
# in the layout of the tensor it belongs to (shape, dtype, and for a DTensor the local shard in the forward's own
# placements, [Note: DTensors between stages] in runtime/dtensor_wire.py), which is discovered with the forward
# (and agreed between the ranks). So the declared gradients are checked against that discovered layout: entry
# ``i`` against output (input) ``i`` of every microbatch, as ``output_args`` / ``input_args`` are, and against
# ``output_args`` / ``input_args`` when those are given too, at construction. What must agree: the number of
# entries (None: a tensor without a gradient, skipped), the global shape, the dtype, and for a DTensor its being
# one and its mesh (dim names, shape). A DTensor gradient's placements are not held to the tensor's: torch may
# carry a Partial gradient where the activation was Replicate; here the gradient is redistributed to the forward
# placements before it travels (``from_local``'s backward), the same values either way.

def check_grads(stage: int, what: str, declared: Any, actual: Any, against: str, mb: Optional[int] = None) -> None:
    """Raise ``PipeliningShapeError`` unless ``declared`` (``output_grads`` or ``input_grads``) fits ``actual``.

    ``actual``: the outputs (inputs) whose gradients ``declared`` describes, a tensor or a sequence, flattened;
    ``against`` names them in the message ("output_args", "the stage's outputs").
    """
    from torch.utils import _pytree as pytree

    if declared is None:
        return
    want = tuple(declared) if isinstance(declared, (tuple, list)) else (declared,)
    got = pytree.tree_leaves(actual)
    where = f"stage {stage}" + (f", microbatch {mb}" if mb is not None else "")
    problem = None
    if len(want) != len(got):
        problem = (f"{what} has {len(want)} entries, {against} {len(got)} (one entry per tensor; None for one "
                   "without a gradient)")
    else:
        for i, (w, g) in enumerate(zip(want, got)):
            if w is None:
                continue
            if not isinstance(g, torch.Tensor):
                problem = f"{what}[{i}] is a tensor {tuple(w.shape)}, {against}[{i}] is a {type(g).__name__}"
            elif w.shape != g.shape:
                problem = f"{what}[{i}] has shape {tuple(w.shape)}, {against}[{i}] has shape {tuple(g.shape)}"
            elif w.dtype != g.dtype:
                problem = f"{what}[{i}] has dtype {w.dtype}, {against}[{i}] has dtype {g.dtype}"
            else:
                dw, dg = _distribution(w), _distribution(g)
                if (dw is None) != (dg is None) or (dw is not None and dw[1:] != dg[1:]):
                    problem = f"{what}[{i}] is {_said(dw, mesh_only=True)}, {against}[{i}] is {_said(dg, mesh_only=True)}"
            if problem:
                break
    if problem:
        raise errors()["PipeliningShapeError"](
            f"{where}: {problem} ({what} describes the gradients of the stage's "
            f"{'outputs' if what.startswith('output') else 'inputs'}, one microbatch's; leave it out to let them "
            "be discovered)")


def _distribution(t: torch.Tensor) -> Any:
    """None for a plain tensor; a DTensor's placements and mesh (dim names, shape)."""
    if type(t) is torch.Tensor or not hasattr(t, "placements") or not hasattr(t, "device_mesh"):
        return None
    mesh = t.device_mesh
    return tuple(t.placements), tuple(mesh.mesh_dim_names or ()), tuple(mesh.shape)


def _said(d: Any, mesh_only: bool = False) -> str:
    if d is None:
        return "a plain tensor"
    placements, names, shape = d
    if mesh_only:
        return f"a DTensor on mesh {names} of shape {shape}"
    return f"a DTensor with placements {placements} on mesh {names} of shape {shape}"
