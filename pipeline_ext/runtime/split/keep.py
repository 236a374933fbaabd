"""What I keeps for W: saved values that may be produced once only, unpacked at I and handed to W.

[Note: what I keeps for W]
The I/W split (``backward.py``) runs the *boundary* nodes twice: at I for
their input edges, at W for their weight edges (a Linear's ``AddmmBackward``:
``g @ W`` at I, ``g.T @ x`` at W). Every other node runs once: the input-only
ones at I, the weight-only ones at W. So a saved value is read twice only
where a boundary node saved it, and only that read needs care when producing
the value twice is impossible or wrong:

- selective activation checkpointing (SAC, a checkpoint with a ``context_fn``):
  the recomputation replays the ops the policy saved from a cache that hands
  each value out once (``_CachedTorchDispatchMode``); a second recomputation
  (W's) is an error. Here I and W run under one ``GraphExecGroup`` (the
  *shared group*), so the region is recomputed once, at I. The recomputed
  values live in the checkpoint frame under that group, keyed by a handle its
  holder owns until the value is unpacked. A holder of a boundary node would
  drop its handle (and with it the value) at I's unpack; its handles dict is
  swapped for ``_SpareFirst``, which ignores that first release, so W's unpack
  finds the value. The weight-only nodes' values are unpacked at W only and
  stay as the recomputation left them; the input-only nodes' values go at I's
  unpack as usual. So between I and W the frame holds exactly what W needs,
  and ``KeptForWeight.release`` (after W) drops whatever W did not read.
  Plain non-reentrant checkpoints in such a graph share the group too (one
  recomputation instead of two); in a graph with only plain checkpoints I and
  W each recompute, as before (nothing kept between them: what the user chose
  checkpointing for).
- once-only saved-tensor hooks (offload and delete): a hook pair wrapped in
  ``once_only_hooks`` packs into a ``OnceOnlyPacked`` box. A boundary node's
  box is marked ``keep`` before I; I's unpack calls the user's unpack (once)
  and keeps the value in the box; W's unpack takes it from there and empties
  the box. An unknown hook pair on a boundary node is an obstacle (it may be
  once-only; ``obstacles.py``); on any other node it is unpacked once and
  harmless.
- once-only hooks around a plain checkpoint
  (``with once_only_hooks(...): checkpoint(block, x)``): inside the region the
  checkpoint's own hooks save, so the user's pair saves only the region's
  inputs (on the checkpoint frame, ``saved_args``, on no graph node), and
  every recomputation unpacks them again. A region recomputed at I and at W
  (each engine call outside one ``GraphExecGroup`` recomputes it: I's, and
  W's branch and output calls) would call the user's unpack once per
  recomputation. Those boxes are marked ``hold`` before I: the first unpack
  (at I, or W's first call) calls the user's unpack and keeps the value, every
  later one reads it, and ``KeptForWeight.release`` (after W) drops it. What
  is kept is the region's inputs, not its activations. An unknown pair there
  is an obstacle; a region recomputed once (under the shared group, or only
  at I) unpacks its inputs once and needs nothing.
- ``SplitFunction``s: what ``backward_input`` hands ``backward_weight``
  (``save_for_weight``, or the weight gradients I had to compute) waits on
  the node (``marks.WEIGHT_STASH``).
- regions compiled by ``split_backend``: the node's first call (I) runs the
  first part of the cut backward and leaves the rest, with the values the
  first part computed for it (for a Linear, the gradient at its output), on
  the node (``marks.CUT_STASH``) for its second call (W).

What is kept is real memory between I and W; ``KeptForWeight.tensors`` lists
all of it for the memory accounting (``ActivationMeter``, via
``StageRunner.on_kept``). ``KeptForWeight`` also sets, before I, the marks
that tell those nodes what I owes (``marks.INPUT_EDGES``, ``marks.DEFER``),
and its ``release`` leaves none on any node ([Note: marks on autograd nodes]).
"""
from __future__ import annotations

