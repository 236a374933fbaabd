"""Multi-process API: ``PipelineStage`` and the ``Schedule*`` classes.

Shaped like ``torch.distributed.pipelining``'s manual-stage API, so that moving
a script over is a one-line import change::

    stage = pe.PipelineStage(submodule, stage_index, num_stages, device)
    sched = pe.Schedule1F1B(stage, n_microbatches, loss_fn=loss_fn)
    sched.step(x)                                  # first stage
    sched.step(target=y, losses=losses)            # last stage
    sched.step()                                   # middle stages

Each process holds one stage (or several, for interleaved and V schedules).
All of them run the same ``Executor`` over a ``DistChannel``; the schedule
classes only choose which schedule (data) to build. ``PipelineSchedule`` runs
any ``Schedule``, hand-written ones included.

Differences from torch, on purpose: batches that do not divide into the
microbatches are allowed (losses are weighted by each microbatch's rows, so the
gradients are still those of the whole batch's mean loss), and a step whose
shapes differ from the previous step's works (metadata is exchanged again).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from pipeline_ext import schedules as S
from pipeline_ext.schedules.csv_io import torch_order
from pipeline_ext.microbatch import merge_chunks, microbatch_sizes, split_step_inputs, split_step_target
from pipeline_ext.runtime.custom_weight import DwBuilderRunner
from pipeline_ext.runtime.data_parallel import gradient_sync_for
from pipeline_ext.runtime.channels import check_timeout, watch_signals
from pipeline_ext.runtime.executor import Executor, StepInputs, StepStart
from pipeline_ext.runtime.groups import DirectionGroups, GroupMaker, matches_by_order
from pipeline_ext.runtime.protocol.agreement import (
    TRANSPORT_CODES,
    PendingExchange,
    StepAgreement,
    StepAgreementError,
    StepRecord,
    agree,
)
from pipeline_ext.runtime.protocol.identity import GroupSteps, stable_hash
from pipeline_ext.runtime.shm import make_channel
from pipeline_ext.runtime.stage import StagePosition, StageRunner
from pipeline_ext.runtime.trace import Tracer, TraceReport, gather_steps
from pipeline_ext.skip.routes import SkipRoutes, declarations_digest, declared_skips, gather_routes
from pipeline_ext.training.loss import loss_weights

_TRAIN, _FORWARD = 1, 2  # the two plans of a schedule (see protocol/agreement.PLANS)

# torch's Schedule* names are in pipeline_ext/schedule_classes.py
__all__ = ["PipelineStage", "PipelineSchedule", "PipeliningMetadataError", "PipeliningShapeError"]


class PipelineStage(StagePosition):
    """One model chunk of a multi-process pipeline, bound to a device and a process group.

    ``input_args`` / ``output_args`` (torch's static shapes, one microbatch)
    are optional: shapes are discovered on the first step (and again when they
    change); when given, every microbatch is checked against them. ``group`` (a process group, or a 1-D ``DeviceMesh``
    such as ``mesh["pp"]``) defaults to the world group.

    A ``submodule`` wrapped in ``DistributedDataParallel`` or ``fully_shard``
    (FSDP2) over the data-parallel group has its gradients reduced exactly once
    per step (runtime/data_parallel.py); a wrapper that cannot be made exact
    raises ``UnsupportedWrapperError`` here.
    """

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        num_stages: int,
        device: Union[torch.device, str, int],
        input_args: Any = None,
        output_args: Any = None,
        group: Optional[dist.ProcessGroup] = None,
        dw_builder: Any = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("PipelineStage needs torch.distributed to be initialised (init_process_group) first")
        if not isinstance(submodule, nn.Module):
            raise TypeError(f"submodule must be an nn.Module, got {type(submodule).__name__}")
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index must be in [0, num_stages={num_stages}), got {stage_index}")
        if dw_builder is not None and not callable(dw_builder):
            raise TypeError(f"dw_builder must be a callable returning the W runner, got {type(dw_builder).__name__}")
        self.submod = submodule
        self.dw_builder = dw_builder
        self.input_args, self.output_args = input_args, output_args
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
        #: the last step's per-microbatch outputs on the last stage (torch's name)
        self.output_chunks: list[Any] = []
        self._runner: Optional[StageRunner] = None
        self._has_backward = False

    def __repr__(self) -> str:
        return f"PipelineStage(stage {self.stage_index} of {self.num_stages}, rank {self.group_rank}, {self.device})"

    def _make_runner(self, loss_fn: Any, n_microbatches: int) -> StageRunner:
        """This stage's runner for a schedule (the schedule's executor drives it)."""
        kwargs = dict(call=_checked_call(self), grad_sync=self.grad_sync, n_microbatches=n_microbatches)
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
        """Divide this stage's parameter gradients by ``grad_scale_factor`` (torch's stage method)."""
        if grad_scale_factor != 1:
            for p in self.submod.parameters():
                if p.grad is not None:
                    p.grad.div_(grad_scale_factor)

    def clear_runtime_states(self) -> None:
        """Drop what the last step left on this stage (activations, losses, outputs), as torch's method does."""
        if self._runner is not None:
            self._runner.reset()
        self.output_chunks.clear()


