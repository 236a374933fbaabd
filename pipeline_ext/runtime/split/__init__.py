"""The zero-bubble I/W split: one stage's backward as an input-grad half (I) and a weight-grad half (W).

I runs ``autograd.grad(outputs, stage_inputs)`` and records the gradient
arriving at each *boundary* node (an input-path node with edges into a
weight-only subgraph); W re-enters each boundary node with it, asking only for
its weight-only subgraph's parameters. Each piece of math runs once; where
that would not be exact, I runs the whole backward and says why.

The modules, each importing only the ones before it:

- ``marks.py``: every attribute the split puts on autograd nodes it does not
  own (which half a ``SplitFunction`` runs, what a compiled region leaves
  for W, ...), with the only code that sets, reads and clears them
  ([Note: marks on autograd nodes]);
- ``function.py``: ``SplitFunction``, a custom ``autograd.Function`` whose
  backward comes as ``backward_input`` and ``backward_weight``;
- ``keep.py``: what I keeps for W, where a value may be produced once only
  (selective checkpoints, ``once_only_hooks``, the stashes on the marked
  nodes), for W and for the memory accounting ([Note: what I keeps for W]);
- ``obstacles.py``: what in a graph stops the split from re-entering it node
  by node ([Note: what stops the I/W split]);
- ``graph.py``: the input region, the weight branches and the nodes that
  run twice, in the order W re-enters them
  ([Note: W's order is the same on every rank]);
- ``backward.py``: ``backward_input`` (I) and ``backward_weight`` (W), the
  engine calls;
- ``check.py``: ``split_check`` / ``split_obstacle``, the same answer before
  a run;
- ``compiled.py``: ``split_backend``, a ``torch.compile`` backend whose
  compiled backward is cut into a first part (I) and a rest (W); it knows
  only ``marks.py``.

``runtime/stage.py`` (``StageRunner.backward_input`` / ``backward_weight``)
is the one caller inside the library; ``runtime/memory.py`` reads checkpoint
frames through ``obstacles.py``.
"""

from pipeline_ext._lazy import lazy_names

_BACKWARD = "pipeline_ext.runtime.split.backward"
#: the package's names, each from its module (resolved at first use)
_EXPORTS = {
    "backward_input": _BACKWARD,
    "backward_weight": _BACKWARD,
    "DeferredWeightGrad": _BACKWARD,
    "UnsplitBackwardWarning": _BACKWARD,
    "split_check": "pipeline_ext.runtime.split.check",
    "split_obstacle": "pipeline_ext.runtime.split.check",
    "SplitFunction": "pipeline_ext.runtime.split.function",
    "once_only_hooks": "pipeline_ext.runtime.split.keep",
    "split_backend": "pipeline_ext.runtime.split.compiled",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_names(__name__, _EXPORTS, __all__)
