"""``PipelineStage``: one model chunk of a multi-process pipeline; torch's ``torch.distributed.pipelining.stage``.

A stage says where it sits (index, count, device, process group) and what it
runs; a schedule (``schedules.py``) drives it. Declared shapes (torch's
``input_args``/``output_args``) are checked on every microbatch when given.
``build_stage`` makes one from a traced pipeline's module. The module's other
names are torch's (its types and helpers, lent on first use) or refused with
the reason (its stage internals): replacing ``torch.distributed.pipelining``
by ``pipeline_ext.pipelining`` in an import gives either the name or why not.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from pipeline_ext._lazy import lazy_names
from pipeline_ext.comm.data_parallel import gradient_sync_for
from pipeline_ext.pipelining.dw_builder import DwBuilderRunner
from pipeline_ext.runtime.declared import Declared, check_grads, errors
from pipeline_ext.runtime.dtensor_wire import MeshFinder
from pipeline_ext.runtime.stage import StagePosition, StageRunner

__all__ = ["PipelineStage", "PipeliningMetadataError", "PipeliningShapeError", "build_stage"]


class PipelineStage(StagePosition):
    """One model chunk of a multi-process pipeline, bound to a device and a process group.

    ``input_args`` / ``output_args`` (torch's static shapes, one microbatch)
    are optional: shapes are discovered on the first step (and again when they
    change); when given, every microbatch is checked against them.
    ``output_grads`` / ``input_grads`` (torch's static gradient metadata) are
    optional too: gradients travel in the layout of the tensors they belong
    to, so they are only checked, against ``output_args`` / ``input_args``
    here and against every microbatch's outputs / inputs ([Note: declared
    gradients] in runtime/declared.py). DTensor
    outputs travel as their local shards and are rebuilt on the next stage's
    mesh (``mesh=``, else found from its module's DTensor parameters, else
    torch's ``get_mesh=`` callback); see [Note: DTensors between stages] in
    runtime/dtensor_wire.py. ``group`` (a process group, or a 1-D ``DeviceMesh``
    such as ``mesh["pp"]``) defaults to the world group.

    A ``submodule`` wrapped in ``DistributedDataParallel`` or ``fully_shard``
    (FSDP2) over the data-parallel group has its gradients reduced exactly once
    per step (comm/data_parallel.py); a wrapper that cannot be made exact
    raises ``UnsupportedWrapperError`` here.

    ``release_outputs`` (default True, ours): the runner frees a sent output's
    bytes once the send copied them, keeping its autograd edge
    (``StageRunner``'s argument of that name; off holds every output until its
    backward, as a baseline for measuring the release).
    """

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        num_stages: int,
        device: Union[torch.device, str, int],
        input_args: Any = None,
        output_args: Any = None,
        output_grads: Any = None,
        input_grads: Any = None,
        group: Optional[dist.ProcessGroup] = None,
        dw_builder: Any = None,
        get_mesh: Any = None,
        *,
        mesh: Any = None,
        release_outputs: bool = True,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("PipelineStage needs torch.distributed to be initialised (init_process_group) first")
        if not isinstance(submodule, nn.Module):
            raise TypeError(f"submodule must be an nn.Module, got {type(submodule).__name__}")
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index must be in [0, num_stages={num_stages}), got {stage_index}")
        if dw_builder is not None and not callable(dw_builder):
            raise TypeError(f"dw_builder must be a callable returning the W runner, got {type(dw_builder).__name__}")
        if get_mesh is not None and not callable(get_mesh):
            raise TypeError(f"get_mesh must be a callable (dim_names, layout) -> DeviceMesh, got {type(get_mesh).__name__}")
        output_grads = _grads_arg(output_grads, "output_grads")
        input_grads = _grads_arg(input_grads, "input_grads")
        # [Note: declared gradients] (runtime/declared.py): the gradients must fit the tensors they belong to
        if output_args is not None:
            check_grads(stage_index, "output_grads", output_grads, output_args, "output_args")
        if input_args is not None:
            check_grads(stage_index, "input_grads", input_grads, input_args, "input_args")
        self.submod = submodule
        self.dw_builder = dw_builder
        #: where DTensor inputs from the previous stage are rebuilt ([Note: DTensors between stages])
        self.mesh, self.get_mesh = mesh, get_mesh
        self.release_outputs = bool(release_outputs)
        self.input_args, self.output_args = input_args, output_args
        #: torch's static gradient metadata, checked against every microbatch's outputs / inputs ([Note: declared
        #: gradients]); a tuple with None for a tensor without a gradient, or None when not given
        self.output_grads, self.input_grads = output_grads, input_grads
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        group = _as_group(group)
        self.grad_sync = gradient_sync_for(submodule, group)
        self.group = group
        self.group_rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        if dw_builder is not None and self.grad_sync is not None:
            raise ValueError("dw_builder with a data-parallel wrapped submodule is not supported: the gradient "
                             "reduction could not tell when the last weight-gradient runner has run")
        #: torch's private switch, kept: True holds every step to the shapes of this stage's first microbatch
        #: run with it set (inputs and outputs, as if declared as input_args/output_args); mismatches raise
        #: ``PipeliningShapeError`` ("shape mismatch"/"dtype mismatch"). Off: shapes may change between steps.
        self._runtime_validate = False
        self._first_shapes: Optional[Declared] = None  # what _runtime_validate holds steps to, once seen
        #: the last step's per-microbatch outputs on the last stage (torch's name)
        self.output_chunks: list[Any] = []
        self._runner: Optional[StageRunner] = None
        self._has_backward = False
        #: while a registered custom function runs: the executor's ``GroupRun`` for its actions
        self._run: Any = None
        self._bwd_outputs: dict[int, Any] = {}

    def __repr__(self) -> str:
        return f"PipelineStage(stage {self.stage_index} of {self.num_stages}, rank {self.group_rank}, {self.device})"

    @property
    def _declared(self) -> Optional[Declared]:
        """The shapes this stage's microbatches are checked against: ``input_args``/``output_args``, else with
        ``_runtime_validate`` its first microbatch's, with the declared gradients' (``output_grads`` /
        ``input_grads``) in either case; None when nothing is checked."""
        grads = dict(output_grads=self.output_grads, input_grads=self.input_grads)
        if self.input_args is not None or self.output_args is not None:
            return Declared(self.stage_index, self.input_args, self.output_args, **grads)
        if self._runtime_validate and self._first_shapes is not None:
            return dataclasses.replace(self._first_shapes, **grads)
        if self.output_grads is not None or self.input_grads is not None:
            return Declared(self.stage_index, **grads)
        return None

    def _call(self, mb: int, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        """The stage's forward for the runner, checked against ``_declared`` (read at each call: the switch
        may be set after the schedule is built)."""
        declared = self._declared
        if declared is not None:
            declared.check("inputs", mb, tuple(args))
        out = module(*args, **kwargs)
        if declared is not None:
            declared.check("outputs", mb, out)
        if self._runtime_validate and self._first_shapes is None and self.input_args is None \
                and self.output_args is None:
            meta = lambda t: torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t  # noqa: E731
            from torch.utils import _pytree as pytree

            self._first_shapes = Declared(self.stage_index, pytree.tree_map(meta, tuple(args)),
                                          pytree.tree_map(meta, out), source="first step")
        return out

    def _make_runner(self, loss_fn: Any, n_microbatches: int, pieces: int = 1, seq_dim: int = 1) -> StageRunner:
        """This stage's runner for a schedule (the schedule's executor drives it); ``pieces``: the schedule's
        ``seq_chunks`` (``n_microbatches`` then counts pieces)."""
        kwargs = dict(call=self._call, grad_sync=self.grad_sync, n_microbatches=n_microbatches,
                      release_outputs=self.release_outputs, meshes=MeshFinder(self.submod, self.mesh, self.get_mesh),
                      pieces=pieces, seq_dim=seq_dim)
        if self.dw_builder is not None:
            runner: StageRunner = DwBuilderRunner(self.submod, self.stage_index, self.num_stages, loss_fn,
                                                  dw_builder=self.dw_builder, **kwargs)
        else:
            runner = StageRunner(self.submod, self.stage_index, self.num_stages, loss_fn, **kwargs)
        self._runner, self._has_backward = runner, loss_fn is not None
        return runner

    @property
    def fwd_cache(self) -> dict[int, Any]:
        """Per microbatch, what this stage holds from its forward for its backward (torch's name; read-only copy).

        Empty between steps (a failed step's is dropped too); during a step it
        holds the microbatches whose backward has not run yet.
        """
        return {} if self._runner is None else self._runner.held()

    @property
    def has_backward(self) -> bool:
        """Whether the schedule driving this stage runs backwards (it has a loss_fn), as in torch."""
        return self._has_backward

    @has_backward.setter
    def has_backward(self, value: bool) -> None:
        self._has_backward = bool(value)

    def scale_grads(self, grad_scale_factor: int) -> None:
        """Divide this stage's parameter gradients by ``grad_scale_factor`` (torch's stage method).

        Inside a custom function it does nothing: our schedule weights each
        microbatch's loss by its share of the batch (``scale_grads=True``), so
        the gradients are scaled already when torch-style code asks again.
        """
        if grad_scale_factor != 1 and self._run is None:
            for p in self.submod.parameters():
                if p.grad is not None:
                    p.grad.div_(grad_scale_factor)

    # -- torch's per-microbatch API, for functions given to register_custom_function -------------
    def _bind(self, run: Any) -> None:
        """The executor's runner of the actions handed to a custom function (None when it returns)."""
        self._run = run
        if run is None:
            self._bwd_outputs.clear()

    def _handed(self, api: str, mb: int, kinds: tuple[str, ...]) -> Any:
        run = self._run
        found = None if run is None else next(
            (a for a in run.actions if a.stage == self.stage_index and a.microbatch == mb and a.kind.value in kinds),
            None)
        if found is None:
            raise RuntimeError(
                f"stage {self.stage_index}: {api}({mb}) runs a microbatch inside a step, from a function given to "
                "register_custom_function, for an action it was handed"
                + ("" if run is None else f" ({' '.join(map(str, run.actions))})"))
        return found

    def forward_one_chunk(self, fwd_chunk_id: int, args: Any = (), kwargs: Optional[dict] = None,
                          save_forward_output: bool = True) -> Any:
        """torch's F of one microbatch, inside a custom function: returns the stage's output.

        The input is the one the schedule has for this stage and microbatch
        (the step's microbatch on stage 0, the received or handed-over
        activation elsewhere, with this rank's keyword arguments for that
        microbatch on every stage, as torch passes ``kwarg_mbs[mb]``), so
        ``args``/``kwargs`` are not read; on the last
        stage the loss is computed here (torch's ``_maybe_compute_loss`` then
        has nothing to do). The output goes on to the next stage by itself.
        """
        out = self._run(self._handed("forward_one_chunk", fwd_chunk_id, ("F",)))
        if isinstance(out, tuple) and len(out) == 1:
            return out[0]
        return out

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        """torch's backward of one microbatch inside a custom function: B, or I with ``full_backward=False``.

        The gradient of the output (received, handed over, or the weighted
        loss on the last stage) is the schedule's; ``loss`` is not read.
        """
        if not self.has_backward:
            return
        action = self._handed("backward_one_chunk", bwd_chunk_id, ("B", "I"))
        if (action.kind.value == "B") != bool(full_backward):
            raise ValueError(f"stage {self.stage_index}: the schedule has {action} here, but backward_one_chunk was "
                             f"called with full_backward={full_backward}")
        self._bwd_outputs[bwd_chunk_id] = self._run(action)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        """torch's W of one microbatch inside a custom function (after its ``backward_one_chunk(full_backward=False)``)."""
        if not self.has_backward:
            return
        run = self._run
        if run is None or not any(a.stage == self.stage_index and a.microbatch == bwd_chunk_id
                                  and a.kind.value == "W" for a in run.actions):
            raise AssertionError(
                f"stage {self.stage_index}: backward_weight_one_chunk for chunk {bwd_chunk_id} without first calling "
                "`backward_one_chunk(full_backward=False)` (it runs a W handed to a function given to "
                "register_custom_function)")
        self._run(self._handed("backward_weight_one_chunk", bwd_chunk_id, ("W",)))

    def set_local_fwd_input(self, prev_stage_outputs: Any, mb_index: int) -> None:
        """torch's hand-over between two stages of one rank: the executor hands outputs on already (nothing to do)."""

    def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
        """torch's hand-over of input gradients between two stages of one rank: done by the executor already."""

    def get_local_bwd_output(self, mb_index: int) -> Any:
        """The input gradients of the last ``backward_one_chunk`` of ``mb_index`` in this custom function call."""
        return self._bwd_outputs.get(mb_index)

    def clear_runtime_states(self) -> None:
        """Drop what the last step left on this stage (activations, losses, outputs), as torch's method does."""
        if self._runner is not None:
            self._runner.reset()
        self.output_chunks.clear()


#: torch's base class of stages; here the one stage class is the base (``isinstance`` checks in torch-style code)
_PipelineStageBase = PipelineStage


def build_stage(stage_module: nn.Module, stage_index: int, pipe_info: Any, device: Union[torch.device, str, int],
                group: Optional[dist.ProcessGroup] = None) -> PipelineStage:
    """torch's ``build_stage``: a stage of a traced pipeline (``pipe.info()`` gives ``pipe_info``)."""
    num_stages = getattr(pipe_info, "num_stages", None)
    if not isinstance(num_stages, int):
        raise TypeError(f"pipe_info must be torch's PipeInfo (pipe.info()), got {type(pipe_info).__name__}")
    return PipelineStage(stage_module, stage_index, num_stages, device, group=group)


def as_stage(stage: Any) -> PipelineStage:
    """Ours as is; a stage torch built (``PipelineStage`` or ``pipe.build_stage``) becomes ours, same module."""
    if isinstance(stage, PipelineStage):
        return stage
    needed = ("submod", "stage_index", "num_stages", "device", "group")
    if all(hasattr(stage, a) for a in needed):
        return PipelineStage(stage.submod, stage.stage_index, stage.num_stages, stage.device, group=stage.group,
                             dw_builder=getattr(stage, "dw_builder", None))
    raise TypeError(f"expected a PipelineStage, got {type(stage).__name__}")


def _normalize_model_output_as_tuple(output: Any) -> tuple:
    """A stage's output as the tuple of values the next stage is called with (torch's helper of that name).

    A tuple or list is its entries, anything else one value: what a stage's
    output becomes here too (``runtime/stage.py``, ``as_output_tuple``), so
    code written against torch's helper (torchtitan's graph runner) splits
    outputs as this library's stages do.
    """
    return tuple(output) if isinstance(output, (tuple, list)) else (output,)


#: torch.distributed.pipelining.stage's names that mean the same here, lent as they are on first use (torch's
#: pipelining costs a rank about a second to import): types that our stage accepts or raises (``PipeInfo`` for
#: ``build_stage``, ``get_mesh`` callbacks, torch's metadata error) and torch's pure helpers on tensors and pytrees,
#: which compute the same whoever calls them (our stages run their backward without them)
_TORCHS = dict.fromkeys([
    "PipeliningMetadataError", "PipeInfo", "GetMeshCallback", "InferenceMode",
    "extract_tensor_meta", "extract_tensor_metas", "flatten_args", "map_debug_info", "to_local_if_dtensor",
    "validate_and_normalize_to_tuple", "validate_static_arg_grad_correspondence", "validate_tensors_metadata",
    "stage_backward", "stage_backward_input", "stage_backward_weight",
], "torch.distributed.pipelining.stage")
#: torch's stage internals, with nothing here to stand for them: importing one says why (docs/parity.md)
_GAPS = {
    "_PipelineStage": "torch's stage of a traced Pipe; build_stage(...) and pipe.build_stage(...) give a PipelineStage "
                      "here",
    **dict.fromkeys(["_RecvInfo", "_StageMeta", "_StageForwardMeta", "_StageBackwardMeta", "_TensorMeta", "_DTensorMeta",
                     "_MeshCache", "_make_tensor_from_meta", "_derive_grad_metas", "_autograd_grad_for_inputs"],
                    "torch's stage bookkeeping (receive buffers sized from metadata, its autograd calls); stages here "
                    "learn their layouts from the step (comm/comm_plan.py, runtime/declared.py) and run their own "
                    "backward (runtime/stage.py)"),
}
_lent, _listed = lazy_names(__name__, _TORCHS, gaps=_GAPS)


def __getattr__(name: str) -> Any:  # PEP 562
    if name == "PipeliningShapeError":  # made on first use, over torch's error class (runtime/declared.py)
        return errors()[name]
    return _lent(name)


def __dir__() -> list[str]:
    return sorted({*_listed(), "PipeliningShapeError"})


def _grads_arg(value: Any, name: str) -> Optional[tuple]:
    """torch's ``output_grads`` / ``input_grads``: None, a tensor, or a sequence of tensors and Nones, as a tuple."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and all(v is None or isinstance(v, torch.Tensor) for v in value):
        return tuple(value)
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(value, (dist.ProcessGroup, DeviceMesh)):
        raise TypeError(f"{name} got a {type(value).__name__}: since torch 2.13 PipelineStage's positional "
                        "arguments are (submodule, stage_index, num_stages, device, input_args, output_args, "
                        "output_grads, input_grads, group, dw_builder, get_mesh); pass group= by keyword")
    raise TypeError(f"{name} must be a tensor or a tuple of tensors (None for a tensor without a gradient), "
                    f"describing one microbatch's gradients; got {type(value).__name__}")


def _as_group(group: Any) -> Optional[dist.ProcessGroup]:
    """A process group from ``group=``: a ProcessGroup, None (world) or a 1-D DeviceMesh (``mesh["pp"]``)."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"group= takes a 1-D DeviceMesh (e.g. mesh['pp']), got one with {group.ndim} dims")
        return group.get_group()
    return group
