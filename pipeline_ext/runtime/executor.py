"""The executor: walks one rank's lowered action list for one step.

There is one executor for every schedule, built-in or hand-written, and for
both modes: a single process runs one executor per rank on worker threads with
in-process channels; ``torchrun`` runs one per process over torch.distributed.
Only the channel differs.

What it does per action (stage s, microbatch m):

- F: run the stage on its input (the step's microbatch on stage 0, a received
  or locally handed-over activation otherwise); keep the output for SEND_F or
  hand it to stage s+1 directly when that stage lives on this rank.
- B / I: backward with the gradient of the output (received, handed over, or
  the loss on the last stage); keep the input gradient for SEND_B or hand it to
  stage s-1 on this rank. W: the deferred weight-grad half.
- SEND_*: start an asynchronous send (back-to-back sends as one batch, see
  ``DistChannel.batch``); completed sends are reaped as the step goes, so
  sent activations are freed once on the wire.
- RECV_*: receives are posted ahead of time (a bounded window, in list order,
  which keeps FIFO order per peer) and waited on here, right before use.

Nothing moves before the step is agreed: ``run`` may be given the step's start
(step number, signature) as a callable, called right before the first send or
receive, so a step agreement between processes runs while the leading compute
does. Over a ``DistChannel`` the executor owns the communication plans
(``runtime/protocol/plan.py``): one cache per executor, so a training and a
forward-only executor never share one.

Skip connections (``pipeline_ext.skip``): given ``skips`` routes, a stage's
F also sends the skips it stashed straight to the popping stage's rank (or
hands them over locally), and the popping stage's F receives them first; the
gradients go back the same way around B/I. These messages are not actions of
the schedule: they ride on F, B and I, whose order already guarantees that a
skip is sent before it is waited for (``skip/routes.py``).

Every wait has a timeout and reports rank, peer, action and microbatch.
"""
from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import (Any, Callable, ContextManager, Hashable, Mapping, NamedTuple, Optional, Protocol, Sequence,
                    Union)

import torch

from pipeline_ext.runtime.protocol.identity import check_tag_space, message_tag, skip_tag
from pipeline_ext.runtime.protocol.plan import DEFAULT_MAX_PLANS, PlanCache, StepMessages
from pipeline_ext.schedules import Action, ActionKind, Schedule
from pipeline_ext.skip.routes import SkipRoutes, pack_skip_grads, pack_skips, unpack_skips
from pipeline_ext.skip.tracker import SkipKey

__all__ = ["Channel", "Handle", "Runner", "Executor", "StepInputs", "StepStart", "PeerError", "PipelineTimeoutError"]

_MESSAGES = (ActionKind.SEND_F, ActionKind.SEND_B, ActionKind.RECV_F, ActionKind.RECV_B)
_SENDS = (ActionKind.SEND_F, ActionKind.SEND_B)


class PipelineTimeoutError(TimeoutError):
    """A wait for a peer ran past the configured timeout."""


class PeerError(RuntimeError):
    """Starting a send or receive failed (typically: the peer is gone); names rank, peer, action."""


class Handle(Protocol):
    """An operation in flight. ``wait`` blocks (GIL released) up to ``timeout`` seconds."""

    def wait(self, timeout: float, what: str) -> list[torch.Tensor]: ...

    def is_completed(self) -> bool: ...


SkipValues = Mapping[SkipKey, Optional[torch.Tensor]]


class Runner(Protocol):
    """What the executor asks of one stage: F, B, I and W on microbatches.

    ``StageRunner`` is the one implementation; ``ConnectedRunner`` (Pipe's
    autograd-connected forward) and ``GuardedRunner`` (Pipe's cancellable
    steps) wrap it and are typed peers of it through this protocol.

    Skips: ``forward`` gets the skips popped on this stage (``skips``) and
    ``take_stashed`` gives the ones it stashed for later stages; backward gets
    the gradients of those (``skip_grads``) and ``take_skip_grads`` gives the
    gradients of the popped ones. Only called on stages that have skips.
    """

    @property
    def is_last(self) -> bool: ...

    def forward(self, mb: int, args: Sequence[Any], kwargs: Optional[dict[str, Any]] = None, target: Any = None,
                loss_weight: float = 1.0, skips: Optional[SkipValues] = None) -> tuple[torch.Tensor, ...]: ...

    def backward(self, mb: int, grad_outputs: Optional[Sequence[Optional[torch.Tensor]]] = None,
                 skip_grads: Optional[SkipValues] = None) -> list[torch.Tensor]: ...

    def backward_input(self, mb: int, grad_outputs: Optional[Sequence[Optional[torch.Tensor]]] = None,
                       skip_grads: Optional[SkipValues] = None) -> list[torch.Tensor]: ...

    def backward_weight(self, mb: int) -> None: ...

    def take_stashed(self, mb: int) -> dict[SkipKey, Optional[torch.Tensor]]: ...

    def take_skip_grads(self, mb: int) -> dict[SkipKey, Optional[torch.Tensor]]: ...


