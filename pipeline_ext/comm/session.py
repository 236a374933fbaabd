"""One rank's side of a multi-process pipeline: a ``Session`` per schedule, a ``Step`` per call.

The session is built once per schedule and holds everything its steps share:
the channel (the transport), the NCCL direction groups, the step agreement on
its host group, the communication plans (one cache per step kind), and the
skip declarations with the routes settled from them.

``Session.begin`` checks this rank's part of a step (split the batch, check
the target, weigh the microbatches), posts its step record to every rank and
returns a ``Step``: the only thing the executor sees. A rank that rejects its
own inputs raises here at once (a peer may never come: it exited, or runs
something else); the record it posted tells every other rank, which raises
``StepRejectedError`` naming it, and the exchange is waited for with the next
step's (``PendingExchange.abandon``). An accepted step does not wait: the ``Step``
waits for the records when the executor opens it, right before its first
message (or before a stage that moves skips runs), so the exchange travels
while rank 0 runs its first forward.

[Note: one step, in order]
1. ``begin``: step number from the group (``GroupSteps``), inputs checked and
   split, record posted (``StepAgreement.post``); rejection raised on every rank.
2. The executor runs the step's compute; at its first message (or skip; after
   its last action on a rank with neither) it calls ``Step.open()``, the one
   trigger, which settles the step: ``agree`` over every rank's record (every rank takes the same
   decision, and learns every microbatch's signature), the channel's
   ``connect()`` (the transport, settled over the group once), skip routes gathered if
   the declarations are new, the channel's ``begin_step`` (shared memory drops
   earlier steps' leftovers), and the step kind's layouts opened
   (``PlanCache.step``: known when every microbatch's signature was seen, else
   a discovery step).
3. ``open()`` returns that plan's ``StepMessages``: the executor's sends and
   receives go through it to the channel.
4. Leaving the ``with step:`` block commits the plan a completed step
   discovered, or drops the send buffers of a failed one (a send may still be
   reading them) and tells the peers where it failed (``raised_at``: the
   executor's data on the exception).
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from pipeline_ext import schedules as S
from pipeline_ext.comm.agreement import (FORWARD, TRAIN, TRANSPORT_CODES, Agreement, PendingExchange,
                                         StepAgreement, StepRecord, agree, autocast_digest, describable,
                                         sizes_digest)
from pipeline_ext.comm.comm_plan import PlanCache, StepMessages
from pipeline_ext.comm.groups import DirectionGroups, GroupMaker, matches_by_order
from pipeline_ext.comm.identity import GroupSteps, stable_hash
from pipeline_ext.comm.transport import announce_edges, edges_digest, hosts_note, make_channel
from pipeline_ext.comm.skips import declarations_digest, gather_routes
from pipeline_ext.runtime.declared import Declared
from pipeline_ext.runtime.executor import StepInputs, raised_at
from pipeline_ext.runtime.microbatch import (given_microbatches, given_rank_kwargs, given_targets, loss_weights,
                                             split_rank_kwargs, split_step_inputs, split_step_target, target_sizes)
from pipeline_ext.runtime.ops import even_sizes
from pipeline_ext.runtime.skips import SkipRoutes, StageSkips
from pipeline_ext.runtime.stage import LossFn
from pipeline_ext.runtime.tags import check_tag_space

__all__ = ["Session", "Step", "TRAIN", "FORWARD"]

Weights = Sequence[Union[float, torch.Tensor]]


def host_group(group: Optional[dist.ProcessGroup], device: torch.device) -> Optional[dist.ProcessGroup]:
    """The group the step records travel on: the stages' own on CPU, a Gloo twin of it for GPU stages.

    The records are read on the host to decide the step. Received into GPU
    memory (NCCL) that read would synchronise the host with the GPU at every
    step, stalling behind the forward just queued; over Gloo they stay in host
    memory. The twin is made with every rank of the default group
    (``GroupMaker``), as torch's ``new_group`` requires: a group made by its
    members alone (``use_local_synchronization``) is named after how many
    groups each process already has, and two ranks with different histories
    would wait for each other forever. Its members run one all-reduce on it
    before the schedule is built (``warm_on``): Gloo connects a new group's
    pairs one side at a time, and a rank that went on and ended its process
    (a script that only builds a schedule) closed the connection under a
    member still connecting.
    """
    if device.type == "cpu":
        return group
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    return GroupMaker("gloo", warm_on=torch.device("cpu")).make([ranks])[ranks]


class SkipSettlement:
    """This rank's skip declarations, and the routes every rank settled from everyone's (once per change).

    Every rank sees the same records, so every rank takes part in the gather,
    or none does. Skips travel on tags of their own, which NCCL ignores (it
    matches by order), so they are refused on NCCL pipelines (``by_tag``: whether
    the channel matches by tag, asked once routes are needed).
    """

    def __init__(self, declared: dict[int, StageSkips], num_stages: int, n_microbatches: int,
                 group: Optional[dist.ProcessGroup], device: torch.device,
                 by_tag: Optional[Callable[[], bool]] = None) -> None:
        self._declared = declared
        self._by_tag = by_tag if by_tag is not None else (lambda: device.type == "cpu")
        self.digest = declarations_digest(declared)
        #: this rank's stages that stash or pop a skip another stage may hold
        self.stages = frozenset(i for i, d in declared.items() if d)
        self._num_stages, self._n_microbatches = num_stages, n_microbatches
        self._group, self._device = group, device
        self._key: tuple[int, ...] = ()
        self._routes: Optional[SkipRoutes] = None

    def routes(self, digests: tuple[int, ...]) -> Optional[SkipRoutes]:
        """The routes for every rank's declaration digests (gathered when they are new); None without skips."""
        if digests == self._key:
            return self._routes
        routes = None
        if any(digests):
            routes = gather_routes(self._declared, self._num_stages, self._group)
            if routes and not self._by_tag():
                raise NotImplementedError(
                    f"skip connections between processes need a transport that matches messages by tag (Gloo, "
                    f"shared memory, CUDA IPC); this pipeline's stages are on {self._device} over NCCL (it matches "
                    "by order only). Keep the skip inside one stage, use transport='ipc' with every rank on one "
                    "host, or run the pipeline on CPU"
                )
            if routes:
                check_tag_space(self._num_stages, self._n_microbatches, skips=True)
        self._key, self._routes = digests, (routes if routes else None)
        return self._routes


