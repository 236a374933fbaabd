"""StageRunner: one model chunk, and the four things a schedule asks of it.

A schedule says "run F (or B, I, W) of stage s on microbatch m". The runner
turns that into autograd calls and keeps, per microbatch, exactly the state the
later actions need: the inputs and outputs between F and B/I, the deferred
weight-grad work between I and W. State is dropped at its last use, so a
schedule's memory promise (1F1B: at most p microbatches live on rank 0) holds.

Conventions, shared with the executor:
- a stage's outputs travel as a flat tuple; the next stage is called with them
  as positional arguments;
- the gradient sent back for a stage's inputs has one entry per floating-point
  input tensor (zeros where autograd produced none), in order, so sender and
  receiver agree on the message without extra metadata;
- the last stage multiplies each microbatch's loss by a weight (its share of
  the batch's rows) before backward, so gradients add up to those of the mean
  loss over the whole batch even when microbatches are uneven;
- a data-parallel wrapped stage (DDP, FSDP2) gets a ``grad_sync``
  (comm/data_parallel.py): begun at the step's first forward, asked before
  every B/I/W, finished after the step's last B or W (one per microbatch), so
  gradients are reduced exactly once per step.
- skip connections (``pipeline_ext.skip``): the skips popped on this stage
  arrive with F (``skips``) and become leaves that collect their gradient like
  inputs; the skips this stage stashes for later stages leave with F
  (``take_stashed``) and become backward roots like outputs, their gradients
  arriving with B/I (``skip_grads``).
- sent outputs are released (``release_outputs``, on by default): the runner
  keeps each eligible output's autograd edge and shape, not the tensor, so the
  activation's bytes live only as long as someone else needs them (the
  channel until its send has copied them, the next stage on this rank, a
  saved tensor of the graph). See ``ReleasedOutput``.
"""
from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils.hooks import RemovableHandle

from pipeline_ext.runtime.split.backward import (
    DeferredWeightGrad,
    UnsplitBackwardWarning,
    backward_input,
    backward_weight,
)
from pipeline_ext.runtime import dtensor_wire
from pipeline_ext.runtime.ops import check_movable, movable
from pipeline_ext.runtime.pieces import StagePieces
from pipeline_ext.skip.skippable import has_skippables
from pipeline_ext.skip.tracker import SkipKey, call_with_skips

Skips = dict[SkipKey, Optional[torch.Tensor]]
LossFn = Callable[[Any, Any], torch.Tensor]

__all__ = ["StagePosition", "StageRunner", "StageError", "ReleasedOutput", "as_output_tuple", "is_differentiable",
           "detach_tree", "split_report"]


class GradientSync:
    """What a runner calls around one training step of a wrapped stage (no-op base)."""

    name = "none"
    modules: list[nn.Module] = []

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.modules)} wrapped module(s))"

    def begin(self, planned: bool = False) -> None:
        """Before the step's first forward (or, ``planned``, its first UNSHARD): turn per-backward syncing off."""

    def before_backward(self) -> None:
        """Before a B, I or W: make the parameters usable by backward."""

    def finish(self, replace: Optional[Callable[[], None]] = None) -> None:
        """After the step's last B/W of the stage: reduce once (``replace``: what runs instead of the
        reduction), give back the user's settings."""

    def abort(self) -> None:
        """The step failed: give back the user's settings without reducing."""

    # [Note: parameters placed by the schedule] A schedule with UNSHARD / RESHARD / REDUCE_GRAD actions (a
    # parameter budget, schedules/fsdp.py) runs these instead of the wrapper's own hooks: ``begin(planned=True)``
    # turns the wrapper's reshard-after-forward off for the step (the plan decides when parameters go), UNSHARD
    # starts the all-gather, every compute action of the stage waits for it first (``ready``, which refuses a
    # stage the plan left sharded instead of letting the wrapper gather it unseen), RESHARD frees, REDUCE_GRAD is
    # ``finish``. Only a sharding wrapper (FSDP2) has them.
    shards = False  #: whether the wrapper shards parameters (so UNSHARD / RESHARD mean something)

    def param_bytes(self) -> int:
        """Bytes of the stage's parameters when unsharded (what an UNSHARD makes the rank hold)."""
        return 0

    def unshard(self) -> None:
        """UNSHARD: start gathering the stage's parameters (asynchronous where the backend allows)."""
        raise NotImplementedError(f"{self.name} does not shard parameters: a schedule cannot UNSHARD it")

    def ready(self, what: str) -> None:
        """Before a compute action of a planned step: wait for the stage's gathering; raise if it is sharded."""

    def end_step(self) -> None:
        """A planned step's end: wait for the reductions its REDUCE_GRAD issued (they overlap the rest of the step);
        after a planned eval, put back the settings ``begin`` changed."""

    def reshard(self) -> None:
        """RESHARD: free the stage's gathered parameters (their accumulated gradients stay)."""
        raise NotImplementedError(f"{self.name} does not shard parameters: a schedule cannot RESHARD it")