class Channel(Protocol):
    """Moves lists of tensors between ranks, matched by (peer, tag)."""

    def send(self, tensors: Sequence[torch.Tensor], peer: int, tag: int, owned: bool = False) -> Handle:
        """Sends ``tensors``; the send owns its bytes when it returns, unless they are ``owned``: the
        pipeline's own (gradients autograd computed), which no one else can write."""
        ...

    def recv(self, peer: int, tag: int) -> Handle: ...


@dataclass
class StepInputs:
    """What one step feeds the executor (only the ranks that need each part get it)."""

    args: Sequence[tuple[Any, ...]] = ()  # per microbatch, for stage 0
    kwargs: Sequence[dict[str, Any]] = ()  # per microbatch, for stage 0
    targets: Sequence[Any] = ()  # per microbatch, for the last stage
    loss_weights: Sequence[Union[float, torch.Tensor]] = ()  # per microbatch, for the last stage


@dataclass(frozen=True)
class StepStart:
    """What every rank agreed on about a step, needed before its first message."""

    step: int = 0  # part of every message's tag (protocol/identity.py)
    signature: Optional[Hashable] = None  # the communication plan's key; None: every message carries its layout
    rediscover: bool = False  # exchange every layout again, whatever this rank's plan cache holds


class _SkipMessage(NamedTuple):
    """A skip message (or its gradient) between a stashing and a popping stage: not an action of the schedule."""

    src: int
    dst: int
    microbatch: int
    gradient: bool


@dataclass
class _StepState:
    inputs: dict[tuple[int, int], tuple[Any, ...]] = field(default_factory=dict)
    grads: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    to_send: dict[Action, list[torch.Tensor]] = field(default_factory=dict)
    posted: dict[Action, Handle] = field(default_factory=dict)
    sends: deque = field(default_factory=deque)  # (action or skip message, handle) in issue order
    skips: dict[_SkipMessage, SkipValues] = field(default_factory=dict)  # handed over on this rank
    pending: deque = field(default_factory=deque)  # receives not posted yet