class Step:
    """One step's messages over the session's channel: what ``Executor.run`` is handed.

    Settles the step (the agreement, skip routes, loss weights, the
    communication plan) the first time any of them is needed, so the records'
    exchange overlaps the step's leading compute. Use it as a context manager
    around the executor's run: leaving it commits or abandons the step's
    communication plan.
    """

    def __init__(self, number: int, inputs: StepInputs, weights: list, pending: PendingExchange,
                 decide: Callable[[Sequence[StepRecord]], Any], skips: SkipSettlement, channel: Any,
                 plans: PlanCache, explain: Optional[Callable[[Any], str]] = None,
                 edges: Sequence[tuple[int, int]] = (),
                 agreed: Optional[Callable[[Agreement], None]] = None) -> None:
        self.number = number
        self.inputs = inputs
        self.skip_stages = skips.stages
        self._weights, self._pending, self._decide, self._skips = weights, pending, decide, skips
        self._channel, self._plans, self._explain = channel, plans, explain
        self._edges, self._agreed = edges, agreed
        self._routes: Optional[SkipRoutes] = None
        self._messages: Optional[StepMessages] = None

    def open(self) -> StepMessages:
        """Settle the step (see the class doc) once; the plan's messages every send and receive goes through.

        The executor calls it, once, right before the step's first message or skip (``Executor._open_due``);
        nothing else does.
        """
        if self._messages is None:
            agreement = self._decide(self._pending.records())
            if self._agreed is not None:  # what this rank checks against the others' records (before any compute)
                self._agreed(agreement)
            self._channel.connect()  # [Note: a channel connects at the step's opening] (transport/channels.py)
            self._routes = self._skips.routes(agreement.skips)
            self._channel.begin_step(self.number)
            # which edge uses what, said once (transport/decide.py [Note: transport per edge])
            announce_edges(self._channel.group, self._channel.settled, self._edges)
            self._messages = self._plans.step(self._channel, agreement.microbatches, agreement.rediscover,
                                              self._explain)
        return self._messages

    # -- what the executor asks ---------------------------------------------------------------
    def skip_routes(self) -> Optional[SkipRoutes]:
        """What ``open()`` settled (the executor opens the step before a stage that moves skips runs)."""
        return self._routes

    def loss_weights(self) -> Weights:
        """Computed in ``Session.begin`` from this rank's targets (the last stage's rank has them all)."""
        return self._weights

    # -- the step's end -----------------------------------------------------------------------
    def __enter__(self) -> "Step":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            if self._messages is None:  # the executor opens every step it runs, one without messages at its end
                self._pending.abandon()
                raise RuntimeError(f"step {self.number} ended without being opened (Step.open)")
            self._plans.commit(self._messages)
            return
        if self._messages is not None:
            self._plans.abandon(self._messages)
        else:  # failed before its first message: the records are waited for with the next step's
            self._pending.abandon()
        # The peers may be waiting in this step for what this rank will not send now: tell them, so their
        # waits end at once naming this failure, not at their timeout (on transports that can: shared memory)
        rank = self._channel.rank
        where = raised_at(exc)
        text = (f"step {self.number} failed on rank {rank}" + (f" {where}" if where and where.rank == rank else "")
                + f": {exc_type.__name__}: {str(exc)[:600]}")
        with contextlib.suppress(Exception):  # best effort: the error to raise here is the step's own
            self._channel.notify_failure(self.number, text)
        hosts = hosts_note(getattr(self._channel, "group", None))
        if hosts and hasattr(exc, "add_note") and hosts not in getattr(exc, "__notes__", ()):
            exc.add_note(hosts)  # a peer named by rank, on which machine


