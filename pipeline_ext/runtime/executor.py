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
- SEND_*: start an asynchronous send; completed sends are reaped as the step
  goes, so sent activations are freed once on the wire.
- RECV_*: receives are posted ahead of time (a bounded window, in list order,
  which keeps FIFO order per peer) and waited on here, right before use.

Nothing moves before the step is agreed: ``run`` may be given the step's start
(step number, signature) as a callable, called right before the first send or
receive, so a step agreement between processes runs while the leading compute
does. Over a ``DistChannel`` the executor owns the communication plans
(``runtime/protocol/plan.py``): one cache per executor, so a training and a
forward-only executor never share one.

Every wait has a timeout and reports rank, peer, action and microbatch.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional, Protocol, Sequence, Union

import torch

from pipeline_ext.runtime.protocol.identity import check_tag_space, message_tag
from pipeline_ext.runtime.protocol.plan import DEFAULT_MAX_PLANS, PlanCache, StepMessages
from pipeline_ext.schedules import Action, ActionKind, Schedule

__all__ = ["Channel", "Handle", "Runner", "Executor", "StepInputs", "StepStart", "PeerError", "PipelineTimeoutError"]

_MESSAGES = (ActionKind.SEND_F, ActionKind.SEND_B, ActionKind.RECV_F, ActionKind.RECV_B)


class PipelineTimeoutError(TimeoutError):
    """A wait for a peer ran past the configured timeout."""


class PeerError(RuntimeError):
    """Starting a send or receive failed (typically: the peer is gone); names rank, peer, action."""


class Handle(Protocol):
    """An operation in flight. ``wait`` blocks (GIL released) up to ``timeout`` seconds."""

    def wait(self, timeout: float, what: str) -> list[torch.Tensor]: ...

    def is_completed(self) -> bool: ...


class Runner(Protocol):
    """What the executor asks of one stage: F, B, I and W on microbatches.

    ``StageRunner`` is the one implementation; ``ConnectedRunner`` (Pipe's
    autograd-connected forward) and ``GuardedRunner`` (Pipe's cancellable
    steps) wrap it and are typed peers of it through this protocol.
    """

    @property
    def is_last(self) -> bool: ...

    def forward(self, mb: int, args: Sequence[Any], kwargs: Optional[dict[str, Any]] = None, target: Any = None,
                loss_weight: float = 1.0) -> tuple[torch.Tensor, ...]: ...

    def backward(self, mb: int, grad_outputs: Optional[Sequence[Optional[torch.Tensor]]] = None) -> list[torch.Tensor]: ...

    def backward_input(self, mb: int,
                       grad_outputs: Optional[Sequence[Optional[torch.Tensor]]] = None) -> list[torch.Tensor]: ...

    def backward_weight(self, mb: int) -> None: ...


class Channel(Protocol):
    """Moves lists of tensors between ranks, matched by (peer, tag)."""

    def send(self, tensors: Sequence[torch.Tensor], peer: int, tag: int) -> Handle: ...

    def recv(self, peer: int, tag: int) -> Handle: ...


@dataclass
class StepInputs:
    """What one step feeds the executor (only the ranks that need each part get it)."""

    args: Sequence[tuple[Any, ...]] = ()  # per microbatch, for stage 0
    kwargs: Sequence[dict[str, Any]] = ()  # per microbatch, for stage 0
    targets: Sequence[Any] = ()  # per microbatch, for the last stage
    loss_weights: Sequence[float] = ()  # per microbatch, for the last stage


@dataclass(frozen=True)
class StepStart:
    """What every rank agreed on about a step, needed before its first message."""

    step: int = 0  # part of every message's tag (protocol/identity.py)
    signature: Optional[Hashable] = None  # the communication plan's key; None: every message carries its layout
    rediscover: bool = False  # exchange every layout again, whatever this rank's plan cache holds