from typing import Any, Callable, Collection, Iterable, Optional

import torch

from pipeline_ext.runtime.split.function import input_positions
from pipeline_ext.runtime.split.marks import CUT_STASH, DEFER, INPUT_EDGES, WEIGHT_STASH

__all__ = ["OnceOnlyPacked", "once_only_hooks", "KeptForWeight"]


class _SpareFirst(dict):
    """A checkpoint holder's ``handles``: the first release (``None``) under ``gid`` is ignored, so a value unpacked
    at I is still there for W's unpack; every later assignment is a plain one."""

    def __init__(self, handles: dict, gid: Any) -> None:
        super().__init__(handles)
        self.gid = gid
        self.spared = False

    def __setitem__(self, key: Any, value: Any) -> None:
        if value is None and key is self.gid and not self.spared:
            self.spared = True
            return
        super().__setitem__(key, value)

    def drop(self) -> None:
        """Release the handle under ``gid`` for good (after W)."""
        if dict.get(self, self.gid) is not None:
            dict.__setitem__(self, self.gid, None)


class OnceOnlyPacked:
    """What ``once_only_hooks`` packs: the user's packed object, and the unpacked value while I keeps it for W."""

    __slots__ = ("packed", "keep", "hold", "kept", "unpacked")

    def __init__(self, packed: Any) -> None:
        self.packed = packed
        self.keep = False  # set by the split before I: the next unpack's value is kept for one more
        self.hold = False  # set by the split before I: the next unpack's value is kept for every later one
        self.kept: Optional[torch.Tensor] = None
        self.unpacked = 0  # calls of the user's unpack


class once_only_hooks(torch.autograd.graph.saved_tensors_hooks):
    """``saved_tensors_hooks(pack_hook, unpack_hook)`` for a pair whose unpack may run once per saved tensor.

    Offload-and-delete hooks (move the tensor away at pack, bring it back and
    forget it at unpack) cannot be unpacked twice, and the I/W split reads a
    boundary node's saved tensors twice; an unknown pair there makes the split
    fall back to a whole backward. Wrapped here, the split calls
    ``unpack_hook`` once, at I, keeps the value for W and drops it after W
    ([Note: what I keeps for W]). Outside the split (a plain backward) the pair
    behaves exactly as unwrapped. ``pack_hook`` may also be a
    ``saved_tensors_hooks`` object (its ``pack_hook`` and ``unpack_hook`` are
    used)::

        with pipeline_ext.once_only_hooks(offload, fetch_and_delete):
            out = block(x)
    """

    def __init__(self, pack_hook: Any, unpack_hook: Optional[Callable[[Any], torch.Tensor]] = None) -> None:
        if unpack_hook is None:
            pack_hook, unpack_hook = pack_hook.pack_hook, pack_hook.unpack_hook
        if not callable(pack_hook) or not callable(unpack_hook):
            raise TypeError("once_only_hooks needs a pack_hook and an unpack_hook (or a saved_tensors_hooks object)")
        user_pack, user_unpack = pack_hook, unpack_hook

        def pack(t: torch.Tensor) -> OnceOnlyPacked:
            return OnceOnlyPacked(user_pack(t))

        def unpack(box: OnceOnlyPacked) -> torch.Tensor:
            if box.kept is not None:  # a later read of what an earlier one kept
                value = box.kept
                if not box.hold:  # the last read (W's of a boundary node): hand it over, keep nothing
                    box.kept = None
                return value
            box.unpacked += 1
            value = user_unpack(box.packed)
            if box.keep or box.hold:
                box.keep, box.kept = False, value
            return value

        super().__init__(pack, unpack)