try:  # torch's class, so `except PipeliningMetadataError` in torch code catches ours too
    from torch.distributed.pipelining._utils import PipeliningMetadataError
except ImportError:  # pragma: no cover - older torch
    class PipeliningMetadataError(RuntimeError):  # type: ignore[no-redef]
        """A stage's inputs or outputs are not what it declared."""


class PipeliningShapeError(ValueError, PipeliningMetadataError):
    """A microbatch does not match the stage's declared ``input_args``/``output_args`` (shape or dtype)."""


def _checked_call(stage: PipelineStage) -> Optional[Callable[..., Any]]:
    """Check each microbatch against torch's ``input_args``/``output_args`` when given (shapes, dtypes)."""
    if stage.input_args is None and stage.output_args is None:
        return None

    def call(mb: int, module: nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        if stage.input_args is not None:
            _match_meta(stage, "inputs", mb, tuple(args), stage.input_args)
        out = module(*args, **kwargs)
        if stage.output_args is not None:
            _match_meta(stage, "outputs", mb, out, stage.output_args)
        return out

    return call


def _match_meta(stage: PipelineStage, what: str, mb: int, actual: Any, expected: Any) -> None:
    from torch.utils import _pytree as pytree

    expected = expected if isinstance(expected, tuple) or what == "outputs" else (expected,)
    got, want = pytree.tree_leaves(actual), pytree.tree_leaves(expected)
    problem = None
    if len(got) != len(want):
        problem = f"{len(got)} values where {what[:-1]}_args has {len(want)}"
    else:
        for i, (g, w) in enumerate(zip(got, want)):
            if isinstance(w, torch.Tensor) and (not isinstance(g, torch.Tensor) or g.shape != w.shape
                                                or g.dtype != w.dtype):
                desc = f"{tuple(g.shape)} {g.dtype}" if isinstance(g, torch.Tensor) else type(g).__name__
                problem = f"{what[:-1]} {i} is {desc}, {what[:-1]}_args says {tuple(w.shape)} {w.dtype}"
                break
    if problem:
        raise PipeliningShapeError(f"stage {stage.stage_index}, microbatch {mb}: {problem} (input_args/output_args "
                                   "describe one microbatch; leave them out to let shapes be discovered)")


def _is_stand_in(stage: Any) -> bool:
    """A stage object without a module that only says where it sits (torch's tests mock ``_PipelineStageBase`` so)."""
    return (not isinstance(stage, PipelineStage) and getattr(stage, "submod", False) is None
            and all(hasattr(stage, a) for a in ("num_stages", "group_size", "group_rank")))


def _as_group(group: Any) -> Optional[dist.ProcessGroup]:
    """A process group from ``group=``: a ProcessGroup, None (world) or a 1-D DeviceMesh (``mesh["pp"]``)."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"group= takes a 1-D DeviceMesh (e.g. mesh['pp']), got one with {group.ndim} dims")
        return group.get_group()
    return group


def _group_timeout(group: Optional[dist.ProcessGroup]) -> float:
    """The process group's own timeout, in seconds: what ``timeout=None`` means."""
    group = group if group is not None else dist.group.WORLD
    try:
        backend = group._get_backend(torch.device("cpu" if dist.get_backend(group) == "gloo" else "cuda"))
        return backend.options._timeout.total_seconds()
    except (AttributeError, RuntimeError, ValueError):  # a backend without options: torch's default
        return dist.default_pg_timeout.total_seconds()


def _host_group(group: Optional[dist.ProcessGroup], device: torch.device) -> Optional[dist.ProcessGroup]:
    """The group the step records travel on: the stages' own on CPU, a Gloo twin of it for GPU stages.

    The records are read on the host to decide the step. Received into GPU
    memory (NCCL) that read would synchronise the host with the GPU at every
    step, stalling behind the forward just queued; over Gloo they stay in host
    memory. The twin is made with every rank of the default group
    (``GroupMaker``), as torch's ``new_group`` requires: a group made by its
    members alone (``use_local_synchronization``) is named after how many
    groups each process already has, and two ranks with different histories
    would wait for each other forever.
    """
    if device.type == "cpu":
        return group
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    return GroupMaker("gloo").make([ranks])[ranks]


class PipelineSchedule:
    """Runs a schedule (built-in name or hand-written ``Schedule``) on this process's stages."""

    def __init__(
        self,
        stages: Union[PipelineStage, Sequence[PipelineStage]],
        schedule: Union[str, S.Schedule, None],
        n_microbatches: int,
        loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
        args_chunk_spec: Any = None,
        kwargs_chunk_spec: Any = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        timeout: Optional[float] = 300.0,
        trace: bool = False,
        transport: Optional[str] = None,
    ) -> None:
        from pipeline_ext.tracer import as_stage  # torch-built stages (build_stage, pipe.build_stage) too

        given = [stages] if not isinstance(stages, (list, tuple)) else list(stages)
        if not given:
            raise ValueError("need at least one PipelineStage")
        #: built from stand-ins (stage objects without a module, as torch's own tests mock them): the
        #: schedule can be inspected (pipeline_order, _dump_csv) but not run
        self.plan_only = all(_is_stand_in(s) for s in given)
        stages = given if self.plan_only else [as_stage(s) for s in given]
        first = stages[0]
        self.group, self.rank, self.num_ranks = first.group, first.group_rank, first.group_size
        num_stages = first.num_stages
        for s in stages:
            if s.num_stages != num_stages or s.group_rank != self.rank:
                raise ValueError("all stages given to one schedule must share num_stages and the process group")
        if isinstance(schedule, str):
            v = num_stages // self.num_ranks
            if num_stages != v * self.num_ranks:
                raise ValueError(
                    f"num_stages={num_stages} is not a multiple of the {self.num_ranks} ranks in the group"
                )
            schedule = S.build(schedule, self.num_ranks, n_microbatches, stages_per_rank=v)
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.chunk_spec = (args_chunk_spec, kwargs_chunk_spec)
        self.output_merge_spec = output_merge_spec
        self.scale_grads = scale_grads
        timeout = check_timeout(timeout, "the process group's timeout")
        if timeout is None and not self.plan_only:
            timeout = _group_timeout(self.group)
        self.timeout = timeout
        self.stages = {} if self.plan_only else {s.stage_index: s for s in stages}
        if len(self.stages) != len(stages) and not self.plan_only:
            raise ValueError("the same stage_index was given twice")
        self._runners = {i: s._make_runner(loss_fn, n_microbatches) for i, s in self.stages.items()}
        # Skip connections (pipeline_ext.skip): what this rank's stages declare; the routes between
        # ranks are settled in the first step whose records say some rank has skips (_settle_skips).
        self._skip_decls = {i: declared_skips(s.submod) for i, s in self.stages.items()}
        self._skip_digest = declarations_digest(self._skip_decls)
        self._skip_key: tuple[int, ...] = ()
        self._skip_routes: Optional[SkipRoutes] = None
        device = torch.device("cpu") if self.plan_only else first.device
        self._last_stage = num_stages - 1
        self.num_stages = num_stages
        self._device = device
        if not self.plan_only:
            # transport: "auto" | "gloo" | "shm", default $PIPELINE_EXT_TRANSPORT or "auto" (runtime/shm.py)
            self._channel = make_channel(self.group, device, num_stages, transport, timeout)
            # NCCL: each direction between two ranks on a group of its own (runtime/groups.py)
            self._directions = DirectionGroups(self.group, device) if matches_by_order(self.group, device) else None
            self._agreement = StepAgreement(_host_group(self.group, device), self.rank, self.num_ranks,
                                            torch.device("cpu"), timeout,
                                            ranks=dist.get_process_group_ranks(self.group or dist.group.WORLD))
        self.schedule: Optional[S.Schedule] = None
        self._executor: Optional[Executor] = None
        self._tracer: Optional[Tracer] = None
        if schedule is not None:  # None: a torch-style subclass assigns pipeline_order next
            self._set_schedule(schedule)
        self.enable_tracing(trace)
        # OrderedDicts: torch's RemovableHandle keeps a weak reference to them
        self._step_pre_hooks: OrderedDict[int, Callable[[], None]] = OrderedDict()
        self._step_post_hooks: OrderedDict[int, Callable[[], None]] = OrderedDict()

    def _set_schedule(self, schedule: S.Schedule) -> None:
        """Lower, validate and run ``schedule`` from the next step on (a new one forgets every plan)."""
        if schedule.num_ranks != self.num_ranks or schedule.num_stages != self.num_stages:
            raise ValueError(
                f"schedule {schedule.name!r} is for {schedule.num_ranks} ranks and {schedule.num_stages} stages, "
                f"but the group has {self.num_ranks} ranks and the stages say num_stages={self.num_stages}"
            )
        if schedule.n_microbatches != self.n_microbatches:
            raise ValueError(f"schedule {schedule.name!r} has {schedule.n_microbatches} microbatches, "
                             f"n_microbatches={self.n_microbatches}")
        mine = {s for s, r in enumerate(schedule.stage_to_rank) if r == self.rank}
        if mine != set(self.stages) and not self.plan_only:
            raise ValueError(f"schedule {schedule.name!r} puts stages {sorted(mine)} on rank {self.rank}, "
                             f"but this rank was given stages {sorted(self.stages)}")
        self.schedule = S.lower(schedule)
        S.validate(self.schedule)
        if not self.plan_only and self._directions is not None:
            self._directions.route(self._channel, self.schedule.stage_to_rank)
        self._eval_executor: Optional[Executor] = None
        if not self.plan_only:
            self._executor = self._new_executor(self.schedule)
        self._first_rank = self.schedule.stage_to_rank[0]
        self._last_rank = self.schedule.stage_to_rank[-1]
        self._schedule_key = stable_hash(repr((
            self.schedule.name, tuple(self.schedule.stage_to_rank), self.n_microbatches,
            [[str(a) for a in acts] for acts in self.schedule.actions],
        )))
        if self._tracer is not None:  # a new schedule: the steps traced so far were another's
            self.enable_tracing(True)

    # -- step hooks (pipeline_ext.training: tied parameters) -------------------------------------
    def register_step_pre_hook(self, hook: Callable[[], None]) -> RemovableHandle:
        """Call ``hook()`` in every training step whose inputs this rank accepted, before its stages run."""
        handle = RemovableHandle(self._step_pre_hooks)
        self._step_pre_hooks[handle.id] = hook
        return handle

    def register_step_post_hook(self, hook: Callable[[], None]) -> RemovableHandle:
        """Call ``hook()`` after every training step's last backward (before ``step()`` returns)."""
        handle = RemovableHandle(self._step_post_hooks)
        self._step_post_hooks[handle.id] = hook
        return handle

    # -- tracing -------------------------------------------------------------------------------
    def enable_tracing(self, on: bool = True) -> None:
        """Record every executed action of the following steps (off by default; costs ~nothing when off).

        Turning it on again starts a fresh recording. See ``trace_report`` and ``write_trace``.
        """
        self._tracer = Tracer(self.rank) if on else None
        if self._executor is not None:
            self._executor.on_action = self._tracer.record if on else None

    def trace_report(self, dst: int = 0) -> Optional[TraceReport]:
        """Measured costs and bubble vs. the simulator's, over the traced steps.

        A collective (every rank calls it); the report comes back on group rank
        ``dst``, None elsewhere.
        """
        if self._tracer is None:
            raise RuntimeError("tracing is off: pass trace=True or call enable_tracing() before the steps")
        steps = gather_steps(self._tracer, self.group, dst)
        return None if steps is None else TraceReport(self.schedule, steps)

    def write_trace(self, path: str, dst: int = 0) -> Optional[TraceReport]:
        """Write the traced steps as Chrome trace JSON on rank ``dst`` (a collective); returns the report there."""
        report = self.trace_report(dst)
        if report is not None:
            report.write_chrome_trace(path)
        return report

    @property
    def peak_live_microbatches(self) -> dict[int, int]:
        """Per local stage, the most microbatches whose activations were held at once in the last step."""
        return {s: r.peak_live_microbatches for s, r in self._runners.items()}

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stages

    @property
    def has_last_stage(self) -> bool:
        return self._last_stage in self.stages

    # -- the step ------------------------------------------------------------------------------
    def _check_inputs(self, args: tuple, kwargs: dict) -> tuple[list, list, list[int]]:
        """Split this rank's batch (stage 0 only): chunks and rows per microbatch."""
        if not self.has_first_stage:
            return [], [], []  # as in torch: inputs given to a rank without stage 0 are not used
        if not args and not kwargs:
            raise ValueError("the rank holding stage 0 must pass the batch to step()")
        return split_step_inputs(args, kwargs, self.n_microbatches, self._device, self.chunk_spec)

    def _check_target(self, plan: int, target: Any) -> list:
        """The target split per microbatch on the last stage's rank; [] when no loss is computed.

        As in torch: a target given on a rank without the last stage is not
        used; ``eval(target=)`` computes the losses without a backward.
        """
        if not self.has_last_stage:
            return []
        if target is None:
            if plan == _TRAIN:
                raise ValueError(
                    f"rank {self.rank} holds the last stage: a training step needs target= "
                    "(for a forward-only step use eval(), or loss_fn=None on every rank)"
                )
            return []
        if self.loss_fn is None:
            raise ValueError("target= was given but the schedule has no loss_fn to compute a loss with")
        return split_step_target(target, self.n_microbatches, self._device)

    def _post_agreement(self, plan: int, executor: Executor, args: tuple, kwargs: dict,
                        target: Any) -> tuple[StepInputs, PendingExchange]:
        """Check this rank's part of the step and post its record to every rank, before any stage runs.

        Every call takes part in exactly one exchange (docs/ARCHITECTURE.md,
        "Step protocol"), a rejected one too: so a rank that rejects its own
        inputs raises its own error, every other rank raises
        ``StepRejectedError`` naming it, and all of them stay in step. An
        accepted step does not wait here: the executor waits for the records
        right before the step's first message (``_start``).
        """
        # The group numbers the steps, whatever schedule runs them (GroupSteps): a message is never taken by
        # another schedule's step, nor by a schedule built anew on the group.
        step = GroupSteps.next(self._channel.group)
        record = StepRecord(rank=self.rank, step=step, plan=plan, schedule=self.schedule.name,
                            schedule_key=self._schedule_key, n_microbatches=self.n_microbatches,
                            num_stages=self.num_stages, has_loss=self.loss_fn is not None,
                            layouts=executor.plans.digest, skips=self._skip_digest,
                            transport=TRANSPORT_CODES[self._channel.requested])
        inputs = StepInputs()
        error: Optional[Exception] = None
        try:
            inputs.args, inputs.kwargs, sizes = self._check_inputs(args, kwargs)
            first = self.stages.get(0)
            if first is not None and first.input_args is not None:  # declared shapes: refuse before any stage runs
                for mb, chunk in enumerate(inputs.args):
                    _match_meta(first, "inputs", mb, tuple(chunk), first.input_args)
            if self.has_first_stage:
                record.rows = sum(sizes)
                record.signature = self._agreement.signature(args, kwargs, sizes, self.chunk_spec)
            inputs.targets = self._check_target(plan, target)
            if self.has_first_stage:  # after the targets: this rank may hold the last stage too
                inputs.loss_weights = self._weights(sizes, inputs.targets)
            record.target_rows = sum(microbatch_sizes((target,), {}, self.n_microbatches)) if inputs.targets else -1
        except Exception as exc:  # noqa: BLE001 - any failure here is this rank's rejection, told to all
            error = exc
            record.rejected = f"{type(exc).__name__}: {exc}"
        pending = self._agreement.post(record)
        if error is not None:
            try:
                records = pending.records()
                agree(records, self._first_rank, self._last_rank)
            except StepAgreementError:
                if hasattr(error, "add_note"):
                    error.add_note(f"pipeline_ext: rank {self.rank} rejected step {record.step}; every rank was "
                                   "told and raised, nothing was sent")
                raise error from None
            except Exception as exc:  # the peers could not be told; say both
                raise exc from error
        return inputs, pending

    def _start(self, inputs: StepInputs, pending: PendingExchange) -> StepStart:
        """The step's agreement, settled right before its first message (every rank takes the same decision)."""
        agreement = agree(pending.records(), self._first_rank, self._last_rank)
        self._settle_skips(agreement.skips)
        if not inputs.loss_weights:
            inputs.loss_weights = self._weights(agreement.sizes, inputs.targets)
        # Plans are per executor, so a forward-only step never shares one with a training step.
        # When the ranks' plan caches differ (a step failed on some ranks after others had
        # committed its layouts), every rank exchanges the layouts again.
        return StepStart(agreement.step, agreement.signature, agreement.discovery)

    def _settle_skips(self, digests: tuple[int, ...]) -> None:
        """Skip routes for the declarations the records announce: gathered once, again only when they change.

        Every rank sees the same records, so every rank takes part in the
        gather, or none does. Skips travel on their own tags, which NCCL
        ignores (it matches by order), so they are refused on NCCL pipelines.
        """
        if digests == self._skip_key:
            return
        routes = None
        if any(digests):
            routes = gather_routes(self._skip_decls, self.num_stages, self._agreement.group)
            if routes and self._device.type != "cpu":
                raise NotImplementedError(
                    f"skip connections between processes need a backend that matches messages by tag (Gloo); "
                    f"this pipeline's stages are on {self._device} (NCCL matches by order only). Keep the skip "
                    "inside one stage, or run the pipeline on CPU with Gloo"
                )
        self._skip_key, self._skip_routes = digests, routes
        for executor in (self._executor, self._eval_executor):
            if executor is not None:
                executor.set_skips(routes)

    def _weights(self, sizes: Sequence[int], targets: Sequence[Any]) -> list[Union[float, torch.Tensor]]:
        """Loss weight per microbatch: row shares, or the loss_fn's own (e.g. ``TokenMeanLoss``: token shares)."""
        return loss_weights(self.loss_fn, sizes, targets, self.scale_grads)

    def step(self, *args: Any, target: Any = None, losses: Optional[list] = None, return_outputs: bool = True,
             loss_kwargs: Optional[dict] = None, **kwargs: Any) -> Any:
        """One training step: forward and backward of every microbatch under the schedule.

        Gradients accumulate into ``.grad``. On the last stage, ``losses`` is
        filled with this step's per-microbatch losses (cleared first, as in
        torch) and the merged output is returned (None with
        ``return_outputs=False``). ``loss_kwargs`` go to every
        ``loss_fn(output, target, **loss_kwargs)`` call. Inputs given on a rank
        that does not hold stage 0, and a target on a rank without the last
        stage, are not used (as in torch). With ``loss_fn=None`` (on every
        rank) the step is forward only, as in torch: no backward, ``.grad``
        untouched.
        """
        if self.loss_fn is None:
            with torch.no_grad():
                return self._run(_FORWARD, args, kwargs, target, None, return_outputs, loss_kwargs)
        return self._run(_TRAIN, args, kwargs, target, losses, return_outputs, loss_kwargs)

    def eval(self, *args: Any, target: Any = None, losses: Optional[list] = None, return_outputs: bool = True,
             loss_kwargs: Optional[dict] = None, **kwargs: Any) -> Any:
        """Forward only (no_grad) under a forward-only version of the schedule; merged output on the last stage.

        With ``target=`` (and a ``loss_fn``) the losses are computed and put
        in ``losses`` as ``step()`` does, without any backward (as in torch).
        """
        with torch.no_grad():
            return self._run(_FORWARD, args, kwargs, target, losses, return_outputs, loss_kwargs)

    def _forward_executor(self) -> Executor:
        if self._eval_executor is None:
            self._eval_executor = self._new_executor(S.forward_only(self.schedule))
        return self._eval_executor

    def _new_executor(self, schedule: S.Schedule) -> Executor:
        """An executor of ``schedule`` on this rank's stages, with the skip routes known so far."""
        executor = Executor(schedule, self.rank, self._runners, self._channel, timeout=self.timeout,
                            skips=self._skip_routes)
        executor.expect_skips(i for i, d in self._skip_decls.items() if d)
        return executor

    def _run(self, plan: int, args: tuple, kwargs: dict, target: Any, losses: Optional[list],
             return_outputs: bool = True, loss_kwargs: Optional[dict] = None) -> Any:
        if self.plan_only:
            raise RuntimeError(f"{type(self).__name__} was built from stand-in stages (no module, no process "
                               "group): its order can be inspected (pipeline_order, _dump_csv), not run; build it "
                               "from PipelineStage objects to train")
        if self._executor is None:
            raise RuntimeError(f"{type(self).__name__} has no schedule yet: assign pipeline_order (or call "
                               "_load_csv) on every rank before step()")
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"losses must be a list, got {type(losses).__name__}")
        watch_signals()  # Ctrl-C ends this step's waits for peers at once
        if losses is not None:
            losses.clear()  # every call: it holds this step's losses, none when the step computes none or fails
        executor = self._executor if plan == _TRAIN else self._forward_executor()
        inputs, pending = self._post_agreement(plan, executor, args, kwargs, target)
        step_loss = self._loss_with(loss_kwargs)
        for r in self._runners.values():
            r.reset()
            r.loss_fn = step_loss
        if plan == _TRAIN:
            for hook in list(self._step_pre_hooks.values()):
                hook()
        tracing = self._tracer is not None and plan == _TRAIN
        if tracing:
            self._tracer.begin_step()
        try:
            executor.run(inputs, lambda: self._start(inputs, pending))
        except BaseException:
            for r in self._runners.values():
                r.reset()
            raise
        if plan == _TRAIN:
            for hook in list(self._step_post_hooks.values()):
                hook()
        if not self.has_last_stage:
            return None
        last = self._runners[self._last_stage]
        if losses is not None and last.losses:
            losses.extend(last.losses[m] for m in range(self.n_microbatches))
        chunks = [last.outputs[m] for m in range(self.n_microbatches)]
        last.outputs.clear()
        self.stages[self._last_stage].output_chunks = chunks
        return merge_chunks(chunks, self.output_merge_spec) if return_outputs else None

    def _loss_with(self, loss_kwargs: Optional[dict]) -> Optional[Callable[..., torch.Tensor]]:
        """The loss the runners call this step: ``loss_fn(output, target, **loss_kwargs)``."""
        if not loss_kwargs or self.loss_fn is None:
            return self.loss_fn
        fn = self.loss_fn
        return lambda output, target: fn(output, target, **loss_kwargs)

    # -- torch's schedule surface: the order as data, CSV ------------------------------------------
    @property
    def pipeline_order(self) -> dict[int, list[Any]]:
        """Every rank's compute actions in order, as torch's ``_Action`` objects (torch's ``pipeline_order``).

        ``self.schedule`` is the same order as this library's data (lowered:
        sends and receives included).

        Assigning it (``{rank: [actions]}``; torch's ``_Action`` objects, ours,
        their strings, None for an idle slot) runs that order from the next
        step, as a torch subclass of ``PipelineScheduleMulti`` does; every rank
        must assign the same order.
        """
        if self.schedule is None:
            return {}
        return torch_order(self.schedule)

    @pipeline_order.setter
    def pipeline_order(self, order: dict[int, Sequence[Any]]) -> None:
        if not order:  # torch's base classes start from an empty order
            return
        rows = [order.get(r, []) for r in range(max(order) + 1)]
        # compute_comms reads sends/receives when given; lowering adds them when not
        self._set_schedule(S.from_cells(rows, "compute_comms", self.n_microbatches, name=type(self).__name__))

    def _validate_and_set_stage_mapping(self, order: dict[int, Sequence[Any]]) -> None:
        """torch's name for assigning an order and taking the stage placement from it."""
        self.pipeline_order = order

    def _dump_csv(self, filename: str) -> None:
        """Write ``pipeline_order`` as torch's CSV: one row per rank, one action per cell."""
        S.dump_csv(self.schedule, filename)

    def _load_csv(self, filename: str, format: str = "compute_only") -> None:
        """Run the schedule in torch's CSV file from now on (every rank must load the same file).

        ``format``: "compute_only" (F, B, I, W; the sends and receives are
        added here) or "compute_comms" (every action given).
        """
        loaded = S.load_csv(filename, format=format, n_microbatches=self.n_microbatches)
        self._set_schedule(loaded)
