"""``PipelineSchedule``: runs any schedule on this process's stages, one ``step()`` at a time.

The engine behind every schedule class of ``pipelining/schedules.py``, which
is where it is imported from (``pipeline_ext.pipelining.schedules``, torch's
``torch.distributed.pipelining.schedules``); its own module only so that
neither file is twice the size of the others. Shaped like
``torch.distributed.pipelining``'s manual-stage API, so that moving a script
over is a one-line import change::

    stage = pe.PipelineStage(submodule, stage_index, num_stages, device)
    sched = pe.Schedule1F1B(stage, n_microbatches, loss_fn=loss_fn)
    sched.step(x)                                  # first stage
    sched.step(target=y, losses=losses)            # last stage
    sched.step()                                   # middle stages

Each process holds one stage (or several, for interleaved and V schedules).
A step is: ``Session.begin`` (check and post this rank's part) -> step
pre-hooks -> ``Executor.run`` over the returned ``Step`` -> step post-hooks
-> merge the last stage's outputs. The schedule classes only choose which
schedule (data) to build. torch's custom functions
(``register_custom_function``) are translated to and from torch's objects in
``custom_function.py``; torch's order and CSV format (``pipeline_order``,
``_dump_csv``, ``_load_csv``) are read and written by ``schedules/csv_io.py``.

Differences from torch, on purpose: batches that do not divide into the
microbatches are allowed (losses are weighted by each microbatch's rows, so the
gradients are still those of the whole batch's mean loss), a step whose
shapes differ from the previous step's works, and ``step_microbatches`` takes
microbatches of different shapes in one step (length-bucketed or packed
sequences): each microbatch's layouts are learnt once and known wherever it
comes in a later step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections import Counter, OrderedDict
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch.utils.hooks import RemovableHandle

from pipeline_ext import schedules as S
from pipeline_ext.comm.groups import group_timeout
from pipeline_ext.comm.session import FORWARD, TRAIN, Session
from pipeline_ext.comm.trace import gather_trace
from pipeline_ext.pipelining.custom_function import ReceivedView, bind_custom_functions, custom_key
from pipeline_ext.pipelining.param_budget import ParamBudget, param_budget
from pipeline_ext.pipelining.seq_pieces import PieceCut, PieceWeightedLoss
from pipeline_ext.pipelining.stage import PipelineStage, as_stage
from pipeline_ext.runtime.channel import check_timeout, watch_signals
from pipeline_ext.runtime.executor import Executor
from pipeline_ext.runtime.microbatch import merge_chunks, split_args_kwargs
from pipeline_ext.runtime.overlap import OVERLAPPED
from pipeline_ext.runtime.skips import declared_skips
from pipeline_ext.runtime.stage import split_report
from pipeline_ext.runtime.trace import ActionSample, Tracer, TraceReport
from pipeline_ext.schedules.csv_io import torch_order
from pipeline_ext.schedules.pieces import PIECE_SCHEDULES, build_pieces
from pipeline_ext.schedules.ir import OVERLAP_F_B

# imported from schedules.py, with torch's Schedule* classes over it
__all__ = ["PipelineSchedule"]


def _is_stand_in(stage: Any) -> bool:
    """A stage object without a module that only says where it sits (torch's tests mock ``_PipelineStageBase`` so).

    A subclass of ours counts too: ``_PipelineStageBase`` is ``PipelineStage``
    here, and torch's mocks subclass it without calling its ``__init__``; a
    stage built by that ``__init__`` always has a module.
    """
    return (getattr(stage, "submod", False) is None
            and all(hasattr(stage, a) for a in ("num_stages", "group_size", "group_rank")))


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
        overlap: Optional[bool] = None,
        max_active_stages: Optional[int] = None,
        max_unsharded_bytes: Optional[int] = None,
        seq_chunks: int = 1,
        seq_dim: int = 1,
        seq_split: Union[str, float] = "equal",
    ) -> None:
        given = [stages] if not isinstance(stages, (list, tuple)) else list(stages)
        if not given:
            raise ValueError("need at least one PipelineStage")
        #: built from stand-ins (stage objects without a module, as torch's own tests mock them): the
        #: schedule can be inspected (pipeline_order, _dump_csv) but not run
        self.inspect_only = all(_is_stand_in(s) for s in given)
        # torch-built stages (build_stage, pipe.build_stage) become ours
        stages = given if self.inspect_only else [as_stage(s) for s in given]
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
            schedule = (S.build(schedule, self.num_ranks, n_microbatches, stages_per_rank=v) if seq_chunks == 1 else
                        build_pieces(schedule, self.num_ranks, n_microbatches, seq_chunks, stages_per_rank=v))
        elif isinstance(schedule, S.Schedule) and schedule.pieces > 1:  # it says it runs pieces: run them
            if seq_chunks not in (1, schedule.pieces):
                raise ValueError(f"schedule {schedule.name!r} is over seq_chunks={schedule.pieces} pieces, but "
                                 f"seq_chunks={seq_chunks} was given")
            seq_chunks = schedule.pieces
        elif seq_chunks != 1:
            raise ValueError("seq_chunks= builds a built-in schedule over sequence pieces: give its name "
                             f"({', '.join(sorted(PIECE_SCHEDULES))}), or a Schedule over pieces "
                             "(schedules.pieces.build_pieces, or Schedule(..., pieces=K))")
        #: sequence pieces (``seq_chunks=K``, Seq1F1B): each microbatch cut into K pieces along ``seq_dim``, which the
        #: schedule runs as units (seq_pieces.py); None: whole microbatches
        self._cut: Optional[PieceCut] = PieceCut(seq_chunks, seq_dim, seq_split) if seq_chunks != 1 else None
        #: what the schedule and the runners count: microbatches, or their pieces
        self._units = n_microbatches * seq_chunks
        if self._cut is not None and loss_fn is not None:
            loss_fn = PieceWeightedLoss(loss_fn, seq_chunks)
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.chunk_spec = (args_chunk_spec, kwargs_chunk_spec)
        self.output_merge_spec = output_merge_spec
        self.scale_grads = scale_grads
        timeout = check_timeout(timeout, "the process group's timeout")
        if timeout is None and not self.inspect_only:
            timeout = group_timeout(self.group)
        self.timeout = timeout
        self.stages = {} if self.inspect_only else {s.stage_index: s for s in stages}
        if len(self.stages) != len(stages) and not self.inspect_only:
            raise ValueError("the same stage_index was given twice")
        self._runners = {i: s._make_runner(loss_fn, self._units, pieces=seq_chunks, seq_dim=seq_dim)
                         for i, s in self.stages.items()}
        self._last_stage = num_stages - 1
        self.num_stages = num_stages
        self._session: Optional[Session] = None
        if not self.inspect_only:
            # transport: "auto" | "process_group" | "shm" | "ipc", default $PIPELINE_EXT_TRANSPORT or "auto" (comm/transport/)
            self._session = Session(
                group=self.group, rank=self.rank, num_ranks=self.num_ranks, num_stages=num_stages,
                device=first.device, local_stages=list(self.stages),
                skips={i: declared_skips(s.submod) for i, s in self.stages.items()},
                n_microbatches=self._units, loss_fn=loss_fn, chunk_spec=self.chunk_spec,
                scale_grads=scale_grads, timeout=timeout, transport=transport)
        #: fully_shard stages' parameter budget (``max_active_stages`` / ``max_unsharded_bytes``): the planner
        #: places UNSHARD / RESHARD / REDUCE_GRAD in the schedule (param_budget.py); None: FSDP's own hooks
        self._budget: Optional[ParamBudget] = None if self.inspect_only else param_budget(
            stages, max_active_stages, max_unsharded_bytes, self.group, num_stages)
        self.schedule: Optional[S.Schedule] = None
        #: the lowered schedule without parameter actions: what an eval step runs (FSDP's hooks gather there)
        self._unplanned: Optional[S.Schedule] = None
        #: one executor per step kind (a forward-only one is built at the first eval)
        self._executors: dict[int, Executor] = {}
        self._tracer: Optional[Tracer] = None
        if schedule is not None:  # None: a torch-style subclass assigns pipeline_order next
            self._set_schedule(schedule)
        self.enable_tracing(trace)
        #: run each overlapped pair (``Schedule.overlapped``: DualPipeV's OVERLAP_F_B) as two threads that hand
        #: over at communication waits (``runtime/overlap.py``). None (default): on; results are bitwise those of
        #: the sequential pair (tested), so the only thing it changes is when compute runs. Off when False, and
        #: whenever the user registered a function for OVERLAP_F_B, F, B or I (theirs is what runs those actions).
        self.overlap = overlap
        #: functions registered with ``register_custom_function``, by our key (an ActionKind or OVERLAP_F_B)
        self._custom_functions: dict[Any, Callable[[Any, Any], None]] = {}
        #: torch's per-step count of finished backwards per stage (B or W), read by torch-style custom functions
        self.backward_counter: Counter[int] = Counter()
        # OrderedDicts: torch's RemovableHandle keeps a weak reference to them
        self._step_pre_hooks: OrderedDict[int, Callable[[], None]] = OrderedDict()
        self._step_post_hooks: OrderedDict[int, Callable[[], None]] = OrderedDict()
        self._action_hooks: OrderedDict[int, Callable[[ActionSample], None]] = OrderedDict()

    def _set_schedule(self, schedule: S.Schedule) -> None:
        """Lower, validate and run ``schedule`` from the next step on (a new one forgets every plan)."""
        if schedule.num_ranks != self.num_ranks or schedule.num_stages != self.num_stages:
            raise ValueError(
                f"schedule {schedule.name!r} is for {schedule.num_ranks} ranks and {schedule.num_stages} stages, "
                f"but the group has {self.num_ranks} ranks and the stages say num_stages={self.num_stages}"
            )
        if schedule.n_microbatches != self._units:
            raise ValueError(f"schedule {schedule.name!r} has {schedule.n_microbatches} microbatches, "
                             f"n_microbatches={self.n_microbatches}" +
                             (f" of seq_chunks={self._cut.pieces} pieces" if self._cut is not None else ""))
        mine = {s for s, r in enumerate(schedule.stage_to_rank) if r == self.rank}
        if mine != set(self.stages) and not self.inspect_only:
            raise ValueError(f"schedule {schedule.name!r} puts stages {sorted(mine)} on rank {self.rank}, "
                             f"but this rank was given stages {sorted(self.stages)}")
        if self._cut is not None and schedule.pieces == 1:  # an order over units read from torch's CSV or cells
            schedule = dataclasses.replace(schedule, pieces=self._cut.pieces)
        self._unplanned = S.lower(schedule)
        # over sequence pieces, also each sequence's forwards in piece order and backwards in reverse, per stage
        S.validate(self._unplanned, pieces=1 if self._cut is None else self._cut.pieces)
        self.schedule = self._unplanned if self._budget is None else self._budget.plan(self._unplanned)
        self._executors = {}
        if self._session is not None:
            self._session.set_schedule(self.schedule)
            self._executors[TRAIN] = Executor(self.schedule, self.rank, self._runners, timeout=self.timeout)
        if self._tracer is not None:  # a new schedule: the steps traced so far were another's
            self.enable_tracing(True)

    # -- torch's custom functions (torchtitan's DualPipeV overlap) -------------------------------
    def register_custom_function(self, computation_type: Any, custom_function: Callable[[Any, Any], None]) -> None:
        """Run ``custom_function(action, ctx)`` instead of this schedule's own work for every action of a kind.

        torch's hook (``_PipelineScheduleRuntime.register_custom_function``), so
        that torchtitan's DualPipeV overlap plugs in unchanged. ``computation_type``:
        torch's ``FORWARD``, ``FULL_BACKWARD``, ``BACKWARD_INPUT``,
        ``BACKWARD_WEIGHT`` or ``OVERLAP_F_B`` (or their spellings "F", "B",
        "I", "W", "OVERLAP_F_B"), or UNSHARD, RESHARD, REDUCE_GRAD: those run
        where a parameter budget placed them (``max_active_stages``), and, as
        in torch, the function runs instead of the gather, free or
        reduction itself (the plan's bookkeeping runs either way).
        ``action`` is torch's ``_Action`` (an OVERLAP_F_B pair has the forward
        and the backward as ``sub_actions``, forward first), ``ctx`` torch's
        ``_PipelineContext`` (this schedule as ``schedule_ref``, the step's
        microbatches, targets and losses). The function runs each microbatch
        with the stages' ``forward_one_chunk`` / ``backward_one_chunk`` /
        ``backward_weight_one_chunk``, in any order it likes; every action it
        was handed must have run when it returns. Why it is built this way: the
        executor only knows "call this for that kind, with a way to run each
        action"; receives were posted and waited on before, sends go after,
        exactly as without the function, so a registered function changes when
        the compute runs, never what travels. Registering again replaces.
        """
        key = custom_key(computation_type)
        if not callable(custom_function):
            raise TypeError(f"custom_function must be callable, got {type(custom_function).__name__}")
        if key in self._custom_functions:
            warnings.warn(f"a custom function for {key} was registered already; it is replaced", stacklevel=2)
        self._custom_functions[key] = custom_function

    def _custom_for_step(self, step_inputs: Any, losses: Optional[list]) -> dict[Any, Callable[..., None]]:
        """Per kind, the plain callable the executor calls: builds torch's context, binds the stages.

        With no user function for a pair or its halves' kinds, a pair goes to the overlapping runner (``overlap``).
        """
        if not self._custom_functions:
            return self._overlap_for_step()
        custom = bind_custom_functions(self, self._custom_functions, step_inputs, losses)
        if not set(custom) & {OVERLAP_F_B, S.ActionKind.F, S.ActionKind.B, S.ActionKind.I}:
            custom.update(self._overlap_for_step())
        return custom

    def _overlap_for_step(self) -> dict[Any, Callable[..., None]]:
        """``{OVERLAP_F_B: OVERLAPPED}`` (``run_overlapped``, a ``PairRunner``) when overlap is on and this rank
        has a pair, else nothing."""
        if self.overlap is False or self.schedule is None:
            return {}
        mine = set(self.stages)
        if not any(f.stage in mine for f, _ in self.schedule.overlapped):
            return {}
        return {OVERLAP_F_B: OVERLAPPED}

    # torch's runtime state that torch-style custom functions read; ours lives in the executor, so these are views
    @property
    def _n_microbatches(self) -> int:
        return self.n_microbatches

    @property
    def fwd_recv_ops(self) -> ReceivedView:
        """torch's pending forward receives, as the custom function sees them: (stage, mb) whose input is here."""
        return ReceivedView(self, forward=True)

    @property
    def bwd_recv_ops(self) -> ReceivedView:
        """torch's pending backward receives: (stage, mb) whose output gradient is here."""
        return ReceivedView(self, forward=False)

    def _maybe_compute_loss(self, stage: Any, output: Any, target_mbs: Any, mb_index: int, *args: Any) -> None:
        """torch's step after a last-stage forward; here the forward computed the loss already (nothing to do)."""

    def _maybe_get_loss(self, stage: Any, mb_index: int) -> Any:
        """The loss of microbatch ``mb_index`` on the last stage (None elsewhere), as torch's method."""
        runner = self._runners.get(getattr(stage, "stage_index", stage))
        return None if runner is None else runner.losses.get(mb_index)

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

    def register_action_hook(self, hook: Callable[[ActionSample], None]) -> RemovableHandle:
        """Call ``hook(sample)`` after every action this rank runs, in every step (``step()`` and ``eval()``).

        ``sample`` is a ``runtime.trace.ActionSample``: rank, stage, action
        kind, microbatch and the action's start and end ([Note: one sample per
        action, after it]). The extension point for per-action recorders (the
        ``ActivationMeter``'s peak, a user's own timeline), so that none has to
        take the tracer's place: tracing and any number of hooks run together.
        Hooks run on the executor's thread, in the order registered; one that
        raises fails the step as the action would. ``handle.remove()`` stops it.
        """
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        handle = RemovableHandle(self._action_hooks)
        self._action_hooks[handle.id] = hook
        return handle

    def _on_action(self, training: bool) -> Optional[Callable[[Any, float, float], None]]:
        """The executor's ``on_action`` for one step: the tracer (training steps) and the action hooks; None when
        neither is on (the executor then pays one test per action)."""
        record = self._tracer.record if self._tracer is not None and training else None
        hooks = list(self._action_hooks.values())
        if not hooks:
            return record
        rank = self.rank

        def on_action(action: Any, start: float, end: float) -> None:
            if record is not None:
                record(action, start, end)
            sample = ActionSample(rank, action, start, end)
            for hook in hooks:
                hook(sample)

        return on_action

    # -- tracing -------------------------------------------------------------------------------
    def enable_tracing(self, on: bool = True) -> None:
        """Record every executed action of the following steps (off by default; costs ~nothing when off).

        Turning it on again starts a fresh recording. See ``trace_report`` and ``write_trace``.
        """
        self._tracer = Tracer(self.rank) if on else None

    @property
    def tracing(self) -> bool:
        """Whether the following training steps are traced (``trace=True`` or ``enable_tracing()``)."""
        return self._tracer is not None

    def trace_report(self, dst: int = 0) -> Optional[TraceReport]:
        """Measured costs and bubble vs. the simulator's, over the traced steps.

        A collective (every rank calls it); the report comes back on group rank
        ``dst``, None elsewhere.
        """
        if self._tracer is None:
            raise RuntimeError("tracing is off: pass trace=True or call enable_tracing() before the steps")
        got = gather_trace(self._tracer, self.group, dst)
        return None if got is None else TraceReport(self.schedule, *got, transport=self.transport_per_edge)

    def write_trace(self, path: str, dst: int = 0) -> Optional[TraceReport]:
        """Write the traced steps as Chrome trace JSON on rank ``dst`` (a collective); returns the report there."""
        report = self.trace_report(dst)
        if report is not None:
            report.write_chrome_trace(path)
        return report

    @property
    def transport_per_edge(self) -> dict[str, str]:
        """Which transport each of the pipeline's edges (pairs of ranks holding consecutive stages) uses, once the
        first step settled it: ``{"0<->1": "shm", "1<->2": "process_group (hosts a|b)"}``; the same on every rank
        (comm/transport/decide.py, [Note: transport per edge]). Empty before the first step; on
        ``transport="process_group"`` every edge is the process group."""
        session = self._session
        if session is None or not session.edges:
            return {}
        channel = session.channel
        if channel.settled is None and channel.requested != "process_group":
            return {}
        table = channel.edges
        said = {}
        for a, b in session.edges:
            kind, reason = table.get((a, b), ("process_group", ""))
            said[f"{a}<->{b}"] = kind + (f" ({reason})" if reason else "")
        return said

    @property
    def split_report(self) -> dict[int, Optional[str]]:
        """Per local stage whose I ran: None where the I/W split held, else why it fell back to a whole backward
        at I (``runtime/split/obstacles.py``'s reason; ``UnsplitBackwardWarning`` says it once too)."""
        return split_report(self._runners)

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
    def step(self, *args: Any, target: Any = None, losses: Optional[list] = None, return_outputs: bool = True,
             loss_kwargs: Optional[dict] = None, arg_mbs: Optional[list] = None, kwarg_mbs: Optional[list] = None,
             target_mbs: Optional[list] = None, **kwargs: Any) -> Any:
        """One training step: forward and backward of every microbatch under the schedule.

        Gradients accumulate into ``.grad``. On the last stage, ``losses`` is
        filled with this step's per-microbatch losses (cleared first, as in
        torch) and the merged output is returned (None with
        ``return_outputs=False``, which also keeps no output: a step that
        returns nothing holds no logits). ``loss_kwargs`` go to every
        ``loss_fn(output, target, **loss_kwargs)`` call. Positional inputs
        given on a rank that does not hold stage 0, and a target on a rank
        without the last stage, are not used (as in torch); keyword arguments
        go to every stage of the rank they are given on, as in torch ([Note:
        keyword arguments per rank] in ``runtime/executor.py``). With ``loss_fn=None`` (on every
        rank) the step is forward only, as in torch: no backward, ``.grad``
        untouched.

        ``arg_mbs`` / ``kwarg_mbs`` / ``target_mbs`` (torch's newer pre-split
        form, which torchtitan calls): the batch already cut, one tuple of
        positional arguments / one dict / one target per microbatch, each
        list ``n_microbatches`` long. The step is ``step_microbatches``'s
        (microbatches of any shapes); the merged output is returned as for a
        whole batch. They cannot be mixed with whole-batch positional
        arguments, keyword arguments or ``target=`` (refused naming both).
        """
        kind = TRAIN if self.loss_fn is not None else FORWARD
        return self._dispatch("step", kind, args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs,
                              losses if kind == TRAIN else None, return_outputs, loss_kwargs)

    def eval(self, *args: Any, target: Any = None, losses: Optional[list] = None, return_outputs: bool = True,
             loss_kwargs: Optional[dict] = None, arg_mbs: Optional[list] = None, kwarg_mbs: Optional[list] = None,
             target_mbs: Optional[list] = None, **kwargs: Any) -> Any:
        """Forward only (no_grad) under a forward-only version of the schedule; merged output on the last stage.

        With ``target=`` (and a ``loss_fn``) the losses are computed and put
        in ``losses`` as ``step()`` does, without any backward (as in torch).
        ``arg_mbs`` / ``kwarg_mbs`` / ``target_mbs``: the batch already cut,
        as for ``step()``.
        """
        return self._dispatch("eval", FORWARD, args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs, losses,
                              return_outputs, loss_kwargs)

    def _dispatch(self, call: str, kind: int, args: tuple, kwargs: dict, target: Any, arg_mbs: Any, kwarg_mbs: Any,
                  target_mbs: Any, losses: Optional[list], return_outputs: bool, loss_kwargs: Optional[dict]) -> Any:
        """``step``/``eval`` on a whole batch (cut here), or on the caller's microbatches when any ``*_mbs`` is given.

        Why a mix is refused rather than merged: the whole batch would be cut
        into ``n_microbatches`` while the lists already are, and which one a
        stage runs would be a guess. The refusal (and a list of the wrong
        length) is this rank's rejection of the step, told to every rank in
        the step's agreement, so no peer waits for a step that will not run.
        """
        pre_split = [n for n, v in (("arg_mbs", arg_mbs), ("kwarg_mbs", kwarg_mbs), ("target_mbs", target_mbs))
                     if v is not None]
        refused: Optional[Exception] = None
        if pre_split:
            whole = ((["whole-batch positional arguments"] if args else []) + [f"{k}=" for k in kwargs]
                     + (["target="] if target is not None else []))
            if whole:
                refused = ValueError(
                    f"{call}(): {', '.join(n + '=' for n in pre_split)} (microbatches already cut) cannot be mixed "
                    f"with {', '.join(whole)} (a whole batch): pass the batch whole ({call}(x, target=y)) or as "
                    f"microbatches ({call}(arg_mbs=, kwarg_mbs=, target_mbs=)), not both")
            else:
                refused = self._check_microbatch_lists(arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs, target_mbs=target_mbs)
            args, kwargs, target = arg_mbs, kwarg_mbs, target_mbs
        grad = torch.no_grad() if kind == FORWARD else contextlib.nullcontext()
        with grad:
            if self._cut is not None:
                return self._run_pieces(kind, args, kwargs, target, losses, return_outputs, loss_kwargs,
                                        split=not pre_split, refused=refused)
            return self._run(kind, args, kwargs, target, losses, return_outputs, loss_kwargs, split=not pre_split,
                             merge=True, refused=refused)

    def _run_pieces(self, kind: int, args: Any, kwargs: Any, target: Any, losses: Optional[list],
                    return_outputs: bool, loss_kwargs: Optional[dict], split: bool,
                    refused: Optional[Exception]) -> Any:
        """A step over sequence pieces: the batch cut into microbatches (as without pieces), each of those into
        ``seq_chunks`` pieces (seq_pieces.py); outputs and losses come back per microbatch."""
        m, cut = self.n_microbatches, self._cut
        arg_mbs = kwarg_mbs = target_mbs = None
        if refused is None:
            try:
                if split:
                    if args or kwargs:
                        arg_mbs, kwarg_mbs = split_args_kwargs(args, kwargs, m, self.chunk_spec)
                        arg_mbs = arg_mbs if args else None
                        kwarg_mbs = kwarg_mbs if kwargs else None
                    if target is not None:
                        target_mbs = [t[0] for t in split_args_kwargs((target,), None, m, None)[0]]
                else:
                    arg_mbs, kwarg_mbs, target_mbs = args, kwargs, target
                arg_mbs, kwarg_mbs, target_mbs = cut.units(arg_mbs, kwarg_mbs, target_mbs)
            except Exception as exc:  # noqa: BLE001 - this rank's rejection, told to every rank in the agreement
                refused = exc
        # ``losses``: one per piece (microbatch j's at j*K .. j*K+K-1), weighted as the loss function weighs them
        outs = self._run(kind, arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs, False,
                         merge=False, refused=refused)
        if outs is None:
            return None
        per_mb = cut.merge(outs)
        self.stages[self._last_stage].output_chunks = per_mb
        return merge_chunks(per_mb, self.output_merge_spec) if split else per_mb

    def _check_microbatch_lists(self, **lists: Any) -> Optional[Exception]:
        """The error for a per-microbatch list that is not a list of ``n_microbatches`` entries, on every rank (as
        torch checks them); None when all are right. The ranks that use a list check its entries too."""
        for name, values in lists.items():
            if values is None:
                continue
            if not isinstance(values, (list, tuple)):
                return TypeError(f"{name} must be a list with one entry per microbatch, got {type(values).__name__}")
            if len(values) != self.n_microbatches:
                return ValueError(f"{name} has {len(values)} entries but the schedule runs "
                                  f"n_microbatches={self.n_microbatches}")
        return None

    def step_microbatches(self, arg_mbs: Optional[list] = None, kwarg_mbs: Optional[list] = None,
                          target_mbs: Optional[list] = None, losses: Optional[list] = None,
                          return_outputs: bool = True, loss_kwargs: Optional[dict] = None) -> Optional[list]:
        """One training step over microbatches the caller cut, of any shapes: a list of outputs on the last stage.

        ``arg_mbs``: one tuple of positional arguments per microbatch (stage
        0's rank); ``kwarg_mbs``: one dict per microbatch, or None;
        ``target_mbs``: one target per microbatch (the last stage's rank).
        Ranks without those stages pass None (what they pass is not used, as
        in torch). Microbatch ``k`` may have another sequence length, batch
        size or any other shape than microbatch ``k+1``: every rank learns
        every microbatch's signature in the step agreement, so each message's
        layout is known before it arrives once that signature was seen in an
        earlier step (in any position); a new one is learnt in this step.

        Losses are weighted as in ``step()``: by the loss function's own
        ``microbatch_weights`` (``TokenMeanLoss``: tokens) or by each
        microbatch's share of the rows. Returns the per-microbatch outputs on
        the last stage (None elsewhere, or with ``return_outputs=False``).
        """
        refused = self._check_microbatch_lists(arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs, target_mbs=target_mbs)
        if self._cut is not None:
            kind = TRAIN if self.loss_fn is not None else FORWARD
            with torch.no_grad() if kind == FORWARD else contextlib.nullcontext():
                return self._run_pieces(kind, arg_mbs, kwarg_mbs, target_mbs, losses if kind == TRAIN else None,
                                        return_outputs, loss_kwargs, split=False, refused=refused)
        if self.loss_fn is None:
            with torch.no_grad():
                return self._run(FORWARD, arg_mbs, kwarg_mbs, target_mbs, None, return_outputs, loss_kwargs, False,
                                 refused=refused)
        return self._run(TRAIN, arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs, False,
                         refused=refused)

    def eval_microbatches(self, arg_mbs: Optional[list] = None, kwarg_mbs: Optional[list] = None,
                          target_mbs: Optional[list] = None, losses: Optional[list] = None,
                          return_outputs: bool = True, loss_kwargs: Optional[dict] = None) -> Optional[list]:
        """``eval()`` over microbatches the caller cut (see ``step_microbatches``): forward only, no_grad."""
        refused = self._check_microbatch_lists(arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs, target_mbs=target_mbs)
        with torch.no_grad():
            if self._cut is not None:
                return self._run_pieces(FORWARD, arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs,
                                        split=False, refused=refused)
            return self._run(FORWARD, arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs, False,
                             refused=refused)

    def _step_microbatches(self, arg_mbs: Optional[list] = None, kwarg_mbs: Optional[list] = None,
                           target_mbs: Optional[list] = None, losses: Optional[list] = None,
                           return_outputs: bool = True, loss_kwargs: Optional[dict] = None) -> Optional[list]:
        """torch's private name for ``step_microbatches`` (torch leaves the outputs in ``stage.output_chunks``; so
        does this, and returns them too)."""
        return self.step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs)

    def _executor(self, kind: int) -> Executor:
        if kind not in self._executors:  # the forward-only version of the schedule, built at its first use
            forward = S.forward_only(self._unplanned)  # under a budget, planned too: an eval holds what a step does
            self._executors[kind] = Executor(forward if self._budget is None else self._budget.plan_forward(forward),
                                             self.rank, self._runners, timeout=self.timeout)
        return self._executors[kind]

    def _run(self, kind: int, args: Any, kwargs: Any, target: Any, losses: Optional[list],
             return_outputs: bool = True, loss_kwargs: Optional[dict] = None, split: bool = True,
             merge: Optional[bool] = None, refused: Optional[Exception] = None) -> Any:
        """Run one step; on the last stage return the outputs: merged (``merge``, default ``split``) or a list.

        ``refused``: this rank's rejection of the step's arguments, told to
        every rank in the agreement instead of raised alone (a peer would wait).
        """
        if self._session is None:
            raise RuntimeError(f"{type(self).__name__} was built from stand-in stages (no module, no process "
                               "group): its order can be inspected (pipeline_order, _dump_csv), not run; build it "
                               "from PipelineStage objects to train")
        if not self._executors:
            raise RuntimeError(f"{type(self).__name__} has no schedule yet: assign pipeline_order (or call "
                               "_load_csv) on every rank before step()")
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"losses must be a list, got {type(losses).__name__}")
        watch_signals()  # Ctrl-C ends this step's waits for peers at once
        if losses is not None:
            losses.clear()  # every call: it holds this step's losses, none when the step computes none or fails
        executor = self._executor(kind)
        first = self.stages.get(0)  # what stage 0 declares travels down as data, read here each step
        step = self._session.begin(kind, args, kwargs, target, loss_kwargs, split, refused=refused,
                                   declared=None if first is None else first._declared)
        for r in self._runners.values():  # torch's save_forward_output: nothing returned, nothing kept
            r.reset(keep_outputs=return_outputs)
            if self._budget is not None:  # the plan starts from every stage sharded, whatever ran before
                r.shard()
        training = kind == TRAIN
        if training:
            for hook in list(self._step_pre_hooks.values()):
                hook()
        if self._tracer is not None and training:
            self._tracer.begin_step()
        on_action = self._on_action(training)
        custom = self._custom_for_step(step.inputs, losses)
        try:
            with step:
                executor.run(step.inputs, step, on_action, custom)
        except BaseException:
            for r in self._runners.values():
                r.reset()
            raise
        if training:
            if self._tracer is not None:
                self._tracer.note_split(split_report(self._runners))
            for hook in list(self._step_post_hooks.values()):
                hook()
        if not self.has_last_stage:
            return None
        last = self._runners[self._last_stage]
        if losses is not None and last.losses:
            losses.extend(last.losses[m] for m in range(self._units))
        chunks = [last.outputs[m] for m in range(self._units)] if return_outputs else []
        last.outputs.clear()
        self.stages[self._last_stage].output_chunks = chunks
        if not return_outputs:
            return None
        if not (split if merge is None else merge):
            return list(chunks)
        if split:
            return merge_chunks(chunks, self.output_merge_spec)
        try:  # the caller's microbatches may have shapes that do not concatenate
            return merge_chunks(chunks, self.output_merge_spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            cls = type(exc) if type(exc) in (RuntimeError, ValueError, TypeError) else RuntimeError
            raise cls(
                f"the step ran (gradients accumulated, losses filled), but its microbatches' outputs could not be "
                f"merged into one ({exc}); pass return_outputs=False, or call step_microbatches() for the list "
                "of per-microbatch outputs") from exc

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
        self._set_schedule(S.from_cells(rows, "compute_comms", self._units, name=type(self).__name__))

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
        loaded = S.load_csv(filename, format=format, n_microbatches=self._units)
        self._set_schedule(loaded)