class KeptForWeight:
    """What one microbatch's I keeps for its W ([Note: what I keeps for W]); ``release`` after W.

    ``group``: the shared ``GraphExecGroup`` (None: no checkpoint frame needs
    one); ``frames``: the checkpoint frames recomputed under it; ``holders``:
    their boundary nodes' holders; ``boxes``: the boundary nodes'
    ``OnceOnlyPacked`` boxes; ``split_nodes``: the boundary nodes of
    ``SplitFunction``s, whose stash for W (``save_for_weight``) counts too;
    ``held``: the boxes of checkpointed regions' inputs that more than one
    recomputation unpacks; ``compiled``: the boundary nodes of regions
    compiled by ``split_backend``, whose cut (``marks.CUT_STASH``) counts too.
    """

    def __init__(self, group: Any = None, frames: Iterable[Any] = (), holders: Iterable[Any] = (),
                 boxes: Iterable[OnceOnlyPacked] = (), split_nodes: Iterable[Any] = (),
                 held: Iterable[OnceOnlyPacked] = (), compiled: Iterable[Any] = ()) -> None:
        self.group = group
        self.frames = list(frames)
        self.holders = list(holders) if group is not None else []
        self.boxes = list(boxes)
        self.split_nodes = list(split_nodes)
        self.held = list(held)
        self.compiled = list(compiled)

    def __bool__(self) -> bool:
        return bool(self.group is not None or self.boxes or self.split_nodes or self.held or self.compiled)

    def arm(self, region: Collection[Any]) -> None:
        """Before I (``region``: the nodes I runs): boundary holders keep their value past I's unpack, boundary
        boxes keep theirs for W's read, held boxes theirs for every later recomputation; ``SplitFunction`` nodes
        learn which inputs' gradients I owes, compiled nodes which output slots to leave for W (those outside
        ``region``)."""
        for h in self.holders:
            if not isinstance(h.handles, _SpareFirst) or h.handles.gid is not self.group:
                h.handles = _SpareFirst(h.handles, self.group)
        for b in self.boxes:
            b.keep = True
        for b in self.held:
            b.hold = True
        for node in self.split_nodes:
            INPUT_EDGES.set(node, input_positions(node, region))
        for node in self.compiled:
            DEFER.set(node, frozenset(i for i, (c, _) in enumerate(node.next_functions)
                                      if c is not None and c not in region))

    def tensors(self) -> list[torch.Tensor]:
        """The tensors kept now (after I): recomputed values W will read, once-only values, SplitFunction stashes,
        the values compiled regions' first parts handed their rests."""
        out: list[torch.Tensor] = []
        for f in self.frames:
            got = f.recomputed.get(self.group) if self.group is not None else None
            if got is not None:
                out.extend(t for t in list(got.values()) if isinstance(t, torch.Tensor))
        out.extend(b.kept for b in (*self.boxes, *self.held) if b.kept is not None)
        for node in self.split_nodes:
            out.extend(t for t in WEIGHT_STASH.get(node, ()) if isinstance(t, torch.Tensor))
        for node in self.compiled:
            cut = CUT_STASH.get(node)
            if cut is not None:
                out.extend(t for t in cut.values if isinstance(t, torch.Tensor))
        return out

    def release(self) -> None:
        """After W (or when it will not run): drop everything still kept, and every mark ``arm`` set."""
        for b in self.boxes:
            b.keep, b.kept = False, None
        for b in self.held:
            b.hold, b.kept = False, None
        for node in self.split_nodes:
            WEIGHT_STASH.clear(node)
            INPUT_EDGES.clear(node)
        for node in self.compiled:
            DEFER.clear(node)
            CUT_STASH.clear(node)
        g = self.group
        if g is not None:
            for f in self.frames:
                for ref in f.weak_holders:
                    h = ref()
                    if h is None:
                        continue
                    if isinstance(h.handles, _SpareFirst):
                        h.handles.drop()
                    elif h.handles.get(g) is not None:
                        h.handles[g] = None
                for table in (f.recomputed, f.recomp_counter, f.is_recomputed):
                    table.pop(g, None)
        self.frames, self.holders, self.boxes, self.split_nodes, self.held, self.compiled = [], [], [], [], [], []
