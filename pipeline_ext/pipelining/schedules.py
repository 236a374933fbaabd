"""torch's ``torch.distributed.pipelining.schedules``: its schedule classes, by name, over one ``PipelineSchedule``.

A torch script changes one import (``torch.distributed.pipelining`` to
``pipeline_ext.pipelining``) and keeps its class names, its keyword
arguments and ``get_schedule_class`` lookups: ``PipelineScheduleSingle`` (one
stage per rank) and ``PipelineScheduleMulti`` (several) take torch's
parameters, and every ``Schedule*`` class only names which built-in schedule
(data, ``pipeline_ext.schedules``) it runs. The engine behind all of them is
``PipelineSchedule`` (``_schedule_base.py``), torch's ``_PipelineSchedule``
here; nothing in this file runs anything.

torch's action objects (``_Action``, ``FORWARD``, ``OVERLAP_F_B``, ...) and
``_PipelineContext`` are torch's own, lent on first use: they are what the
schedules here hand out (``pipeline_order``, a registered custom function's
arguments), so torch code compares and builds them as it does with torch.
torch's helpers that build its own orders or batch its own messages are
refused by name, saying what does that work here (``_GAPS``).
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, ClassVar, Optional, Sequence, Union

import torch

from pipeline_ext import schedules as S
from pipeline_ext._lazy import lazy_names, when_imported
from pipeline_ext.pipelining._schedule_base import PipelineSchedule
# merge_chunks, split_args_kwargs_into_chunks and _PipelineStageBase: torch's schedules module has them too
from pipeline_ext.pipelining.microbatch import TensorChunkSpec, merge_chunks, split_args_kwargs_into_chunks  # noqa: F401
from pipeline_ext.pipelining.stage import PipelineStage, _PipelineStageBase  # noqa: F401
from pipeline_ext.schedules.csv_io import torch_order

__all__ = [
    "PipelineSchedule",
    "PipelineScheduleSingle",
    "PipelineScheduleMulti",
    "_PipelineScheduleRuntime",
    "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleLoopedBFS",
    "ScheduleZBH1",
    "ScheduleZBH2",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
    "ScheduleVHalf",
    "ScheduleVMin",
    "_ScheduleForwardOnly",
    "get_schedule_class",
]

LossFn = Optional[Callable[..., torch.Tensor]]


class PipelineScheduleSingle(PipelineSchedule):
    """A built-in schedule with one stage per rank (torch's base class of GPipe and 1F1B).

    ``scale_grads=True`` (torch's default) weights each microbatch's loss by its
    share of the batch, so a mean-reduced ``loss_fn`` gives the gradients of the
    whole batch's mean; ``False`` sums the microbatch losses, as torch does.
    """

    #: the built-in schedule this class runs (``pipeline_ext.schedules.available()``)
    schedule_name: ClassVar[str] = ""

    def __init__(
        self,
        stage: PipelineStage,
        n_microbatches: int,
        loss_fn: LossFn = None,
        args_chunk_spec: Any = None,
        kwargs_chunk_spec: Any = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        *,
        timeout: float = 300.0,
        trace: bool = False,
        transport: Optional[str] = None,
        seq_chunks: int = 1,
        seq_dim: int = 1,
        seq_split: Union[str, float] = "equal",
    ) -> None:
        stages = list(stage) if isinstance(stage, (list, tuple)) else [stage]
        if len(stages) != 1:
            raise ValueError(f"{type(self).__name__} runs one stage per rank, got {len(stages)} stages; "
                             "use a multi-stage schedule such as ScheduleInterleaved1F1B")
        if not self.schedule_name:
            raise TypeError(f"{type(self).__name__} is a base class; use one of its schedules (e.g. Schedule1F1B)")
        super().__init__(stages, self.schedule_name, n_microbatches, loss_fn=loss_fn,
                         args_chunk_spec=args_chunk_spec, kwargs_chunk_spec=kwargs_chunk_spec,
                         output_merge_spec=output_merge_spec, scale_grads=scale_grads, timeout=timeout, trace=trace,
                         transport=transport, seq_chunks=seq_chunks, seq_dim=seq_dim, seq_split=seq_split)
        self._stage = stages[0]


class PipelineScheduleMulti(PipelineSchedule):
    """A built-in schedule with one or several stages per rank (torch's base class of the looped and V ones).

    ``use_full_backward`` is accepted and ignored, as torch now does (the
    backward is split into I and W where the schedule asks for it).
    ``backward_requires_autograd``: a training step under ``torch.no_grad()``
    is refused (torch's check), since it would compute no gradient.
    """

    schedule_name: ClassVar[str] = ""

    def __init__(
        self,
        stages: Union[PipelineStage, Sequence[PipelineStage]],
        n_microbatches: int,
        loss_fn: LossFn = None,
        args_chunk_spec: Any = None,
        kwargs_chunk_spec: Any = None,
        output_merge_spec: Any = None,
        use_full_backward: Optional[bool] = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        *,
        timeout: float = 300.0,
        trace: bool = False,
        transport: Optional[str] = None,
        overlap: Optional[bool] = None,
        max_active_stages: Optional[int] = None,
        max_unsharded_bytes: Optional[int] = None,
        seq_chunks: int = 1,
        seq_dim: int = 1,
        seq_split: Union[str, float] = "equal",
    ) -> None:
        # Without a schedule_name (torch's way of writing a custom schedule: subclass, then assign
        # self.pipeline_order), nothing runs until the order is assigned.
        super().__init__(stages, self.schedule_name or None, n_microbatches, loss_fn=loss_fn,
                         args_chunk_spec=args_chunk_spec, kwargs_chunk_spec=kwargs_chunk_spec,
                         output_merge_spec=output_merge_spec, scale_grads=scale_grads, timeout=timeout, trace=trace,
                         transport=transport, overlap=overlap,
                         max_active_stages=max_active_stages, max_unsharded_bytes=max_unsharded_bytes,
                         seq_chunks=seq_chunks, seq_dim=seq_dim, seq_split=seq_split)
        self._stages = list(self.stages.values())
        self._backward_requires_autograd = backward_requires_autograd

    def step(self, *args: Any, target: Any = None, losses: Optional[list] = None, return_outputs: bool = True,
             loss_kwargs: Optional[dict] = None, arg_mbs: Optional[list] = None, kwarg_mbs: Optional[list] = None,
             target_mbs: Optional[list] = None, **kwargs: Any) -> Any:
        if self.loss_fn is not None and self._backward_requires_autograd and not torch.is_grad_enabled():
            raise RuntimeError(
                "step() needs autograd (a training step under torch.no_grad() computes no gradient); use eval() "
                "for a forward-only step, or backward_requires_autograd=False"
            )
        return super().step(*args, target=target, losses=losses, return_outputs=return_outputs,
                            loss_kwargs=loss_kwargs, arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs, target_mbs=target_mbs,
                            **kwargs)


class _PipelineScheduleRuntime(PipelineScheduleMulti):
    """A schedule given as explicit actions, sends and receives included (torch's class of that name).

    torch's way to run a custom or a CSV schedule: subclass it and assign
    ``pipeline_order_with_comms``, or call ``_prepare_schedule_with_comms``
    / ``_load_actions`` with ``{rank: [actions]}`` (torch's ``_Action``
    objects, ours, or their strings). With ``format="compute_only"`` the
    sends and receives are added by lowering. Every rank must give the same
    order; it is validated (deadlock, FIFO) before it runs.

    ``defer_pp_recv`` (torch's switch that moves each receive next to the
    compute that consumes it) is accepted and changes nothing: see [Note:
    defer_pp_recv] below.
    """

    def __init__(
        self,
        stages: Union[PipelineStage, Sequence[PipelineStage]],
        n_microbatches: int,
        loss_fn: LossFn = None,
        args_chunk_spec: Any = None,
        kwargs_chunk_spec: Any = None,
        output_merge_spec: Any = None,
        use_full_backward: Optional[bool] = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        *,
        defer_pp_recv: bool = False,
        timeout: float = 300.0,
        trace: bool = False,
        transport: Optional[str] = None,
        overlap: Optional[bool] = None,
        max_active_stages: Optional[int] = None,
        max_unsharded_bytes: Optional[int] = None,
        seq_chunks: int = 1,
        seq_dim: int = 1,
        seq_split: Union[str, float] = "equal",
    ) -> None:
        # [Note: defer_pp_recv]
        # torch places each RECV as early as its order allows and, with defer_pp_recv=True, moves it to right
        # before the compute that consumes it (so that no receive is pending on the fabric during unrelated
        # compute, e.g. an FSDP all-gather on ROCm), flushing receives before sends to a higher rank so that the
        # pair cannot block. Our lowering (schedules/lowering.py, ``lower``) already places every RECV right
        # before its consumer, moved earlier only where a pair of ranks must receive in the order the peer sends;
        # the executor posts up to ``recv_window`` (4) of the following receives ahead, in that order, and waits
        # on each at its RECV, right before use. The switch would change only when a receive is posted, never
        # what arrives, so it is accepted, checked to be a bool, kept as ``self.defer_pp_recv``, and the step is
        # the same bit for bit (tests/stages/test_torch_parity.py). docs/parity.md says so for users.
        if not isinstance(defer_pp_recv, bool):
            raise TypeError(f"defer_pp_recv must be a bool, got {type(defer_pp_recv).__name__}")
        #: torch's switch, accepted; the receives are already placed next to their use ([Note: defer_pp_recv])
        self.defer_pp_recv = defer_pp_recv
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         use_full_backward, scale_grads, backward_requires_autograd, timeout=timeout, trace=trace,
                         transport=transport, overlap=overlap,
                         max_active_stages=max_active_stages, max_unsharded_bytes=max_unsharded_bytes,
                         seq_chunks=seq_chunks, seq_dim=seq_dim, seq_split=seq_split)

    def _prepare_schedule_with_comms(self, actions: dict[int, Sequence[Any]], format: str = "compute_only") -> None:
        rows = [actions.get(r, []) for r in range(max(actions) + 1)] if actions else []
        self._set_schedule(S.from_cells(rows, format, self.n_microbatches, name=type(self).__name__))

    _load_actions = _prepare_schedule_with_comms  # torch's earlier name

    @property
    def pipeline_order_with_comms(self) -> dict[int, list[Any]]:
        """Every rank's actions, sends and receives included, as torch's ``_Action`` objects."""
        return {} if self.schedule is None else torch_order(self.schedule, compute_only=False)

    @pipeline_order_with_comms.setter
    def pipeline_order_with_comms(self, actions: dict[int, Sequence[Any]]) -> None:
        self._prepare_schedule_with_comms(actions, format="compute_comms")


class ScheduleGPipe(PipelineScheduleSingle):
    """GPipe: all forwards, then all backwards."""

    schedule_name = "gpipe"


class Schedule1F1B(PipelineScheduleSingle):
    """1F1B: one forward, one backward in steady state; at most p microbatches live."""

    schedule_name = "1f1b"


class _ScheduleForwardOnly(PipelineScheduleSingle):
    """Forward only: ``step()`` runs every microbatch forward, no loss and no backward (torch's name)."""

    schedule_name = "gpipe"

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: LossFn = None, args_chunk_spec: Any = None,
                 kwargs_chunk_spec: Any = None, output_merge_spec: Any = None, scale_grads: bool = True,
                 **kwargs: Any) -> None:
        if loss_fn is not None:
            raise ValueError("_ScheduleForwardOnly computes no loss: pass loss_fn=None")
        super().__init__(stage, n_microbatches, None, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads, **kwargs)


class ScheduleZBH1(PipelineScheduleSingle):
    """ZB-H1: zero-bubble H1, backward split into I and W, 1F1B's memory."""

    schedule_name = "zb_h1"


class ScheduleZBH2(PipelineScheduleSingle):
    """ZB-H2: zero-bubble H2, more warm-up forwards to fill the bubble."""

    schedule_name = "zb_h2"


class _BuiltinRuntime(_PipelineScheduleRuntime):
    """The looped and V built-ins, with torch's positional order for them.

    torch's ``ScheduleInterleaved1F1B`` and its siblings take ``(stages,
    n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec,
    output_merge_spec, scale_grads, backward_requires_autograd,
    defer_pp_recv)``: no ``use_full_backward`` between ``output_merge_spec``
    and ``scale_grads`` as in ``PipelineScheduleMulti``. A torch script that
    passes ``scale_grads`` by position must set ``scale_grads`` here too, not
    ``use_full_backward`` (a silent change of the gradients' scale), so these
    classes take torch's order and ``use_full_backward`` by keyword only.
    """

    def __init__(
        self,
        stages: Union[PipelineStage, Sequence[PipelineStage]],
        n_microbatches: int,
        loss_fn: LossFn = None,
        args_chunk_spec: Any = None,
        kwargs_chunk_spec: Any = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
        *,
        use_full_backward: Optional[bool] = None,
        timeout: float = 300.0,
        trace: bool = False,
        transport: Optional[str] = None,
        overlap: Optional[bool] = None,
        max_active_stages: Optional[int] = None,
        max_unsharded_bytes: Optional[int] = None,
        seq_chunks: int = 1,
        seq_dim: int = 1,
        seq_split: Union[str, float] = "equal",
    ) -> None:
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         use_full_backward, scale_grads, backward_requires_autograd, defer_pp_recv=defer_pp_recv,
                         timeout=timeout, trace=trace, transport=transport, overlap=overlap,
                         max_active_stages=max_active_stages, max_unsharded_bytes=max_unsharded_bytes,
                         seq_chunks=seq_chunks, seq_dim=seq_dim, seq_split=seq_split)


class ScheduleInterleaved1F1B(_BuiltinRuntime):
    """Interleaved 1F1B: several looped stages per rank (Megatron order); one per rank also runs."""

    schedule_name = "interleaved_1f1b"


class ScheduleInterleavedZeroBubble(_BuiltinRuntime):
    """Interleaved zero bubble (ZB1P): interleaved 1F1B's order, backward split, W filling the bubble."""

    schedule_name = "interleaved_zb"


class ScheduleLoopedBFS(_BuiltinRuntime):
    """Looped BFS: several looped stages per rank, breadth first; one per rank also runs.

    torch's order for this one has no chunk specs: ``(stages, n_microbatches,
    loss_fn, output_merge_spec, scale_grads, backward_requires_autograd,
    defer_pp_recv)``; the specs are taken by keyword (the other classes'
    meaning).
    """

    schedule_name = "looped_bfs"

    def __init__(
        self,
        stages: Union[PipelineStage, Sequence[PipelineStage]],
        n_microbatches: int,
        loss_fn: LossFn = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
        *,
        args_chunk_spec: Any = None,
        kwargs_chunk_spec: Any = None,
        use_full_backward: Optional[bool] = None,
        timeout: float = 300.0,
        trace: bool = False,
        transport: Optional[str] = None,
        overlap: Optional[bool] = None,
        max_active_stages: Optional[int] = None,
        max_unsharded_bytes: Optional[int] = None,
        seq_chunks: int = 1,
        seq_dim: int = 1,
        seq_split: Union[str, float] = "equal",
    ) -> None:
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads, backward_requires_autograd, defer_pp_recv, use_full_backward=use_full_backward,
                         timeout=timeout, trace=trace, transport=transport, overlap=overlap,
                         max_active_stages=max_active_stages, max_unsharded_bytes=max_unsharded_bytes,
                         seq_chunks=seq_chunks, seq_dim=seq_dim, seq_split=seq_split)


class ScheduleZBVZeroBubble(_BuiltinRuntime):
    """ZB-V: zero-bubble V, two stages per rank in a V."""

    schedule_name = "zbv"


class ScheduleDualPipeV(_BuiltinRuntime):
    """DualPipeV: DeepSeek's DualPipe on a V placement, two stages per rank."""

    schedule_name = "dualpipev"


class ScheduleVHalf(_BuiltinRuntime):
    """V-Half: V placement, backward split, about half of 1F1B's activation memory (controllable-memory V)."""

    schedule_name = "v_half"


class ScheduleVMin(_BuiltinRuntime):
    """V-Min: V placement, backward split, about a third of 1F1B's activation memory (controllable-memory V)."""

    schedule_name = "v_min"


def _register_with_torch(torch_schedules: ModuleType) -> None:
    """``issubclass(cls, torch's _PipelineSchedule)`` holds for every class here, as torch code checks it."""
    torch_schedules._PipelineSchedule.register(PipelineSchedule)


# once a program imports torch's pipelining (only code that does can ask), not before: see pipeline_ext/_lazy.py
when_imported("torch.distributed.pipelining.schedules", _register_with_torch)

# torch's names (case-insensitive, as in torch), plus ours and torchtitan's spellings.
_BY_NAME: dict[str, type] = {
    "1f1b": Schedule1F1B,
    "interleaved1f1b": ScheduleInterleaved1F1B,
    "gpipe": ScheduleGPipe,
    "loopedbfs": ScheduleLoopedBFS,
    "interleavedzerobubble": ScheduleInterleavedZeroBubble,
    "interleavedzb": ScheduleInterleavedZeroBubble,
    "pipelineschedulesingle": PipelineScheduleSingle,
    "pipelineschedulemulti": PipelineScheduleMulti,
    "zbvzerobubble": ScheduleZBVZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
    "vhalf": ScheduleVHalf,
    "vmin": ScheduleVMin,
    "zbh1": ScheduleZBH1,
    "zbh2": ScheduleZBH2,
}


def get_schedule_class(name: str) -> type:
    """The schedule class for a name, case-insensitive: torch's ("1F1B", "Interleaved1F1B", "ZBVZeroBubble",
    "PipelineScheduleSingle") or ours ("zb_h1", "interleaved_zb")."""
    key = name.lower().replace("_", "").replace("-", "")
    if key.startswith("schedule") and key != "schedule":
        key = key[len("schedule"):]
    if key not in _BY_NAME:
        raise ValueError(f"unknown schedule {name!r}; known: {sorted({c.__name__ for c in _BY_NAME.values()})}")
    return _BY_NAME[key]


#: torch's base class of every schedule; here ``PipelineSchedule`` is (torchtitan annotates with it)
_PipelineSchedule = PipelineSchedule
#: how torch cuts a step's target into microbatches: along dim 0, as here
_TARGET_CHUNK_SPEC = TensorChunkSpec(0)

#: torch's objects, lent on first use (torch's pipelining costs a rank about a second to import): the action
#: kinds and ``_Action`` that ``pipeline_order`` and custom functions hand out, the context and ``_wait_batch_p2p``
#: a custom function uses (the receives it waits on are done: ``custom_function.ReceivedView``), stage
#: placement helpers, and torch's pure functions over an order of ``_Action`` objects (format, validate, simulate,
#: add sends and receives), which read ``pipeline_order`` here as they read torch's
_TORCHS = dict.fromkeys([
    "_Action", "_ComputationType", "F", "B", "I", "W", "FORWARD", "FULL_BACKWARD", "BACKWARD_INPUT",
    "BACKWARD_WEIGHT", "OVERLAP_F_B", "UNSHARD", "RESHARD", "REDUCE_GRAD", "SEND_F", "RECV_F", "SEND_B", "RECV_B",
    "_PipelineContext", "_CustomFunctionProtocol", "_wait_batch_p2p", "InferenceMode",
    "generate_rank_to_stage_mapping", "generate_stage_to_rank_mapping",
    "_format_pipeline_order", "_validate_schedule", "_simulate_comms_compute", "_dump_chrometrace", "_add_send_recv",
    "_merge_bw", "_add_unshard_reshard", "_add_reduce_grad",
], "torch.distributed.pipelining.schedules")
#: torch's names with no counterpart here, and what does their work instead (docs/parity.md)
_GAPS = {
    **dict.fromkeys(["_batch_p2p", "_sorted_batch_p2p"],
                    "torch's batching of its send/recv ops; the executor here posts each message itself (comm/)"),
    "_RecvInfo": "torch's stage receive buffers; stages here receive into buffers of the layouts the step learnt "
                 "(comm/comm_plan.py)",
    "_check_torch_compile_compatibility": "torch refuses a torch.compile'd stage under a zero-bubble schedule; "
                                          "here it runs (docs/parity.md)",
    "_defer_recv_ops": "each receive already sits right before its consumer: [Note: defer_pp_recv] in "
                       "pipeline_ext/pipelining/schedules.py",
    **dict.fromkeys(["_get_1f1b_rank_ops", "_get_warmup_ops"],
                    "torch's builders of its own orders; orders here are pipeline_ext.schedules.build(name, ...)"),
    "_requires_reduce_grad": "torch's FSDP REDUCE_GRAD bookkeeping; schedules here have no FSDP actions "
                             "(gradients sync once per step: comm/data_parallel.py)",
    "_get_profiler_function_name": "torch's record_function labels; traces here: trace=True, write_trace()",
    "_split_tensor": "torch's cut of one tensor; split_args_kwargs_into_chunks cuts each tensor here "
                     "(runtime/microbatch.py)",
}
__getattr__, __dir__ = lazy_names(__name__, _TORCHS, gaps=_GAPS)