class StagePosition:
    """Where a stage sits in the pipeline; shared by every object that stands for a stage."""

    stage_index: int
    num_stages: int

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1


class StageError(RuntimeError):
    """A stage was asked for something its state cannot serve (names stage and microbatch)."""


def is_differentiable(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def as_output_tuple(out: Any, stage: int, microbatch: Optional[int] = None,
                    dtensors: bool = False) -> tuple[torch.Tensor, ...]:
    """A stage output as the flat tuple of tensors that travels to the next stage.

    Each must be a tensor the core can move (``ops.movable``: a plain dense
    one; see [Note: tensors the core can read] in runtime/ops.py): checked here,
    where a stage's output is first seen, on every transport alike (processes,
    threads of a Pipe, two stages of one rank), so a DTensor or a sparse
    output is refused naming the stage, the output and the microbatch.
    With ``dtensors`` (a ``PipelineStage``'s runner) DTensor outputs travel
    in wire form instead (their local shards and one layout tensor;
    [Note: DTensors between stages] in runtime/dtensor_wire.py).
    """
    items = out if isinstance(out, (tuple, list)) else (out,)
    wire = False
    for i, t in enumerate(items):
        if movable(t):
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"stage {stage} returned a {type(t).__name__} at output position {i}; stages that feed another "
                "stage must return a tensor or a tuple/list of tensors"
            )
        mb = "" if microbatch is None else f", microbatch {microbatch}"
        if dtensor_wire.is_async_collective(t):
            # a plain tensor whose collective has not been waited on (TP's ``use_local_output=True``): the
            # clone waits and is a plain tensor in the graph (a copy, for this kind of output only)
            items = list(items)
            items[i] = dtensor_wire.settled(t)
            continue
        if dtensors and isinstance(t, dtensor_wire.dtensor_type()):
            if not dtensor_wire.is_async_collective(t._local_tensor):
                check_movable(t._local_tensor, f"the local shard of stage {stage}'s output at position {i}{mb}")
            wire = True
            continue
        check_movable(t, f"stage {stage}'s output at position {i}{mb}")
    return dtensor_wire.to_wire(items, stage, microbatch) if wire else tuple(items)


@dataclass(frozen=True)
class ReleasedOutput:
    """An output the runner no longer holds: where its gradient enters the graph, and its shape.

    Megatron's ``deallocate_output_tensor`` frees a sent output by swapping its
    ``.data`` for a 1-element tensor and then bypasses ``autograd.backward``'s
    shape check. Swapping ``.data`` mutates a tensor others may hold: the
    user's module (an output it keeps), or a node of the graph that saved the
    output as *its input* (``y * y`` saves ``y`` itself, so the swap changes
    what that backward reads, silently). Here nothing is mutated: the runner
    drops its reference and keeps the output's ``GradientEdge`` (the node and
    input slot autograd would start from; backward through it is the same
    engine call as through the tensor, and ``autograd.backward``/``grad`` take
    edges, checking the gradient against the node's recorded shape). The
    bytes are then freed exactly when nobody needs them: after the channel's
    send has copied them (every channel owns its bytes when ``send`` returns
    for activations, ``owned=False``), never while the next stage on this
    rank reads them (it holds the tensor), never while backward needs them (a
    saved tensor holds the storage).

    ``edge`` is None for an output that does not require grad: it is no root
    of backward, only a place in the gradient message (``shape`` checks it).
    """

    shape: torch.Size
    edge: Optional[GradientEdge]

    @property
    def requires_grad(self) -> bool:
        return self.edge is not None


Root = Any  # a backward root: a tensor, or a ReleasedOutput's edge


@dataclass
class _State:
    """What one microbatch leaves behind between its actions."""

    # roots of backward: the loss on the last stage (its gradient is the microbatch's loss weight), else
    # every floating-point output (one received gradient each, in order; those not requiring grad are
    # skipped); a released output is a ReleasedOutput
    outputs: list[Any] = field(default_factory=list)
    loss_weight: Any = 1.0  # the last stage's: a float, or a 0-d tensor
    grad_inputs: list[torch.Tensor] = field(default_factory=list)  # floating-point inputs, in order
    deferred: Optional[DeferredWeightGrad] = None
    # checkpointed microbatch: (args, kwargs, target, loss_weight, skips) to re-run F with autograd before backward
    recompute: Optional[tuple[tuple[Any, ...], Optional[dict[str, Any]], Any, float, Skips, Optional[LossFn]]] = None
    skip_inputs: list[tuple[SkipKey, torch.Tensor]] = field(default_factory=list)  # popped here, differentiable
    skip_roots: list[tuple[SkipKey, torch.Tensor]] = field(default_factory=list)  # stashed for later stages
    wire: bool = False  # its inputs came in wire form (DTensors): their gradients may need a wait
    piece_leaves: list[torch.Tensor] = field(default_factory=list)  # earlier pieces' keys/values it joined (pieces.py)