@dataclass
class _StepState:
    inputs: dict[tuple[int, int], tuple[Any, ...]] = field(default_factory=dict)
    grads: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    to_send: dict[Action, list[torch.Tensor]] = field(default_factory=dict)
    posted: dict[Action, Handle] = field(default_factory=dict)
    sends: deque = field(default_factory=deque)  # (action, handle) in issue order


class Executor:
    """Runs ``schedule.actions[rank]`` with the given stage runners and channel.

    ``recv_window`` bounds how many receives are posted ahead (memory for their
    buffers vs. overlap). ``on_action(action, start, end)`` is called after each
    action when set (tracing). ``max_plans`` bounds the communication plans kept
    (over a channel that needs layouts).
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
        self.failed_action: Optional[Action] = None
        check_tag_space(self.num_stages, schedule.n_microbatches)
        self._step = 0  # the step being run: part of every message's tag (protocol/identity.py)
        #: communication plans, when the channel needs layouts (DistChannel); None in process
        self.plans: Optional[PlanCache] = PlanCache(max_plans) if getattr(channel, "needs_layouts", False) else None
        self._messages: Any = None  # this step's channel: StepMessages over a DistChannel, else the channel

    # -- helpers -------------------------------------------------------------------------------
    def _peer(self, action: Action) -> int:
        if action.kind in (ActionKind.SEND_F, ActionKind.RECV_B):
            return self._rank_of[action.stage + 1]
        return self._rank_of[action.stage - 1]

    def _what(self, action: Action) -> str:
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
        st = _StepState()
        pending = deque(self._recv_actions)
        self._messages = None
        clock = time.perf_counter
        self.failed_action = None
        try:
            for action in self.actions:
                if self._messages is None and action.kind in _MESSAGES:
                    self._open(start)
                    self._post(st, pending)
                begin = clock()
                try:
                    self._dispatch[action.kind](action, st, inputs)
                except BaseException as exc:
                    self._fail(action, exc)
                    raise
                if action.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
                    self._post(st, pending)
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
        leftovers = [k for d in (st.inputs, st.grads, st.to_send) for k in d]
        if leftovers:
            raise RuntimeError(f"rank {self.rank}: step ended with unconsumed data for {leftovers[:4]}")

    def _open(self, start: Union[StepStart, Callable[[], StepStart]]) -> None:
        """Settle the step's start (its agreement, when a callable) and open its messages."""
        agreed = start() if callable(start) else start
        self._step = agreed.step
        if self.plans is None:
            self._messages = self.channel
        else:
            self._messages = self.plans.step(self.channel, agreed.signature, agreed.rediscover)

    def _fail(self, action: Action, exc: BaseException) -> None:
        """Remember where the step failed and say it in the exception (its type is kept)."""
        self.failed_action = action
        note = f"pipeline_ext: raised on rank {self.rank} in {action.kind.value} of stage {action.stage}, microbatch {action.microbatch}"
        if hasattr(exc, "add_note") and note not in getattr(exc, "__notes__", ()):
            exc.add_note(note)

    def _post(self, st: _StepState, pending: deque) -> None:
        while pending and len(st.posted) < self.recv_window:
            a = pending.popleft()
            st.posted[a] = self._start(a, lambda: self._messages.recv(self._peer(a), self._tag(a)))

    def _start(self, a: Action, post: Callable[[], Handle]) -> Handle:
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
        outs = runner.forward(m, args, kwargs, target=target, loss_weight=1.0 if weight is None else weight)
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
        grad_in = fn(m, grads)
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
        st.sends.append((a, self._start(a, lambda: self._messages.send(tensors, self._peer(a), self._tag(a)))))

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

    def _take(self, d: dict, key: Any, a: Action) -> Any:
        try:
            return d.pop(key)
        except KeyError:
            raise RuntimeError(
                f"rank {self.rank}: {a} needs data that no earlier action produced "
                "(is the schedule lowered and validated?)"
            ) from None