class Session:
    """What every step of one schedule on this rank shares; ``begin`` starts a step.

    ``local_stages``: this rank's stage indices; ``skips``: what each declares
    (``runtime/skips.declared_skips``). ``transport``: "auto", "process_group" (or "gloo"), "shm" or
    "ipc" (``comm/transport/channels.make_channel``).
    """

    def __init__(self, *, group: Optional[dist.ProcessGroup], rank: int, num_ranks: int, num_stages: int,
                 device: torch.device, local_stages: Sequence[int], skips: dict[int, StageSkips],
                 n_microbatches: int, loss_fn: Optional[LossFn], chunk_spec: Any, scale_grads: bool,
                 timeout: float, transport: Optional[str]) -> None:
        self.rank, self.num_ranks, self.num_stages, self.device = rank, num_ranks, num_stages, device
        self.n_microbatches, self.loss_fn, self.chunk_spec, self.scale_grads = (n_microbatches, loss_fn,
                                                                                chunk_spec, scale_grads)
        self._local = frozenset(local_stages)
        records = host_group(group, device)
        #: the transport (``comm/transport/`` chooses shared memory, CUDA IPC or the process group); GPU stages
        #: describe themselves to each other over the records' (Gloo) group
        self.channel = make_channel(group, device, num_stages, transport, timeout, setup_group=records)
        # NCCL: each direction between two ranks on a group of its own (comm/groups.py); not when CUDA IPC is forced
        self._directions = (DirectionGroups(group, device)
                            if matches_by_order(group, device) and self.channel.requested != "ipc" else None)
        self.agreement = StepAgreement(records, rank, num_ranks, torch.device("cpu"), timeout,
                                       ranks=dist.get_process_group_ranks(group or dist.group.WORLD))
        self._skips = SkipSettlement(skips, num_stages, n_microbatches, self.agreement.group, device,
                                     by_tag=self.channel.matches_by_tag)
        self._plans: dict[int, PlanCache] = {}
        self._schedule: Optional[S.Schedule] = None
        self.edges: list[tuple[int, int]] = []
        self._table_digest = 0

    def set_schedule(self, schedule: S.Schedule) -> None:
        """Run ``schedule`` (lowered, validated) from the next step on; its communication plans start empty."""
        if self._directions is not None:
            self._directions.route(self.channel, schedule.stage_to_rank)
        self._schedule = schedule
        self._first_rank, self._last_rank = schedule.stage_to_rank[0], schedule.stage_to_rank[-1]
        placement = schedule.stage_to_rank
        #: the pairs of ranks that hold consecutive stages: the pipeline's edges
        self.edges = sorted({(min(a, b), max(a, b)) for a, b in zip(placement, placement[1:]) if a != b})
        self._schedule_key = stable_hash(repr((
            schedule.name, tuple(schedule.stage_to_rank), self.n_microbatches,
            [[str(a) for a in acts] for acts in schedule.actions],
        )))
        self._plans = {TRAIN: PlanCache(), FORWARD: PlanCache()}

    @property
    def _has_first(self) -> bool:
        return 0 in self._local

    @property
    def _has_last(self) -> bool:
        return self.num_stages - 1 in self._local

    def begin(self, kind: int, args: Any, kwargs: Any, target: Any, loss_kwargs: Optional[dict] = None,
              split: bool = True, refused: Optional[Exception] = None,
              declared: Optional[Declared] = None) -> Step:
        """Check this rank's part of a step of ``kind`` and post it to every rank, before any stage runs.

        ``split``: ``args``/``kwargs``/``target`` are the whole batch, cut
        here; else they are the caller's microbatches (``step_microbatches``:
        lists with one entry per microbatch, any shapes; None where not given).

        ``refused``: the caller's own rejection of the step's arguments (the
        front end checks what it alone can, e.g. a mix of whole-batch and
        per-microbatch inputs); it is this rank's rejection like any other.

        ``declared``: what stage 0 declares now (``runtime/declared.py``; it
        may learn its shapes on its first step, so the front end hands it in
        each step; None when nothing is declared or this rank does not hold
        stage 0): each microbatch is checked against it before the step is posted.

        Every call takes part in exactly one exchange, a rejected one too: a
        rank that rejects its own inputs raises its own error at once, every
        other rank raises ``StepRejectedError`` naming it, and all stay in step.
        """
        assert self._schedule is not None, "set_schedule first"
        # The group numbers the steps, whatever schedule runs them (GroupSteps): a message is never taken by
        # another schedule's step, nor by a schedule built anew on the group.
        number = GroupSteps.next(self.channel.group)
        plans = self._plans[kind]
        record = StepRecord(rank=self.rank, step=number, kind=kind, schedule=self._schedule.name,
                            schedule_key=self._schedule_key, n_microbatches=self.n_microbatches,
                            num_stages=self.num_stages, has_loss=self.loss_fn is not None,
                            layouts=plans.digest, skips=self._skips.digest,
                            transport=TRANSPORT_CODES[self.channel.requested],
                            autocast=autocast_digest(self.device), edges=self._edges_digest())
        # every stage of this rank gets the rank's keyword arguments, as in torch ([Note: keyword arguments per rank])
        inputs = StepInputs(loss_fn=self._loss_with(loss_kwargs), kwargs_every_stage=True)
        weights: list = []
        agreed: Optional[Callable[[Agreement], None]] = None
        error: Optional[Exception] = None
        try:
            if refused is not None:
                raise refused
            if kind == TRAIN and not torch.is_grad_enabled():
                # short: the peers read it from the step record, whose reason holds 128 bytes
                raise RuntimeError(f"autograd is off on rank {self.rank} (no_grad/inference_mode): step() trains; "
                                   "use eval() to run forward only")
            if self._has_first:
                inputs.args, inputs.kwargs, sizes = self._inputs(args, kwargs, split)
                if declared is not None:  # declared shapes: refuse before any stage runs
                    for mb, chunk in enumerate(inputs.args):
                        declared.check("inputs", mb, tuple(chunk))
                record.rows, record.sizes = sum(sizes), sizes_digest(sizes)
                record.microbatches = describable(self.agreement.microbatch_signatures(inputs.args, inputs.kwargs))
            elif kwargs:  # this rank's own keyword arguments, for its stages (torch's kwargs on every rank)
                inputs.kwargs, rows = self._rank_kwargs(kwargs, split)
                if any(inputs.kwargs):
                    record.microbatches = describable(
                        self.agreement.microbatch_signatures([()] * len(inputs.kwargs), inputs.kwargs))
                    if rows is not None:
                        agreed = functools.partial(self._check_kwarg_rows, rows, kwargs, split)
                else:
                    inputs.kwargs = []
            if self._has_last:
                inputs.targets, rows = self._targets(kind, target, split)
                if inputs.targets:
                    record.target_rows, record.target_sizes = sum(rows), sizes_digest(rows)
                    weights = self._weigh(rows, inputs.targets)
        except Exception as exc:  # noqa: BLE001 - any failure here is this rank's rejection, told to all
            error = exc
            record.rejected = f"{type(exc).__name__}: {exc}"
        try:
            pending = self.agreement.post(record)
        except Exception as exc:  # noqa: BLE001 - the group is broken; a rejection says its own error first
            if error is None:
                raise
            if hasattr(error, "add_note"):
                error.add_note(f"pipeline_ext: rank {self.rank} rejected step {number}, and could not tell the "
                               f"other ranks: {exc}")
            raise error from None
        decide = functools.partial(agree, first_rank=self._first_rank, last_rank=self._last_rank)
        if error is not None:
            # Raised now, not after the peers' records came: a peer may never come (it exited, or runs
            # something else). The record posted tells each peer in its own call of this step.
            pending.abandon()
            if hasattr(error, "add_note"):
                error.add_note(f"pipeline_ext: rank {self.rank} rejected step {number}; nothing was sent, and every "
                               "other rank raises StepRejectedError naming it in its own call of this step (one "
                               "that calls it after this process ended is told the rank is gone instead)")
            raise error
        return Step(number, inputs, weights, pending, decide, self._skips, self.channel, plans,
                    self.agreement.counted_by_value if self._has_first else None, self.edges, agreed)

    def _edges_digest(self) -> int:
        """The settled transport table's digest for the step record (0 until the first step settles it; kept then:
        the table never changes)."""
        if not self._table_digest:
            self._table_digest = edges_digest(self.channel.edges)
        return self._table_digest

    def _inputs(self, args: Any, kwargs: Any, split: bool) -> tuple[list, list, list[int]]:
        """Stage 0's microbatches on this rank's device, and their rows (positional inputs on other ranks are not
        used, as in torch; their keyword arguments are: ``_rank_kwargs``)."""
        if not split:
            return given_microbatches(args, kwargs, self.n_microbatches, self.device, self.chunk_spec)
        if not args and not kwargs:
            raise ValueError("the rank holding stage 0 must pass the batch to step()")
        return split_step_inputs(args, kwargs, self.n_microbatches, self.device, self.chunk_spec)

    def _rank_kwargs(self, kwargs: Any, split: bool) -> tuple[list, Optional[list[int]]]:
        """A rank without stage 0: its own keyword arguments per microbatch, cut as stage 0's rank cuts its batch
        (the chunk spec, uneven rows), and their rows (None: nothing split); see [Note: keyword arguments per
        rank] in ``runtime/executor.py``."""
        if not split:
            return given_rank_kwargs(kwargs, self.n_microbatches, self.device, self.chunk_spec)
        return split_rank_kwargs(kwargs, self.n_microbatches, self.device, self.chunk_spec)

    def _check_kwarg_rows(self, rows: list[int], kwargs: Any, split: bool, agreement: Agreement) -> None:
        """Warn when this rank's keyword arguments were cut into other rows than stage 0's batch.

        Held to the rule stage 0's rank keeps for its own inputs
        (``microbatch_sizes``): each input is cut on its own, as torch cuts
        it, and part k goes to microbatch k, so rows that differ (a mask of
        another batch) would pair other rows silently; a tensor with one row
        per microbatch is legitimate there (torch's own test), hence a
        warning, not a refusal. Said before any stage of this rank runs.
        """
        if sizes_digest(rows) == agreement.sizes:
            return
        names = ", ".join(f"{k}=" for k in kwargs) if split else "kwarg_mbs"
        theirs = (", ".join(map(str, even_sizes(agreement.rows, self.n_microbatches)))
                  if split and agreement.rows >= self.n_microbatches else f"other rows ({agreement.rows} in all)")
        warnings.warn(
            f"pipeline_ext: rank {self.rank}'s keyword arguments ({names}) are cut into microbatches of "
            f"{', '.join(map(str, rows))} rows, stage 0's batch on rank {self._first_rank} into {theirs}: each is "
            f"cut on its own, as torch does, and part k of each goes to microbatch k on this rank's stages "
            f"{sorted(self._local)}. Pass this rank the keyword arguments of the same batch, or mark one that is "
            "not per-row Replicate() in the chunk spec", UserWarning, stacklevel=2)

    def _targets(self, kind: int, target: Any, split: bool) -> tuple[list, list[int]]:
        """The target per microbatch on the last stage's rank, and their rows; ``[]`` when no loss is computed.

        As in torch: a target given on a rank without the last stage is not
        used; ``eval(target=)`` computes the losses without a backward.
        """
        if target is None:
            if kind == TRAIN:
                raise ValueError(
                    f"rank {self.rank} holds the last stage: a training step needs "
                    f"{'target=' if split else 'target_mbs='} (for a forward-only step use eval(), or "
                    "loss_fn=None on every rank)"
                )
            return [], []
        if self.loss_fn is None:
            raise ValueError("a target was given but the schedule has no loss_fn to compute a loss with")
        if not split:
            return given_targets(target, self.n_microbatches, self.device)
        return (split_step_target(target, self.n_microbatches, self.device),
                target_sizes(target, self.n_microbatches))

    def _weigh(self, sizes: Sequence[int], targets: Sequence[Any]) -> list:
        """Loss weight per microbatch: row shares, or the loss_fn's own (e.g. ``TokenMeanLoss``: token shares)."""
        return loss_weights(self.loss_fn, sizes, targets, self.scale_grads)

    def _loss_with(self, loss_kwargs: Optional[dict]) -> Optional[LossFn]:
        """The loss the runners call this step: ``loss_fn(output, target, **loss_kwargs)``."""
        if not loss_kwargs or self.loss_fn is None:
            return self.loss_fn
        fn = self.loss_fn
        return lambda output, target: fn(output, target, **loss_kwargs)