class Executor:
    """Runs ``schedule.actions[rank]`` with the given stage runners and channel.

    ``recv_window`` bounds how many receives are posted ahead (memory for their
    buffers vs. overlap). ``on_action(action, start, end)`` is called after each
    action when set (tracing). ``max_plans`` bounds the communication plans kept
    (over a channel that needs layouts). ``skips``: the pipeline's skip routes
    (``pipeline_ext.skip``), or set them later with ``set_skips``.
    """

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        runners: dict[int, Runner],
        channel: Channel,
        timeout: float = 300.0,
        recv_window: int = 4,
        on_action: Optional[Callable[[Action, float, float], None]] = None,
        max_plans: int = DEFAULT_MAX_PLANS,
        skips: Optional[SkipRoutes] = None,
    ) -> None:
        if not schedule.lowered and schedule.num_ranks > 1:
            raise ValueError("Executor needs a lowered schedule (see pipeline_ext.schedules.lower)")
        self.schedule = schedule
        self.rank = rank
        self.actions: list[Action] = list(schedule.actions[rank])
        self.runners = runners
        self.channel = channel
        self.timeout = timeout
        self.recv_window = max(1, recv_window)
        self.on_action = on_action
        self.num_stages = schedule.num_stages
        self._rank_of = schedule.stage_to_rank
        mine = {s for s, r in enumerate(self._rank_of) if r == rank}
        if set(runners) != mine:
            raise ValueError(
                f"rank {rank} holds stages {sorted(mine)} in schedule {schedule.name!r} "
                f"but was given stages {sorted(runners)}"
            )
        self._dispatch = {
            ActionKind.F: self._forward,
            ActionKind.B: self._backward,
            ActionKind.I: self._backward,
            ActionKind.W: self._weight,
            ActionKind.SEND_F: self._send,
            ActionKind.SEND_B: self._send,
            ActionKind.RECV_F: self._recv,
            ActionKind.RECV_B: self._recv,
        }
        self._recv_actions = [a for a in self.actions if a.kind in (ActionKind.RECV_F, ActionKind.RECV_B)]
        # Back-to-back sends go as one batch (one launch on NCCL): they are issued together and nothing
        # waits on one of them alone. Receives are never batched: a batched receive completes when its
        # whole batch has, and the window's receives are consumed one at a time, in between sends that
        # the peer needs first (1F1B would deadlock).
        is_send = [a.kind in _SENDS for a in self.actions] + [False]
        self._send_run_starts = [is_send[i] and is_send[i + 1] and (i == 0 or not is_send[i - 1])
                                 for i in range(len(self.actions))]
        self._send_run_ends = [is_send[i] and not is_send[i + 1] and i > 0 and is_send[i - 1]
                               for i in range(len(self.actions))]
        self.failed_action: Optional[Action] = None
        self.skips: Optional[SkipRoutes] = None
        self._skip_stages: frozenset[int] = frozenset()  # this rank's stages that stash or pop across stages
        self.set_skips(skips)
        self._step = 0  # the step being run: part of every message's tag (protocol/identity.py)
        #: communication plans, when the channel needs layouts (DistChannel); None in process
        self.plans: Optional[PlanCache] = PlanCache(max_plans) if getattr(channel, "needs_layouts", False) else None
        self._messages: Any = None  # this step's channel: StepMessages over a DistChannel, else the channel

    def set_skips(self, skips: Optional[SkipRoutes]) -> None:
        """Use these skip routes from the next step on (None or empty: no skips)."""
        if skips is not None and skips.num_stages != self.num_stages:
            raise ValueError(f"skip routes are for {skips.num_stages} stages, the schedule has {self.num_stages}")
        self.skips = skips if skips else None
        check_tag_space(self.num_stages, self.schedule.n_microbatches, skips=self.skips is not None)
        if self.skips is not None:
            self.expect_skips({s for s in self.runners if self.skips.sources(s) or self.skips.destinations(s)})

    def expect_skips(self, stages: Any) -> None:
        """These stages declare skips whose routes the step's start settles (``run(start=callable)``).

        Their F, B and I then open the step (settle its start) before running,
        so the routes are known when the first skip moves.
        """
        self._skip_stages = frozenset(stages) | self._skip_stages

    # -- helpers -------------------------------------------------------------------------------
    def _peer(self, action: Union[Action, _SkipMessage]) -> int:
        if isinstance(action, _SkipMessage):  # the other end of the skip, seen from this rank
            src, dst = self._rank_of[action.src], self._rank_of[action.dst]
            return dst if self.rank == src else src
        if action.kind in (ActionKind.SEND_F, ActionKind.RECV_B):
            return self._rank_of[action.stage + 1]
        return self._rank_of[action.stage - 1]

    def _what(self, action: Union[Action, _SkipMessage]) -> str:
        if isinstance(action, _SkipMessage):
            what = (f"the skips of stage {action.src} for stage {action.dst}" if not action.gradient
                    else f"the gradient of stage {action.src}'s skips from stage {action.dst}")
            return (f"rank {self.rank} waiting on {what}, microbatch {action.microbatch}, with peer rank "
                    f"{self._peer(action)} in step {self._step}")
        return (
            f"rank {self.rank} waiting on {action.kind.value} of stage {action.stage} microbatch "
            f"{action.microbatch} with peer rank {self._peer(action)} in step {self._step}"
        )

    def _tag(self, action: Action) -> int:
        return message_tag(action, self.num_stages, self._step)

    def _local(self, stage: int) -> bool:
        return 0 <= stage < self.num_stages and self._rank_of[stage] == self.rank

    # -- step ----------------------------------------------------------------------------------
    def run(self, inputs: StepInputs, start: Union[StepStart, Callable[[], StepStart]] = StepStart()) -> None:
        """Execute this rank's actions for one step; raise on the first failure.

        ``start`` (or what calling it returns, right before the step's first
        message) is the same on every rank: the step number is part of every
        message's tag, the signature picks the communication plan.
        """
        st = _StepState(pending=deque(self._recv_actions))
        self._messages = None
        self._start_of_step = start
        clock = time.perf_counter
        self.failed_action = None
        sends = contextlib.ExitStack()  # an open batch of back-to-back sends
        try:
            for i, action in enumerate(self.actions):
                if self._messages is None and action.kind in _MESSAGES:
                    self._open_and_post(st)
                begin = clock()
                try:
                    if self._send_run_starts[i]:
                        sends.enter_context(self._batch())
                    self._dispatch[action.kind](action, st, inputs)
                    if self._send_run_ends[i]:
                        sends.close()
                except BaseException as exc:
                    sends.close()
                    self._fail(action, exc)
                    raise
                if action.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
                    self._post(st)
                self._reap(st, block=False)
                if self.on_action is not None:
                    self.on_action(action, begin, clock())
            if self._messages is None:  # a rank without messages still takes part in the agreement
                self._open(start)
            self._reap(st, block=True)
        except BaseException:
            if isinstance(self._messages, StepMessages):
                self.plans.abandon(self._messages)
            self._messages = None
            raise
        if isinstance(self._messages, StepMessages):
            self.plans.commit(self._messages)
        self._messages = None
        leftovers = [k for d in (st.inputs, st.grads, st.to_send, st.skips) for k in d]
        if leftovers:
            raise RuntimeError(f"rank {self.rank}: step ended with unconsumed data for {leftovers[:4]}")

    def _open(self, start: Union[StepStart, Callable[[], StepStart]]) -> None:
        """Settle the step's start (its agreement, when a callable) and open its messages."""
        agreed = start() if callable(start) else start
        self._step = agreed.step
        if self.plans is None:
            self._messages = self.channel
        else:
            self.channel.begin_step(agreed.step)
            self._messages = self.plans.step(self.channel, agreed.signature, agreed.rediscover)

    def _open_and_post(self, st: _StepState) -> None:
        self._open(self._start_of_step)
        self._post(st)

    def _fail(self, action: Action, exc: BaseException) -> None:
        """Remember where the step failed and say it in the exception (its type is kept)."""
        self.failed_action = action
        note = f"pipeline_ext: raised on rank {self.rank} in {action.kind.value} of stage {action.stage}, microbatch {action.microbatch}"
        if hasattr(exc, "add_note") and note not in getattr(exc, "__notes__", ()):
            exc.add_note(note)

    def _post(self, st: _StepState) -> None:
        pending = st.pending
        while pending and len(st.posted) < self.recv_window:
            a = pending.popleft()
            st.posted[a] = self._start(a, lambda: self._messages.recv(self._peer(a), self._tag(a)))

    def _batch(self) -> ContextManager[None]:
        """The step channel's batch (``StepMessages.batch``), or nothing for channels without batches."""
        batch = getattr(self._messages, "batch", None)
        return batch() if batch is not None else contextlib.nullcontext()

    def _start(self, a: Union[Action, _SkipMessage], post: Callable[[], Handle]) -> Handle:
        """Post a send or receive; a failure to even start it says which and with whom."""
        try:
            return post()
        except (TimeoutError, PeerError):
            raise
        except RuntimeError as exc:
            what = self._what(a).replace("waiting on", "starting")
            raise PeerError(f"{what}: {exc}") from exc

    def _reap(self, st: _StepState, block: bool) -> None:
        while st.sends and (block or st.sends[0][1].is_completed()):
            action, handle = st.sends.popleft()
            handle.wait(self.timeout, self._what(action).replace("waiting on", "finishing"))

    # -- actions -------------------------------------------------------------------------------
    def _forward(self, a: Action, st: _StepState, inputs: StepInputs) -> None:
        runner = self.runners[a.stage]
        m = a.microbatch
        if a.stage == 0:
            args, kwargs = inputs.args[m], (inputs.kwargs[m] if inputs.kwargs else {})
        else:
            args, kwargs = self._take(st.inputs, (a.stage, m), a), {}
        target = weight = None
        if runner.is_last and inputs.targets:
            target, weight = inputs.targets[m], inputs.loss_weights[m]
        skipping = self._has_skips(a.stage, st)
        extra = {"skips": self._skips_in(a.stage, m, st, gradient=False)} if skipping else {}
        outs = runner.forward(m, args, kwargs, target=target, loss_weight=1.0 if weight is None else weight, **extra)
        if skipping:
            self._skips_out(a.stage, m, st, runner.take_stashed(m), gradient=False)
        if runner.is_last:
            return
        if self._local(a.stage + 1):
            st.inputs[(a.stage + 1, m)] = outs
        else:
            st.to_send[Action(a.stage, ActionKind.SEND_F, m)] = list(outs)

    def _backward(self, a: Action, st: _StepState, inputs: StepInputs) -> None:
        runner = self.runners[a.stage]
        m = a.microbatch
        grads = None if runner.is_last else self._take(st.grads, (a.stage, m), a)
        fn = runner.backward if a.kind == ActionKind.B else runner.backward_input
        skipping = self._has_skips(a.stage, st)
        extra = {"skip_grads": self._skips_in(a.stage, m, st, gradient=True)} if skipping else {}
        grad_in = fn(m, grads, **extra)
        if skipping:
            self._skips_out(a.stage, m, st, runner.take_skip_grads(m), gradient=True)
        if a.stage == 0:
            return
        if self._local(a.stage - 1):
            st.grads[(a.stage - 1, m)] = grad_in
        else:
            st.to_send[Action(a.stage, ActionKind.SEND_B, m)] = grad_in

    def _weight(self, a: Action, st: _StepState, inputs: StepInputs) -> None:
        self.runners[a.stage].backward_weight(a.microbatch)

    def _send(self, a: Action, st: _StepState, inputs: StepInputs) -> None:
        tensors = self._take(st.to_send, a, a)
        # An activation is whatever the user's module returned (it may write it again: a reused output
        # buffer), so it is copied; an input gradient is autograd's, sent as it is.
        owned = a.kind == ActionKind.SEND_B
        st.sends.append((a, self._start(a, lambda: self._messages.send(tensors, self._peer(a), self._tag(a), owned))))

    def _recv(self, a: Action, st: _StepState, inputs: StepInputs) -> None:
        handle = st.posted.pop(a, None)
        if handle is None:
            raise RuntimeError(f"rank {self.rank}: {a} was never posted (receives out of order in the schedule?)")
        tensors = handle.wait(self.timeout, self._what(a))
        key = (a.stage, a.microbatch)
        if a.kind == ActionKind.RECV_F:
            st.inputs[key] = tuple(tensors)
        else:
            st.grads[key] = list(tensors)

    # -- skips ---------------------------------------------------------------------------------
    def _has_skips(self, stage: int, st: _StepState) -> bool:
        """Whether ``stage`` moves skips this step; its routes may need the step's start, so it is settled first."""
        if stage not in self._skip_stages:
            return False
        if self._messages is None:
            self._open_and_post(st)
        skips = self.skips
        return skips is not None and bool(skips.sources(stage) or skips.destinations(stage))

    def _skips_in(self, stage: int, m: int, st: _StepState, gradient: bool) -> dict[SkipKey, Optional[torch.Tensor]]:
        """Before F: the skips popped on ``stage``; before B/I: the gradients of those it stashed (step opened)."""
        assert self.skips is not None
        peers = self.skips.destinations(stage) if gradient else self.skips.sources(stage)
        values: dict[SkipKey, Optional[torch.Tensor]] = {}
        for peer, keys in peers.items():
            msg = _SkipMessage(stage, peer, m, True) if gradient else _SkipMessage(peer, stage, m, False)
            if self._local(peer):
                values.update(self._take(st.skips, msg, msg))
                continue
            tag = skip_tag(msg.src, msg.dst, m, gradient, self.num_stages, self._step)
            tensors = self._start(msg, lambda: self._messages.recv(self._peer(msg), tag)).wait(self.timeout, self._what(msg))
            values.update(zip(keys, tensors) if gradient else unpack_skips(keys, tensors))
        return values

    def _skips_out(self, stage: int, m: int, st: _StepState, values: dict[SkipKey, Optional[torch.Tensor]],
                   gradient: bool) -> None:
        """After F: send the skips ``stage`` stashed; after B/I: the gradients of those it popped."""
        assert self.skips is not None
        peers = self.skips.sources(stage) if gradient else self.skips.destinations(stage)
        for peer, keys in peers.items():
            msg = _SkipMessage(peer, stage, m, True) if gradient else _SkipMessage(stage, peer, m, False)
            if self._local(peer):
                st.skips[msg] = {k: values.get(k) for k in keys}
                continue
            tensors = pack_skip_grads(keys, values) if gradient else pack_skips(keys, values)
            tag = skip_tag(msg.src, msg.dst, m, gradient, self.num_stages, self._step)
            st.sends.append((msg, self._start(msg, lambda: self._messages.send(tensors, self._peer(msg), tag, gradient))))

    def _take(self, d: dict, key: Any, a: Any) -> Any:
        try:
            return d.pop(key)
        except KeyError:
            raise RuntimeError(
                f"rank {self.rank}: {a} needs data that no earlier action produced "
                "(is the schedule lowered and validated?)"
            ) from None

