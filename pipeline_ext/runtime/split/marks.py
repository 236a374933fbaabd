"""The marks the I/W split puts on autograd nodes: every name, and the only code that sets, reads and clears them.

[Note: marks on autograd nodes]
The split steers nodes it does not own (a ``SplitFunction``'s node, which is
its ``ctx``; a ``split_backend`` region's ``CompiledFunctionBackward``) by
attributes on them, because the engine calls a node's backward with its
gradients only: an attribute is the one channel from the runtime into that
call, and from one call of the node (I) to its next (W). Each mark is a
``Mark`` here, set, read and cleared through its methods only (nothing else
calls ``setattr`` on a node), and has one writer and one clearer.

On ``SplitFunction`` nodes (``function.py`` reads them):

- ``PHASE``: which half the next engine call runs ("I", "W"; absent: the
  whole backward). Set by ``backward.py`` around each engine call of the
  split, cleared when that call returns.
- ``INPUT_EDGES``: the forward inputs whose gradients I owes (they lead to a
  stage input). Set by ``KeptForWeight.arm`` before I, cleared by
  ``KeptForWeight.release`` after W.
- ``WEIGHT_STASH``: what the node's I leaves its W (``save_for_weight``'s
  tensors, or the weight gradients I had to compute). Set by the node at I,
  taken by it at W; ``KeptForWeight.release`` drops what W did not take.
- ``SHARED_SAVED``: the saved tensors unpacked once for both halves of one
  engine call. Set and cleared by the node within that call.

On ``split_backend`` nodes (``compiled.py`` reads them):

- ``DEFER``: the output slots the node's first call leaves for W. Set by
  ``KeptForWeight.arm`` before I, taken by the node at I;
  ``KeptForWeight.release`` clears one I never reached.
- ``CUT_STASH``: a ``CutForWeight``, what the node's I leaves its W. Set by
  the node at I, taken by it at W; ``KeptForWeight.release`` drops what W did
  not take.

On a compiled forward (``CompiledFunction.compiled_fw``), not a node:
``mark_splittable`` (by ``split_backend``) and ``splittable(node)`` (the
obstacle check, through the node's ``_forward_cls``); it describes the code
and is never cleared.

The two stashes are different things and never meet on one node:
``WEIGHT_STASH`` holds what a user's ``backward_input`` hands its
``backward_weight`` (or the weight gradients I had to compute itself);
``CUT_STASH`` holds the cut of a compiled backward: the slots left for W, the
compiled rest and the values the first part hands it. Both are memory held
from I to W, and ``KeptForWeight.tensors`` counts both
([Note: what I keeps for W] in ``keep.py``). A node outside the split (B, a
plain ``loss.backward()``) carries no mark and runs its whole backward.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

__all__ = ["Mark", "PHASE", "INPUT_EDGES", "WEIGHT_STASH", "SHARED_SAVED", "DEFER", "CUT_STASH", "CutForWeight",
           "mark_splittable", "splittable"]


class Mark:
    """One attribute the split puts on autograd nodes ([Note: marks on autograd nodes])."""

    __slots__ = ("attr", "what")

    def __init__(self, attr: str, what: str) -> None:
        self.attr = attr
        #: what the value means, for the reader of a ``repr``
        self.what = what

    def set(self, node: Any, value: Any) -> None:
        setattr(node, self.attr, value)

    def get(self, node: Any, default: Any = None) -> Any:
        return getattr(node, self.attr, default)

    def clear(self, node: Any) -> None:
        if hasattr(node, self.attr):
            delattr(node, self.attr)

    def take(self, node: Any, default: Any = None) -> Any:
        """The value, cleared from the node (``default`` when it carries none)."""
        value = getattr(node, self.attr, default)
        self.clear(node)
        return value

    def set_all(self, nodes: Sequence[Any], value: Any) -> None:
        """``set`` on each of ``nodes``; a ``value`` of None clears them."""
        for node in nodes:
            if value is None:
                self.clear(node)
            else:
                self.set(node, value)

    def __repr__(self) -> str:
        return f"Mark({self.attr!r}: {self.what})"


#: which half a SplitFunction node runs in the current engine call: "I", "W"; absent: the whole backward
PHASE = Mark("_pipeline_ext_phase", "the half a SplitFunction runs in this engine call")
#: the positions of a SplitFunction's forward inputs that lead to a stage input (I owes their gradients)
INPUT_EDGES = Mark("_pipeline_ext_input_edges", "forward inputs whose gradients I owes")
#: what a SplitFunction's I leaves for its W: ``save_for_weight``'s tensors, or the weight gradients I computed
WEIGHT_STASH = Mark("_pipeline_ext_weight_stash", "what a SplitFunction's backward_input leaves its backward_weight")
#: a SplitFunction's saved tensors unpacked once for both halves of one engine call
SHARED_SAVED = Mark("_pipeline_ext_shared_saved", "saved tensors unpacked once for both halves")
#: the output slots (``next_functions`` indices) of a split_backend node that its first call leaves for W
DEFER = Mark("_pipeline_ext_defer", "slots a compiled backward leaves for W")
#: what a split_backend node's first call (I) leaves for its second (W): a ``CutForWeight``
CUT_STASH = Mark("_pipeline_ext_cut_stash", "a compiled backward's rest and the values its first part handed on")

_SPLITTABLE = "_pipeline_ext_splittable"


class CutForWeight(NamedTuple):
    """``CUT_STASH``'s value: the deferred slots, the compiled rest of the backward, the values handed to it."""

    slots: frozenset
    rest: Any
    values: list


def mark_splittable(compiled_forward: Any) -> None:
    """Say that ``compiled_forward`` (reached as ``CompiledFunction.compiled_fw``) was compiled by ``split_backend``,
    so its backward can be cut into I and W."""
    setattr(compiled_forward, _SPLITTABLE, True)


def splittable(node: Any) -> bool:
    """``node`` is a region compiled by ``split_backend`` (its backward honours ``DEFER``)."""
    fwd = getattr(type(node), "_forward_cls", None)
    return getattr(getattr(fwd, "compiled_fw", None), _SPLITTABLE, False) is True