class StageRunner(StagePosition):
    """Runs F / B / I / W of one stage on microbatches.

    ``loss_fn(output, target)`` is used on the last stage only. With
    ``scale_grads`` the executor passes each microbatch's row share as
    ``loss_weight``; without it the weight is 1 (plain sum, as torch does).

    ``call(mb, module, args, kwargs)`` runs the module (default: a plain call);
    ``Pipe`` wraps it to seed RNG per (stage, microbatch). ``checkpoint(mb)``
    says whether microbatch ``mb`` recomputes its forward in backward instead
    of keeping activations.

    ``grad_sync`` (with ``n_microbatches``, the microbatches of one training
    step) syncs a data-parallel wrapped stage once per step; see
    ``comm/data_parallel.py``.

    ``on_kept`` (default None): called after each I with the
    tensors that I keeps for W beyond the graph's own saved ones (values of a
    selective checkpoint recomputed at I, once-only hooks' values, a
    ``SplitFunction``'s stash, what a ``split_backend`` region's first part
    hands its rest; [Note: what I keeps for W]), for the memory accounting
    (``ActivationMeter.track``). ``meshes``: where DTensor inputs are rebuilt
    (a ``PipelineStage``'s runner); None refuses DTensors between stages.

    [Note: a runner is configured once, instruments attach]
    Everything a runner runs with is a constructor argument, given by the one
    that builds it (``PipelineStage._make_runner``, the ``Pipe``); nothing is
    assigned into it afterwards from another module. A measuring tool (the
    ``ActivationMeter``) comes later, to runners a schedule already built, so
    it cannot be an argument: it attaches with ``instrument(wrap_call=,
    on_kept=)``, the one way in, which adds to what the runner was built with
    (never replaces it) and returns the handle that takes it off again.

    ``split_fallback``: why this stage's I ran the whole backward (the
    ``split/obstacles.py`` reason of the first I that had to), None while every I
    split; ``split_seen``: whether an I ran at all. ``split_report`` of the
    front ends collects them per stage.

    ``release_outputs`` (default on): keep
    only the autograd edge of each sent output, not the tensor, so its bytes
    are freed once the send has copied them (``ReleasedOutput``). Backward is
    the same engine call, so gradients are bitwise those without it. Outputs
    where that is not plainly so keep the tensor: a leaf that requires grad (a
    parameter, an input returned as is), a view (its gradient function can be
    rebuilt by an in-place op on its base), a non-contiguous tensor, a tensor
    subclass, one sharing storage with an input (nothing to free).
    Off: every output is held until its backward (for debugging, or a caller
    reading ``held()`` outputs).
    """

    def __init__(
        self,
        module: nn.Module,
        stage_index: int,
        num_stages: int,
        loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
        call: Optional[Callable[[int, nn.Module, Sequence[Any], dict[str, Any]], Any]] = None,
        checkpoint: Optional[Callable[[int], bool]] = None,
        grad_sync: Optional[GradientSync] = None,
        n_microbatches: Optional[int] = None,
        release_outputs: bool = True,
        on_kept: Optional[Callable[[list[torch.Tensor]], Any]] = None,
        meshes: Optional[dtensor_wire.MeshFinder] = None,
        pieces: int = 1,
        seq_dim: int = 1,
    ) -> None:
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index must be in [0, {num_stages}), got {stage_index}")
        if grad_sync is not None and (n_microbatches is None or n_microbatches < 1):
            raise ValueError(f"a grad_sync needs n_microbatches >= 1 (the microbatches of one step), got {n_microbatches}")
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.loss_fn = loss_fn
        self.call = call if call is not None else _plain_call
        self.checkpoint = checkpoint
        self.release_outputs = release_outputs
        self._states: dict[int, _State] = {}
        #: most microbatches held at once since construction (or ``reset_peak``)
        self.peak_live_microbatches = 0
        self.losses: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, Any] = {}
        #: the last stage keeps each microbatch's output for the step's caller; off (torch's
        #: ``return_outputs=False``): none is kept, so a step that returns nothing holds no logits until its end
        self.keep_outputs = True
        self.grad_sync = grad_sync
        self._n_microbatches = n_microbatches
        self._sync_left: Optional[int] = None  # B/W still to come before the reduction; None: no sync under way
        #: this step's parameters are placed by the schedule's UNSHARD / RESHARD / REDUCE_GRAD actions
        #: ([Note: parameters placed by the schedule]); set by the step's first UNSHARD, cleared by REDUCE_GRAD
        self._planned = False
        self._warned_unsplit = False
        self.on_kept = on_kept
        #: attached measuring tools, in order: (wrap of ``call`` or None, extra ``on_kept`` or None)
        self._instruments: OrderedDict[int, tuple[Optional[Callable[[Any], Any]], Optional[Callable[..., Any]]]] \
            = OrderedDict()
        #: why an I of this stage fell back to the whole backward (first reason seen); None: every I split
        self.split_fallback: Optional[str] = None
        #: an I ran on this stage (so ``split_fallback`` says something)
        self.split_seen = False
        self._skippable = has_skippables(module)  # its forwards run under a skip tracker of their own
        self._stashed: dict[int, Skips] = {}  # per microbatch, detached, for take_stashed
        self._skip_grads: dict[int, Skips] = {}  # per microbatch, for take_skip_grads
        #: where DTensor inputs are rebuilt (a ``PipelineStage``'s runner); None: DTensors between stages are
        #: refused (the Pipe). [Note: DTensors between stages] in runtime/dtensor_wire.py
        self.meshes = meshes
        #: sequence pieces (Seq1F1B): microbatch ``mb`` is piece ``mb % pieces`` of sequence ``mb // pieces``, and the
        #: keys and values causal attention carries between a sequence's pieces live here (runtime/pieces.py)
        self.pieces = StagePieces(module, stage_index, pieces, seq_dim) if pieces > 1 else None
        if self.pieces is not None and checkpoint is not None:
            raise ValueError(f"stage {stage_index}: recomputing whole microbatches (checkpoint=) does not combine with "
                             "sequence pieces; checkpoint inside the model (torch.utils.checkpoint) instead")

    def instrument(self, wrap_call: Optional[Callable[[Any], Any]] = None,
                   on_kept: Optional[Callable[[list[torch.Tensor]], Any]] = None) -> RemovableHandle:
        """Attach a measuring tool: ``wrap_call(call)`` wraps each forward's ``call``, ``on_kept(tensors)`` is
        called after each I beside the runner's own; ``handle.remove()`` detaches it ([Note: a runner is
        configured once, instruments attach])."""
        handle = RemovableHandle(self._instruments)
        self._instruments[handle.id] = (wrap_call, on_kept)
        return handle

    def _forward_call(self) -> Callable[..., Any]:
        """``call``, wrapped by the attached instruments (first attached innermost)."""
        call = self.call
        for wrap, _ in self._instruments.values():
            if wrap is not None:
                call = wrap(call)
        return call

    @property
    def live_microbatches(self) -> int:
        """Microbatches whose activations (or deferred weight-grad work) are held."""
        return len(self._states)

    def held(self) -> dict[int, Any]:
        """What is held per microbatch between its F and its backward (torch's ``fwd_cache``); empty after a step."""
        return dict(self._states)

    def reset_peak(self) -> None:
        self.peak_live_microbatches = len(self._states)

    def reset(self, keep_outputs: bool = True) -> None:
        """Forget everything of the previous step (after an error, say); ``keep_outputs``: whether the next step
        keeps the last stage's outputs for its caller (handed in per step by the runner's owner, the schedule)."""
        self._states.clear()
        self.keep_outputs = keep_outputs
        self.peak_live_microbatches = 0
        self.losses.clear()
        self.outputs.clear()
        self._stashed.clear()
        self._skip_grads.clear()
        if self.pieces is not None:
            self.pieces.reset()
        if self.grad_sync is not None and (self._sync_left is not None or self._planned):  # a planned eval too
            self._sync_left = None
            self.grad_sync.abort()
        self._planned = False

    # -- F ---------------------------------------------------------------------------------
    def forward(
        self,
        mb: int,
        args: Sequence[Any],
        kwargs: Optional[dict[str, Any]] = None,
        target: Any = None,
        loss_weight: float = 1.0,
        skips: Optional[Skips] = None,
        loss_fn: Optional[LossFn] = None,
    ) -> tuple[torch.Tensor, ...]:
        """Run the stage on microbatch ``mb``; return its outputs, detached, to hand on.

        On the last stage with a loss (``loss_fn``: this step's, else the
        runner's own) and a ``target`` the loss is computed,
        kept (unweighted) in ``losses[mb]``, and the weighted loss becomes the
        root of this microbatch's backward. A checkpointed microbatch runs
        without autograd here and keeps only its inputs; its backward re-runs it.
        """
        if mb in self._states:
            raise StageError(f"stage {self.stage_index}: F of microbatch {mb} ran twice without its backward")
        if self.grad_sync is not None and self._sync_left is None and torch.is_grad_enabled():
            self.grad_sync.begin()  # the step's first forward of this stage
            self._sync_left = self._n_microbatches
        if self._planned:
            self.grad_sync.ready(f"stage {self.stage_index}: F of microbatch {mb}")
        state = _State()
        if not self.is_first:  # received activations become leaves
            args = tuple([self._as_input(a) for a in args])
        skips = {k: self._as_input(v) for k, v in skips.items()} if skips else {}
        if torch.is_grad_enabled() and self.checkpoint is not None and self.checkpoint(mb):
            with torch.no_grad():
                sent = self._run(mb, state, args, kwargs, target, loss_weight, skips, loss_fn)
            state.recompute = (tuple(args), kwargs, target, loss_weight, skips, loss_fn)
            self._keep(mb, state)
            return sent
        return self._run(mb, state, args, kwargs, target, loss_weight, skips, loss_fn)

    def _run(
        self, mb: int, state: _State, args: Sequence[Any], kwargs: Optional[dict[str, Any]], target: Any,
        loss_weight: float, skips: Skips, loss_fn: Optional[LossFn] = None,
    ) -> tuple[torch.Tensor, ...]:
        """The forward proper: fills ``state`` with what backward needs (when autograd is on)."""
        if not self.is_first:
            state.grad_inputs = [a for a in args if is_differentiable(a)]  # a DTensor's local shard: the leaf
            if self.meshes is not None and dtensor_wire.is_wire(args):
                args = dtensor_wire.from_wire(args, self.meshes, self.stage_index, mb)
                state.wire = True
        if skips:
            state.skip_inputs = [(k, v) for k, v in skips.items() if is_differentiable(v)]
        call = self._forward_call() if self._instruments else self.call
        with contextlib.nullcontext() if self.pieces is None else self.pieces.forward(mb, args):
            if self._skippable or skips:
                # what no layer of this stage popped is stashed for later stages
                out, stashed = call_with_skips(lambda: call(mb, self.module, args, kwargs or {}), skips)
            else:
                out, stashed = call(mb, self.module, args, kwargs or {}), {}
        grad_on = torch.is_grad_enabled()
        if self.pieces is not None and grad_on:
            state.piece_leaves = self.pieces.leaves(mb)
        if stashed:
            state.skip_roots = [(k, v) for k, v in stashed.items() if grad_on and is_differentiable(v)]
            if state.recompute is None:  # a recomputation's stashes were sent already
                self._stashed[mb] = detach_tree(stashed)
        if self.is_last:
            if self.keep_outputs:
                self.outputs[mb] = detach_tree(out)
            loss_fn = loss_fn if loss_fn is not None else self.loss_fn
            if loss_fn is not None and target is not None:
                loss = loss_fn(out, target)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise TypeError(
                        f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                        + (f" with shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
                    )
                self.losses[mb] = loss.detach()
                state.outputs = [loss] if grad_on and loss.requires_grad else []
                state.loss_weight = loss_weight
            sent: tuple[torch.Tensor, ...] = ()
        else:
            outs = as_output_tuple(out, self.stage_index, mb, dtensors=self.meshes is not None)
            state.outputs = [o for o in outs if is_differentiable(o)] if grad_on else []
            sent = tuple([o.detach() for o in outs])
            if state.outputs and self.release_outputs:
                state.outputs = _release(state.outputs, [*args, *skips.values()])
        if grad_on:
            self._keep(mb, state)
        return sent

    def _keep(self, mb: int, state: _State) -> None:
        self._states[mb] = state
        self.peak_live_microbatches = max(self.peak_live_microbatches, len(self._states))

    def _as_input(self, x: Any) -> Any:
        """A received activation becomes a leaf that collects its gradient."""
        if is_differentiable(x) and not x.requires_grad:
            return x.requires_grad_(True)
        return x

    # -- B / I / W ---------------------------------------------------------------------------
    def _take(self, mb: int, action: str) -> _State:
        try:
            state = self._states[mb]
        except KeyError:
            raise StageError(
                f"stage {self.stage_index}: {action} of microbatch {mb} has no forward state "
                "(its F did not run on this stage, or its backward already ran)"
            ) from None
        if state.recompute is not None and action != "W":
            args, kwargs, target, weight, skips, loss_fn = state.recompute
            with torch.enable_grad():
                self._run(mb, state, args, kwargs, target, weight, skips, loss_fn)
            state.recompute = None
        return state

    def take_stashed(self, mb: int) -> Skips:
        """The skips microbatch ``mb``'s forward stashed for later stages (detached); once."""
        return self._stashed.pop(mb, {})

    def take_skip_grads(self, mb: int) -> Skips:
        """The gradients of the skips microbatch ``mb`` popped here, after its B or I; once."""
        return self._skip_grads.pop(mb, {})

    def _grad_pairs(
        self, state: _State, grad_outputs: Optional[Sequence[Optional[torch.Tensor]]], skip_grads: Optional[Skips]
    ) -> tuple[list[Root], list[Optional[torch.Tensor]]]:
        """Backward roots and their gradients (the loss weight for the loss), stashed skips included."""
        if self.is_last:
            outputs = list(state.outputs)  # the loss, or nothing
            grads = [_weight_as_grad(outputs[0], state.loss_weight)] if outputs else []
        else:
            if grad_outputs is None:
                raise StageError(f"stage {self.stage_index}: backward needs the gradients of its outputs")
            all_grads = _match_grads(state.outputs, grad_outputs, self.stage_index)
            keep = [i for i, o in enumerate(state.outputs) if o.requires_grad]
            outputs, grads = [_root(state.outputs[i]) for i in keep], [all_grads[i] for i in keep]
        for key, root in state.skip_roots:
            g = (skip_grads or {}).get(key)
            if g is None or g.shape != root.shape:
                raise StageError(f"stage {self.stage_index}: no gradient of shape {tuple(root.shape)} arrived for "
                                 f"skip {key}" + ("" if g is None else f" (got {tuple(g.shape)})"))
            if root.requires_grad:
                outputs.append(root)
                grads.append(g)
        return outputs, grads

    def _keep_skip_grads(self, mb: int, state: _State, grads: Sequence[Optional[torch.Tensor]]) -> None:
        if state.skip_inputs:
            keys, leaves = zip(*state.skip_inputs)
            self._skip_grads[mb] = dict(zip(keys, _zeros_where_none(leaves, grads)))

    def _grad_message(self, state: _State, grads: Sequence[Optional[torch.Tensor]]) -> list[torch.Tensor]:
        """One gradient per floating-point input, zeros where autograd produced none."""
        if state.wire:  # a DTensor input's gradient may be a collective's result not yet waited on
            grads = [dtensor_wire.waited(g) for g in grads]
        return _zeros_where_none(state.grad_inputs, grads)

    def backward(self, mb: int, grad_outputs: Optional[Sequence[Optional[torch.Tensor]]] = None,
                 skip_grads: Optional[Skips] = None) -> list[torch.Tensor]:
        """B: full backward of ``mb``; accumulates weight grads, returns the input grads."""
        if self._sync_left is not None:
            self._before_backward()
        state = self._take(mb, "B")
        outputs, grads = self._grad_pairs(state, grad_outputs, skip_grads)
        for inp in state.grad_inputs:
            inp.grad = None
        if state.skip_inputs:
            for _, v in state.skip_inputs:
                v.grad = None
        if self.pieces is not None:  # what later pieces owe this one's keys and values; its own leaves accumulate
            for t, g in self.pieces.roots(mb):
                outputs.append(t)
                grads.append(g)
        if outputs:
            with contextlib.nullcontext() if self.pieces is None else self.pieces.recomputing(mb):
                run_backward(outputs, grads)
        if self.pieces is not None:
            self.pieces.done(mb)
        message = self._grad_message(state, [inp.grad for inp in state.grad_inputs])
        if state.skip_inputs:
            self._keep_skip_grads(mb, state, [v.grad for _, v in state.skip_inputs])
        del self._states[mb]
        if self._sync_left is not None:
            self._weight_grads_done()
        return message

    def backward_input(
        self, mb: int, grad_outputs: Optional[Sequence[Optional[torch.Tensor]]] = None,
        skip_grads: Optional[Skips] = None,
    ) -> list[torch.Tensor]:
        """I: input grads only; the weight-grad half is kept for ``backward_weight``."""
        self._before_backward()
        state = self._take(mb, "I")
        if state.deferred is not None:
            raise StageError(f"stage {self.stage_index}: I of microbatch {mb} ran twice")
        outputs, grads = self._grad_pairs(state, grad_outputs, skip_grads)
        n, n_skips = len(state.grad_inputs), len(state.skip_inputs)
        if self.pieces is not None:
            for t, g in self.pieces.roots(mb):
                outputs.append(t)
                grads.append(g)
        with contextlib.nullcontext() if self.pieces is None else self.pieces.recomputing(mb):
            all_grads, state.deferred = backward_input(
                outputs, grads, state.grad_inputs + [v for _, v in state.skip_inputs] + state.piece_leaves)
        input_grads = all_grads[:n]
        self._keep_skip_grads(mb, state, all_grads[n:n + n_skips])
        if self.pieces is not None:
            self.pieces.owe(state.piece_leaves, all_grads[n + n_skips:])
            self.pieces.done(mb)
        self.split_seen = True
        if state.deferred.unsplit is not None and self.split_fallback is None:
            self.split_fallback = state.deferred.unsplit
        if self.on_kept is not None or self._instruments:
            kept = state.deferred.kept_tensors()
            for fn in (self.on_kept, *(k for _, k in self._instruments.values())):
                if fn is not None:
                    fn(kept)
        if state.deferred.unsplit is not None and not self._warned_unsplit:
            self._warned_unsplit = True
            warnings.warn(
                f"stage {self.stage_index}: the backward cannot be split into input and weight grads exactly "
                f"because {state.deferred.unsplit}; I runs the whole backward and W does nothing (exact, but "
                "this stage loses the zero-bubble overlap). Warned once per stage.",
                UnsplitBackwardWarning,
                stacklevel=2,
            )
        message = self._grad_message(state, input_grads)
        state.outputs, state.grad_inputs, state.skip_inputs, state.skip_roots = [], [], [], []  # W: deferred work only
        state.piece_leaves = []
        return message

    def backward_weight(self, mb: int) -> None:
        """W: the weight-grad half of ``mb``'s backward, after its I."""
        self._before_backward()
        state = self._take(mb, "W")
        if state.deferred is None:
            raise StageError(f"stage {self.stage_index}: W of microbatch {mb} ran before its I")
        with contextlib.nullcontext() if self.pieces is None else self.pieces.recomputing(mb):
            backward_weight(state.deferred)
        del self._states[mb]
        self._weight_grads_done()

    # -- data-parallel gradient sync --------------------------------------------------------
    def _before_backward(self) -> None:
        if self._planned:
            self.grad_sync.ready(f"stage {self.stage_index}: a backward")
        elif self._sync_left is not None and self.grad_sync is not None:
            self.grad_sync.before_backward()

    def _weight_grads_done(self) -> None:
        """One microbatch's weight grads are in; after the step's last, reduce once (planned: at REDUCE_GRAD)."""
        if self._sync_left is None or self.grad_sync is None:
            return
        self._sync_left -= 1
        if self._sync_left == 0 and not self._planned:
            self._sync_left = None
            self.grad_sync.finish()

    # -- parameters placed by the schedule (UNSHARD / RESHARD / REDUCE_GRAD) ---------------------
    def _sharding(self, action: str) -> GradientSync:
        if self.grad_sync is None or not self.grad_sync.shards:
            what = "no data-parallel wrapper" if self.grad_sync is None else self.grad_sync.name
            raise StageError(f"stage {self.stage_index}: the schedule has {action} for it, but its module has "
                             f"{what}: only a fully_shard (FSDP2) stage has parameters to gather and free")
        return self.grad_sync

    def unshard(self, replace: Optional[Callable[[], None]] = None) -> None:
        """UNSHARD: start gathering this stage's parameters (``replace``: what runs instead of the gather); the
        step's first one turns the plan on."""
        sync = self._sharding("UNSHARD")
        if not self._planned:
            if self._sync_left is not None:
                raise StageError(f"stage {self.stage_index}: UNSHARD after the step's first forward of the stage; "
                                 "a planned step unshards a stage before any of its actions")
            sync.begin(planned=True)  # an eval too: FSDP's post-forward reshard is off while the plan places
            if torch.is_grad_enabled():
                self._sync_left = self._n_microbatches
            self._planned = True
        (replace or sync.unshard)()

    def shard(self) -> None:
        """Free this stage's gathered parameters, if any (a fully_shard stage): a planned step or eval starts
        from every stage sharded, as its plan does, whatever ran before (a failed step, the user's own forward,
        FSDP's hooks)."""
        if self.grad_sync is not None and self.grad_sync.shards:
            self.grad_sync.reshard()

    def reshard(self, replace: Optional[Callable[[], None]] = None) -> None:
        """RESHARD: free this stage's gathered parameters; their gradients stay until REDUCE_GRAD."""
        sync = self._sharding("RESHARD")
        (replace or sync.reshard)()

    def reduce_grads(self, replace: Optional[Callable[[], None]] = None) -> None:
        """REDUCE_GRAD: reduce-scatter this stage's gradients of the step (after its last B or W), once;
        ``replace`` runs instead of the reduction (the user's settings come back either way)."""
        sync = self._sharding("REDUCE_GRAD")
        if not self._planned or self._sync_left is None:
            raise StageError(f"stage {self.stage_index}: REDUCE_GRAD without a planned step under way (no UNSHARD "
                             "of the stage before it, or a second REDUCE_GRAD)")
        if self._sync_left:
            raise StageError(f"stage {self.stage_index}: REDUCE_GRAD with the gradients of {self._sync_left} "
                             "microbatch(es) still to come; it goes after the stage's last B or W of the step")
        self._sync_left, self._planned = None, False
        sync.finish(replace)

    def end_step(self) -> None:
        """A planned step's end (the executor's, after its last action): what REDUCE_GRAD left running is waited
        for; after a planned eval, the wrapper's settings are put back."""
        if self.grad_sync is not None:
            self.grad_sync.end_step()


def split_report(runners: Any) -> dict[int, Optional[str]]:
    """Per stage whose I ran (``runners``: stage -> runner): None where the I/W split held, else why it fell back."""
    return {s: r.split_fallback for s, r in sorted(runners.items()) if getattr(r, "split_seen", False)}


def _release(outputs: Sequence[torch.Tensor], inputs: Sequence[Any]) -> list[Any]:
    """``outputs`` with each one that may be let go of replaced by its ``ReleasedOutput`` (see there).

    Letting go never changes a tensor, so it is never wrong; it only frees
    bytes when nobody else holds them. What is kept is what backward could
    read differently through an edge taken now (a view: an in-place op on its
    base rebuilds its gradient function; a leaf that requires grad), what is
    not a plain dense tensor, and the caller's own inputs (returned as they
    are, or sharing their storage: nothing to free). Parameters and buffers
    are not looked at: an output sharing their storage is a leaf or a view,
    or nothing is freed; walking them at every forward would cost more than
    the forward's host time on a small stage.
    """
    owned: Optional[set[tuple[torch.device, int]]] = None  # storages of the inputs
    kept: list[Any] = []
    for o in outputs:
        if type(o) is not torch.Tensor or o._base is not None or (o.requires_grad and o.is_leaf):
            kept.append(o)  # a parameter, an input as is, a view, a tensor subclass (DTensor: storage is its own)
            continue
        key = _storage_key(o)
        if key is None or key[1] == 0 or not o.is_contiguous() or o.untyped_storage().nbytes() == 0:
            kept.append(o)  # nothing to free, or not the plain dense tensor this reasoning is about
            continue
        if owned is None:
            owned = {k for k in map(_storage_key, (t for t in inputs if isinstance(t, torch.Tensor))) if k is not None}
        if key in owned:
            kept.append(o)
            continue
        kept.append(ReleasedOutput(o.shape, get_gradient_edge(o) if o.requires_grad else None))
    return kept


def _storage_key(t: torch.Tensor) -> Optional[tuple[torch.device, int]]:
    """Where ``t``'s bytes are; None when it has no storage of its own to read (a sharded or
    otherwise wrapped parameter, a nested or sparse tensor)."""
    if t.layout != torch.strided or t.is_nested:
        return None
    try:
        return (t.device, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


def _weight_as_grad(loss: torch.Tensor, weight: Any) -> torch.Tensor:
    """The loss weight as the loss's gradient: backward of ``loss * weight`` from 1, without the product.

    Bitwise the same gradient as the product's (the weight rounded to the
    loss's dtype, as ``MulBackward`` rounds it), and a step does a few tensor
    ops fewer per microbatch (the multiply, its backward and the ``ones_like``
    seed): on a CPU each costs microseconds, on a GPU each is a launch. A
    weight that is a CPU tensor is read on the host, never copied to the GPU.
    """
    if type(loss) is not torch.Tensor and isinstance(loss, dtensor_wire.dtensor_type()):
        return dtensor_wire.scalar_grad(loss, weight)
    if isinstance(weight, torch.Tensor):
        if weight.device.type != "cpu" or loss.device.type == "cpu":
            return weight.detach().to(loss.device, loss.dtype).reshape(loss.shape)
        weight = float(weight)
    return torch.full(loss.shape, weight, dtype=loss.dtype, device=loss.device)


_ENGINE = torch.autograd.Variable._execution_engine


def run_backward(roots: Sequence[Root], grads: Sequence[Optional[torch.Tensor]]) -> None:
    """``torch.autograd.backward(roots, grads)``: the same engine call, without the wrapper when it adds nothing.

    torch's wrapper normalises and re-checks its arguments in Python (about
    20 calls, a few microseconds each B on a CPU, per microbatch, on a
    path a GPU waits on) and then makes this call. Here every gradient has
    been matched to its root already (``_match_grads``; the loss weight is
    built in the loss's shape and dtype) and the engine checks each root's
    gradient again (shape, dtype, device) before it runs. Anything the
    wrapper does more for takes the wrapper: a missing gradient (it would
    create one), a tensor subclass (DTensor), functorch transforms.
    """
    plain = len(roots) == len(grads) and not torch._C._are_functorch_transforms_active()
    for r, g in zip(roots, grads):  # a loop, not all(...): the point is the host time
        plain = plain and type(g) is torch.Tensor and (type(r) is torch.Tensor or type(r) is GradientEdge)
    if not plain:
        torch.autograd.backward(roots, grads)
        return
    _ENGINE.run_backward(tuple(roots), tuple(grads), False, False, (), allow_unreachable=True, accumulate_grad=True)


def _root(o: Any) -> Root:
    return o.edge if isinstance(o, ReleasedOutput) else o


def _zeros_where_none(leaves: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]]) -> list[torch.Tensor]:
    """The gradient of each leaf, zeros where autograd produced none (a message has one per leaf)."""
    return [g if g is not None else torch.zeros_like(x) for x, g in zip(leaves, grads)]


def _plain_call(mb: int, module: nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    return module(*args, **kwargs)


def _match_grads(
    outputs: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]], stage: int
) -> list[Optional[torch.Tensor]]:
    """Check one received gradient per floating-point output, with matching shapes."""
    if len(grads) != len(outputs):
        raise StageError(
            f"stage {stage}: received {len(grads)} output gradients but has {len(outputs)} floating-point outputs"
        )
    for i, (o, g) in enumerate(zip(outputs, grads)):
        if g is not None and g.shape != o.shape:
            raise StageError(
                f"stage {stage}: gradient for output {i} has shape {tuple(g.shape)}, the output has {tuple(o.shape)}"
            )
    return list(grads)


def detach_tree(out: Any) -> Any:
    """Tensors in (nested) tuples, lists and dicts, detached; anything else as is."""
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, (tuple, list)):
        return type(out)(detach_tree(o) for o in out)
    if isinstance(out, dict):
        return {k: detach_tree(v) for k, v in out.items()}
    return out
