"""The executor: walks one rank's lowered action list for one step.

There is one executor for every schedule, built-in or hand-written, and for
both modes: a single process runs one executor per rank on worker threads with
in-process channels; ``torchrun`` runs one per process over torch.distributed.
Only the channel differs.

What it does per action (stage s, microbatch m):

- F: run the stage on its input (the step's microbatch on stage 0, a received
  or locally handed-over activation otherwise) and, where the step says so, the
  rank's keyword arguments ([Note: keyword arguments per rank]); keep the output
  for SEND_F or hand it to stage s+1 directly when that stage lives on this rank.
- B / I: backward with the gradient of the output (received, handed over, or
  the loss on the last stage); keep the input gradient for SEND_B or hand it to
  stage s-1 on this rank. W: the deferred weight-grad half.
- SEND_*: start an asynchronous send (back-to-back sends as one batch: the
  step's ``batch()``, one launch on NCCL); completed sends are reaped as the step goes, so
  sent activations are freed once on the wire.
- RECV_*: receives are posted ahead of time (a bounded window, in list order,
  which keeps FIFO order per peer) and waited on here, right before use.

Everything one step needs is handed to ``run``: the inputs (``StepInputs``)
and the step's messages (a ``StepContext``: ``runtime/local.LocalStep`` in one
process, ``comm/session.Step`` across processes). The executor only computes
and hands messages to that object; when they may move (the ranks' agreement),
which layouts they have and where skips go are the step object's business.
The executor opens the step (``step.open()``, which returns the ``Messages``
every send and receive of the step goes through) at one point of its run,
``_open_due``: right before the first action that needs it (a message, or an
F/B/I of a stage that moves skips, whose routes the opening settles), or after
the last action on a rank that has neither; the compute before it runs while
the step settles (across processes: the ranks' agreement travels during rank
0's first forward). Receives are posted ahead from the first message action on.

Skip connections (``pipeline_ext.skip``): for the stages the step says move
skips (``step.skip_stages``, routes from ``step.skip_routes()``), a stage's
F also sends the skips it stashed straight to the popping stage's rank (or
hands them over locally), and the popping stage's F receives them first; the
gradients go back the same way around B/I. These messages are not actions of
the schedule: they ride on F, B and I, whose order already guarantees that a
skip is sent before it is waited for (``runtime/skips.py``, which also
names a skip message, ``SkipMessage``, and packs it).

[Note: custom functions change when, not what]
Custom functions (torch's ``register_custom_function``): ``run`` may be handed,
per compute kind (or ``OVERLAP_F_B`` for an overlapped pair of
``Schedule.overlapped``), a plain callable to call instead of running those
actions. It gets the action(s) and a ``GroupRun`` (``runtime/group_run.py``)
that runs each through the handler above, once; all must have run when it
returns. Only when compute runs changes: receives were waited on before
(for a pair, both actions' receives) and sends go after (both actions'), so
the messages are those of the plain run. The overlap runner is the one
exception it allows (a ``PairRunner``, ``group_run.py``): its halves run their
own messages, see ``_custom``.
The callable is built by the schedule (pipelining/), which keeps torch's
objects there.

Every wait has a timeout and reports rank, peer, action and microbatch.
"""
from __future__ import annotations

import contextlib
import functools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, Union

import torch

from pipeline_ext.runtime.channel import Handle, Messages, StepContext
from pipeline_ext.runtime.tags import check_tag_space, message_tag, skip_tag, step_bits
from pipeline_ext.schedules import Action, ActionKind, Schedule
from pipeline_ext.schedules.ir import FSDP_KINDS, OVERLAP_F_B
from pipeline_ext.runtime.group_run import CustomFunction, GroupRun, PairRunner
from pipeline_ext.runtime.skips import SkipMessage, pack_skip_grads, pack_skips, unpack_skips
from pipeline_ext.runtime.stage import LossFn, StageError
from pipeline_ext.schedules.simulate import peak_live_activations
from pipeline_ext.skip.tracker import SkipKey

__all__ = ["Runner", "Executor", "StepInputs", "PeerError", "RaisedAt", "raised_at"]

_MESSAGES = (ActionKind.SEND_F, ActionKind.SEND_B, ActionKind.RECV_F, ActionKind.RECV_B)
_SENDS = (ActionKind.SEND_F, ActionKind.SEND_B)



class PeerError(RuntimeError):
    """Starting a send or receive failed (typically: the peer is gone); names rank, peer, action."""


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
                loss_weight: float = 1.0, skips: Optional[SkipValues] = None,
                loss_fn: Optional[LossFn] = None) -> tuple[torch.Tensor, ...]: ...

    def backward(self, mb: int, grad_outputs: Optional[Sequence[Optional[torch.Tensor]]] = None,
                 skip_grads: Optional[SkipValues] = None) -> list[torch.Tensor]: ...

    def backward_input(self, mb: int, grad_outputs: Optional[Sequence[Optional[torch.Tensor]]] = None,
                       skip_grads: Optional[SkipValues] = None) -> list[torch.Tensor]: ...

    def backward_weight(self, mb: int) -> None: ...

    def take_stashed(self, mb: int) -> dict[SkipKey, Optional[torch.Tensor]]: ...

    def take_skip_grads(self, mb: int) -> dict[SkipKey, Optional[torch.Tensor]]: ...

    # UNSHARD / RESHARD / REDUCE_GRAD: only a schedule with a parameter plan has them; ``replace``: called instead
    # of the gather, free or reduction itself (a registered custom function)
    def unshard(self, replace: Optional[Callable[[], None]] = None) -> None: ...

    def reshard(self, replace: Optional[Callable[[], None]] = None) -> None: ...

    def reduce_grads(self, replace: Optional[Callable[[], None]] = None) -> None: ...

    def end_step(self) -> None: ...


@dataclass
class StepInputs:
    """What one step feeds the executor (only the ranks that need each part get it).

    [Note: keyword arguments per rank]
    ``kwargs`` (one dict per microbatch) go to stage 0's forward, and with
    ``kwargs_every_stage`` to every stage this executor runs, beside the
    activation it received. The two front ends differ here on purpose, each
    as the library it stands in for: torch's pipelining hands each rank's own
    keyword arguments (cut on that rank) to every stage of that rank
    (``forward_one_chunk(mb, arg_mbs[mb], kwarg_mbs[mb])`` on every stage), so
    a middle or last stage that takes ``mask=`` gets the mask its rank was
    given, and on a rank of several stages (interleaved, V) each of them does:
    ``comm/session.py`` sets the flag on every rank. A ``Pipe`` is one call on
    one batch (torchgpipe's ``GPipe(x)``): its keyword arguments are the first
    partition's inputs, like its positional ones, and never reach a later one
    (the flag stays off). Without the flag a later stage given the rank's
    mask would not be an error: it would run without it, silently.
    """

    args: Sequence[tuple[Any, ...]] = ()  # per microbatch, for stage 0
    kwargs: Sequence[dict[str, Any]] = ()  # per microbatch, for stage 0 (every stage with kwargs_every_stage)
    targets: Sequence[Any] = ()  # per microbatch, for the last stage
    loss_fn: Optional[LossFn] = None  # this step's loss, for the last stage (the runner's own when None)
    kwargs_every_stage: bool = False  # ``kwargs`` go to every stage on this rank, not stage 0 alone


@dataclass(frozen=True)
class RaisedAt:
    """Where an executor saw an exception raised: its rank and the action that ran.

    Travels on the exception itself (``raised_at``), so the step that failed
    reads it as data; the user reads the same in a note on the exception.
    """

    rank: int
    action: Action

    def __str__(self) -> str:
        a = self.action
        return f"in {a.kind.value} of stage {a.stage}, microbatch {a.microbatch}"


_RAISED_AT = "_pipeline_ext_raised_at"


def raised_at(exc: BaseException) -> Optional[RaisedAt]:
    """Where an executor said ``exc`` was raised; None when it was raised outside the step's actions."""
    return getattr(exc, _RAISED_AT, None)


@dataclass
class _StepState:
    """One step's state inside ``Executor.run``: what it was handed, and what is in flight."""

    inputs: StepInputs
    step: StepContext
    messages: Optional[Messages] = None  # what ``step.open()`` returned: every send and receive goes through it
    opens_at: int = 0  # the position of the action the step is opened before (``Executor._opening``)
    posting: bool = False  # receives are posted (from the step's first message action on)
    activations: dict[tuple[int, int], tuple[Any, ...]] = field(default_factory=dict)
    grads: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    to_send: dict[Action, list[torch.Tensor]] = field(default_factory=dict)
    posted: dict[Action, Handle] = field(default_factory=dict)
    sends: deque = field(default_factory=deque)  # (action or skip message, handle) in issue order
    skips: dict[SkipMessage, SkipValues] = field(default_factory=dict)  # handed over on this rank
    pending: deque = field(default_factory=deque)  # receives not posted yet
    step_bits: int = 0  # the step's part of every tag (``tags.step_bits``)
    in_step: str = ""  # how a wait's description ends: " in step N"


class Executor:
    """Runs ``schedule.actions[rank]`` with the given stage runners, one step per ``run``.

    ``recv_window`` bounds how many receives are posted ahead (memory for their
    buffers vs. overlap). The executor keeps nothing between steps: a step's
    state lives in ``run``.
    """

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        runners: dict[int, Runner],
        timeout: Optional[float] = 300.0,
        recv_window: int = 4,
    ) -> None:
        if not schedule.lowered and schedule.num_ranks > 1:
            raise ValueError("Executor needs a lowered schedule (see pipeline_ext.schedules.lower)")
        self.schedule = schedule
        self.rank = rank
        self.actions: list[Action] = list(schedule.actions[rank])
        self.runners = runners
        self.timeout = timeout
        self.recv_window = max(1, recv_window)
        self.num_stages = schedule.num_stages
        check_tag_space(self.num_stages, schedule.n_microbatches)
        self._rank_of = schedule.stage_to_rank
        mine = {s for s, r in enumerate(self._rank_of) if r == rank}
        if set(runners) != mine:
            raise ValueError(
                f"rank {rank} holds stages {sorted(mine)} in schedule {schedule.name!r} "
                f"but was given stages {sorted(runners)}"
            )
        # read once: the loop below runs per action, and its host time is what a small microbatch pays
        self._is_last = {s: r.is_last for s, r in runners.items()}
        self._counted = [r for r in runners.values() if hasattr(r, "live_microbatches")]
        # per message action: its peer, its tag without the step's bits, and what a wait on it says
        messages = [a for a in self.actions if a.kind in _MESSAGES]
        self._peers = {a: self._peer(a) for a in messages}
        self._tags = {a: message_tag(a, self.num_stages) for a in messages}
        self._waits = {a: self._about(a) for a in messages}
        self._finishes = {a: w.replace("waiting on", "finishing") for a, w in self._waits.items()}
        self._dispatch = {
            ActionKind.F: self._forward,
            ActionKind.B: self._backward,
            ActionKind.I: self._backward,
            ActionKind.W: self._weight,
            ActionKind.SEND_F: self._send,
            ActionKind.SEND_B: self._send,
            ActionKind.RECV_F: self._recv,
            ActionKind.RECV_B: self._recv,
            ActionKind.UNSHARD: self._params,
            ActionKind.RESHARD: self._params,
            ActionKind.REDUCE_GRAD: self._params,
        }
        self._recv_actions = [a for a in self.actions if a.kind in (ActionKind.RECV_F, ActionKind.RECV_B)]
        #: the stages whose parameters the plan places: their step ends with the runner's ``end_step`` (REDUCE_GRAD's
        #: reductions waited; after a forward-only step, FSDP's settings the plan changed put back)
        self._placed = sorted({a.stage for a in self.actions if a.is_fsdp})
        self._first_message = next((i for i, a in enumerate(self.actions) if a.kind in _MESSAGES), len(self.actions))
        # [Note: receives are never batched]
        # Back-to-back sends go as one batch (one launch on NCCL): they are issued together and nothing
        # waits on one of them alone. Receives are never batched: a batched receive completes when its
        # whole batch has, and the window's receives are consumed one at a time, in between sends that
        # the peer needs first (1F1B would deadlock).
        is_send = [a.kind in _SENDS for a in self.actions] + [False]
        self._send_run_starts = [is_send[i] and is_send[i + 1] and (i == 0 or not is_send[i - 1])
                                 for i in range(len(self.actions))]
        self._send_run_ends = [is_send[i] and not is_send[i + 1] and i > 0 and is_send[i - 1]
                               for i in range(len(self.actions))]
        #: the most microbatches' activations this rank may hold at once: what the simulator counts on the
        #: schedule (an F adds one, a B or W drops one); ``_forward`` holds the runners to it
        pos = {a: i for i, a in enumerate(self.actions)}
        #: overlapped pairs on this rank: lowered position of the first -> position of the second; only messages lie
        #: between, the first's sends and receives due before the second ([Note: an overlapped pair lowers as two
        #: actions] in schedules/lowering.py)
        self._pair_end = {pos[x]: pos[y] for x, y in schedule.overlapped if x in pos and y in pos}
        #: per pair (by the first's position): the receives and the sends lowered between its two actions
        self._pair_between = {i: (tuple(a for a in self.actions[i + 1:j] if a.kind not in _SENDS),
                                  tuple(a for a in self.actions[i + 1:j] if a.kind in _SENDS))
                              for i, j in self._pair_end.items()}
        # a function registered for a pair may run its F first: the promise counts the pair so
        forward_first = list(self.actions)
        for i, j in self._pair_end.items():
            if forward_first[j].kind == ActionKind.F:
                forward_first[i], forward_first[j] = forward_first[j], forward_first[i]
        self.promised_peak = peak_live_activations(forward_first)
        #: where the last step failed (None when it did not)

    # -- helpers -------------------------------------------------------------------------------
    def _peer(self, action: Union[Action, SkipMessage]) -> int:
        if isinstance(action, SkipMessage):  # the other end of the skip, seen from this rank
            src, dst = self._rank_of[action.src], self._rank_of[action.dst]
            return dst if self.rank == src else src
        if action.kind in (ActionKind.SEND_F, ActionKind.RECV_B):
            return self._rank_of[action.stage + 1]
        return self._rank_of[action.stage - 1]

    def _what(self, action: Union[Action, SkipMessage], step: int) -> str:
        return f"{self._about(action)} in step {step}"

    def _about(self, action: Union[Action, SkipMessage]) -> str:
        if isinstance(action, SkipMessage):
            what = (f"the skips of stage {action.src} for stage {action.dst}" if not action.gradient
                    else f"the gradient of stage {action.src}'s skips from stage {action.dst}")
            return (f"rank {self.rank} waiting on {what}, microbatch {action.microbatch}, with peer rank "
                    f"{self._peer(action)}")
        return (
            f"rank {self.rank} waiting on {action.kind.value} of stage {action.stage} microbatch "
            f"{action.microbatch} with peer rank {self._peer(action)}"
        )

    def _local(self, stage: int) -> bool:
        return 0 <= stage < self.num_stages and self._rank_of[stage] == self.rank

    # -- step ----------------------------------------------------------------------------------
    def run(self, inputs: StepInputs, step: StepContext,
            on_action: Optional[Callable[[Action, float, float], None]] = None,
            custom: Optional[Mapping[Any, CustomFunction]] = None) -> None:
        """Execute this rank's actions for one step over ``step``'s messages; raise on the first failure.

        ``on_action(action, start, end)`` is called after each action when
        given (tracing). ``custom``: per compute kind (``ActionKind.F`` ...,
        or ``OVERLAP_F_B`` for an overlapped pair) a function called instead
        of running those actions: ``fn(actions, run)`` with the action (or
        the pair) and a ``GroupRun`` that runs each of them, once, when the
        function says (see ``GroupRun``).
        """
        st = _StepState(inputs=inputs, step=step, pending=deque(self._recv_actions), step_bits=step_bits(step.number),
                        in_step=f" in step {step.number}", opens_at=self._opening(step.skip_stages))
        clock = time.perf_counter
        sends = contextlib.ExitStack()  # an open batch of back-to-back sends
        custom = custom or {}
        skip_to = -1  # the second action of a pair that ran with its first
        for i, action in enumerate(self.actions):
            if i <= skip_to:
                continue
            group: tuple[Action, ...] = (action,)
            fn = custom.get(action.kind) if custom else None
            between: tuple[tuple[Action, ...], tuple[Action, ...]] = ((), ())
            if i in self._pair_end and OVERLAP_F_B in custom:
                skip_to = self._pair_end[i]
                group, fn = (action, self.actions[skip_to]), custom[OVERLAP_F_B]
                between = self._pair_between[i]
            self._open_due(st, skip_to if len(group) > 1 else i)
            if not st.posting and action.kind in _MESSAGES:
                self._start_posting(st)
            begin = clock() if on_action is not None else 0.0
            spans: dict[Action, tuple[float, float]] = {}
            try:
                if self._send_run_starts[i]:
                    sends.enter_context(st.messages.batch())
                if fn is not None and action.kind in FSDP_KINDS:
                    self._params(action, st, replace=functools.partial(fn, group, None))
                elif fn is not None:
                    spans = self._custom(fn, group, st, *between)
                elif action.kind in _MESSAGES:
                    self._message(action, st)
                else:
                    self._dispatch[action.kind](action, st)
                if self._send_run_ends[i]:
                    sends.close()
            except BaseException as exc:
                sends.close()
                self._fail(action, exc)
                raise
            if st.sends:
                self._reap(st, block=False)
            if on_action is not None:
                end = clock()
                for a in group + between[0] + between[1]:  # each action with its own span (a pair's overlap)
                    on_action(a, *spans.get(a, (begin, end)))
        self._reap(st, block=True)
        for stage in self._placed:  # once the step's work is issued
            self.runners[stage].end_step()
        leftovers = [k for d in (st.activations, st.grads, st.to_send, st.skips) for k in d]
        if leftovers:
            raise RuntimeError(f"rank {self.rank}: step ended with unconsumed data for {leftovers[:4]}")
        self._open_due(st, len(self.actions))  # a rank without messages still takes part in the agreement

    def _opening(self, skip_stages: frozenset) -> int:
        """Where a step opens: its first message action or, before it, the first F/B/I of a stage that moves skips
        (their routes are settled by the opening); ``len(actions)`` (after the last) when the rank has neither."""
        at = self._first_message
        if skip_stages:
            at = next((i for i, a in enumerate(self.actions[:at])
                       if a.kind in (ActionKind.F, ActionKind.B, ActionKind.I) and a.stage in skip_stages), at)
        return at

    @staticmethod
    def _open_due(st: _StepState, upto: int) -> None:
        """Open the step once the run reaches ``st.opens_at`` (``upto``: the last position about to run).

        [Note: a step opens in one place]
        This is the one place a step is opened (``step.open()``: across
        processes the ranks' agreement, the transport's connection, skip
        routes and layouts settle there): not a send, a skip, a question
        (``skip_routes``) or the step's exit, so its errors come before any
        message of the step, and settling never hides inside another call.
        """
        if st.messages is None and upto >= st.opens_at:
            st.messages = st.step.open()

    def _start_posting(self, st: _StepState) -> None:
        """From the step's first message on, receives are posted ahead."""
        st.posting = True
        self._post(st)

    def _message(self, action: Action, st: _StepState) -> None:
        """Run one SEND or RECV action (posting receives ahead from the step's first message on)."""
        if not st.posting:
            self._start_posting(st)
        self._dispatch[action.kind](action, st)
        if action.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
            self._post(st)

    def _custom(self, fn: "CustomFunction", group: tuple[Action, ...], st: _StepState,
                recvs: tuple[Action, ...] = (), sends: tuple[Action, ...] = ()) -> dict[Action, tuple[float, float]]:
        """Hand ``group`` to a registered function; each of its actions must have run when it returns.

        ``recvs``, ``sends``: the messages the lowering put between a pair's two actions (receives due before the
        second, the first's sends). A ``PairRunner`` (the overlap runner) has ``GroupRun`` run them
        with the pair's actions: the first's sends right after it, the receives right before the second, so a
        pair whose halves never hand over runs as the two actions one after the other. Any other function runs
        the pair as one unit, as torch's runtime does: those receives are waited on before it, those sends go
        after it. Returns each action's measured (start, end), for the trace.
        """
        if isinstance(fn, PairRunner):
            run = GroupRun(self, group, st, before={group[-1]: recvs}, after={group[0]: sends})
            recvs = sends = ()
        else:
            run = GroupRun(self, group, st)
        for a in recvs:
            run.message(a)
        try:
            fn(group, run)
        finally:
            run.closed = True
        for a in sends:
            run.message(a)
        missing = [str(a) for a in group if a not in run.done]
        if missing:
            raise StageError(f"rank {self.rank}: the function registered for {' '.join(map(str, group))} returned "
                             f"without running {', '.join(missing)} (each action it is handed must run once)")
        return run.spans

    def _fail(self, action: Action, exc: BaseException) -> None:
        """Put where the step failed on the exception, as data and in a note for the user (its type is kept)."""
        where = RaisedAt(self.rank, action)
        setattr(exc, _RAISED_AT, where)
        note = f"pipeline_ext: raised on rank {self.rank} {where}"
        if hasattr(exc, "add_note") and note not in getattr(exc, "__notes__", ()):
            exc.add_note(note)

    def _post(self, st: _StepState) -> None:
        pending, messages = st.pending, st.messages
        while pending and len(st.posted) < self.recv_window:
            a = pending.popleft()
            peer, tag = self._peers[a], st.step_bits | self._tags[a]
            try:
                st.posted[a] = messages.recv(peer, tag)
            except RuntimeError as exc:
                raise self._start_failed(a, st, exc)

    def _start(self, a: Union[Action, SkipMessage], st: _StepState, post: Callable[[], Handle]) -> Handle:
        """Post a send or receive; a failure to even start it says which and with whom."""
        try:
            return post()
        except RuntimeError as exc:
            raise self._start_failed(a, st, exc)

    def _start_failed(self, a: Union[Action, SkipMessage], st: _StepState, exc: RuntimeError) -> BaseException:
        """What to raise when starting ``a`` raised ``exc``: a timeout or peer error as it is, else a ``PeerError``
        saying which message and with whom (the cause chained)."""
        if isinstance(exc, (TimeoutError, PeerError)):
            return exc
        what = self._what(a, st.step.number).replace("waiting on", "starting")
        err = PeerError(f"{what}: {exc}")
        err.__cause__ = exc
        return err

    def _reap(self, st: _StepState, block: bool) -> None:
        while st.sends and (block or st.sends[0][1].is_completed()):
            action, handle = st.sends.popleft()
            what = self._finishes.get(action)  # a skip message has no entry
            if what is None:
                what = self._about(action).replace("waiting on", "finishing")
            handle.wait(self.timeout, what + st.in_step)

    # -- actions -------------------------------------------------------------------------------
    def _forward(self, a: Action, st: _StepState) -> Any:
        runner, inputs = self.runners[a.stage], st.inputs
        m = a.microbatch
        args = inputs.args[m] if a.stage == 0 else self._take(st.activations, (a.stage, m), a)
        # [Note: keyword arguments per rank]
        kwargs = inputs.kwargs[m] if inputs.kwargs and (a.stage == 0 or inputs.kwargs_every_stage) else {}
        extra: dict[str, Any] = {}
        last = self._is_last[a.stage]
        if last and inputs.targets:
            extra = dict(target=inputs.targets[m], loss_weight=st.step.loss_weights()[m], loss_fn=inputs.loss_fn)
        routes = self._routes(a.stage, st) if a.stage in st.step.skip_stages else None
        if routes is not None:
            extra["skips"] = self._skips_in(a.stage, m, st, routes, gradient=False)
        outs = runner.forward(m, args, kwargs, **extra)
        self._check_peak(a)
        if routes is not None:
            self._skips_out(a.stage, m, st, routes, runner.take_stashed(m), gradient=False)
        if last:
            return getattr(runner, "outputs", {}).get(m)
        if self._local(a.stage + 1):
            st.activations[(a.stage + 1, m)] = outs
        else:
            st.to_send[Action(a.stage, ActionKind.SEND_F, m)] = list(outs)
        return outs

    def _check_peak(self, a: Action) -> None:
        """The schedule's memory promise, kept: never more microbatches held than the simulator counted.

        [Note: the memory promise]

        Choosing a schedule for its memory (``schedules.select``) relies on
        it; a runner that kept a microbatch past its backward would break it
        silently, step after step, until the device ran out of memory.
        """
        live = 0
        for r in self._counted:
            live += r.live_microbatches
        if live > self.promised_peak:
            raise StageError(
                f"rank {self.rank} holds the activations of {live} microbatches after the F of stage {a.stage}, "
                f"microbatch {a.microbatch}, more than the "
                f"{self.promised_peak} schedule {self.schedule.name!r} promises (its simulated peak): a stage "
                "kept a microbatch past its backward"
            )

    def _backward(self, a: Action, st: _StepState) -> Any:
        runner = self.runners[a.stage]
        m = a.microbatch
        grads = None if self._is_last[a.stage] else self._take(st.grads, (a.stage, m), a)
        fn = runner.backward if a.kind == ActionKind.B else runner.backward_input
        routes = self._routes(a.stage, st) if a.stage in st.step.skip_stages else None
        extra = {} if routes is None else {"skip_grads": self._skips_in(a.stage, m, st, routes, gradient=True)}
        grad_in = fn(m, grads, **extra)
        if routes is not None:
            self._skips_out(a.stage, m, st, routes, runner.take_skip_grads(m), gradient=True)
        if a.stage == 0:
            return grad_in
        if self._local(a.stage - 1):
            st.grads[(a.stage - 1, m)] = grad_in
        else:
            st.to_send[Action(a.stage, ActionKind.SEND_B, m)] = grad_in
        return grad_in

    def _weight(self, a: Action, st: _StepState) -> None:
        self.runners[a.stage].backward_weight(a.microbatch)

    def _params(self, a: Action, st: _StepState, replace: Optional[Callable[[], None]] = None) -> None:
        """UNSHARD / RESHARD / REDUCE_GRAD ([Note: parameters placed by the schedule] in runtime/stage.py).

        ``replace``: a function registered for the kind (torch's
        ``register_custom_function``), called instead of the library's gather,
        free or reduction, as torch calls it instead of its own; the runner's
        bookkeeping (the step's plan, the check that every backward came
        before REDUCE_GRAD) runs either way.
        """
        runner = self.runners[a.stage]
        {ActionKind.UNSHARD: runner.unshard, ActionKind.RESHARD: runner.reshard,
         ActionKind.REDUCE_GRAD: runner.reduce_grads}[a.kind](replace)

    def _send(self, a: Action, st: _StepState) -> None:
        tensors = self._take(st.to_send, a, a)
        # An activation is whatever the user's module returned (it may write it again: a reused output
        # buffer), so it is copied; an input gradient is autograd's, sent as it is.
        owned = a.kind == ActionKind.SEND_B
        try:
            handle = st.messages.send(tensors, self._peers[a], st.step_bits | self._tags[a], owned)
        except RuntimeError as exc:
            raise self._start_failed(a, st, exc)
        st.sends.append((a, handle))

    def _recv(self, a: Action, st: _StepState) -> None:
        handle = st.posted.pop(a, None)
        if handle is None:
            raise RuntimeError(f"rank {self.rank}: {a} was never posted (receives out of order in the schedule?)")
        tensors = handle.wait(self.timeout, self._waits[a] + st.in_step)
        key = (a.stage, a.microbatch)
        if a.kind == ActionKind.RECV_F:
            st.activations[key] = tuple(tensors)
        else:
            st.grads[key] = list(tensors)

    # -- skips ---------------------------------------------------------------------------------
    def _routes(self, stage: int, st: _StepState) -> Any:
        """The skip routes of ``stage``, one of the step's ``skip_stages``; None when it moves none."""
        routes = st.step.skip_routes()
        return routes if routes is not None and (routes.sources(stage) or routes.destinations(stage)) else None

    def _skips_in(self, stage: int, m: int, st: _StepState, routes: Any,
                  gradient: bool) -> dict[SkipKey, Optional[torch.Tensor]]:
        """Before F: the skips popped on ``stage``; before B/I: the gradients of those it stashed."""
        peers = routes.destinations(stage) if gradient else routes.sources(stage)
        values: dict[SkipKey, Optional[torch.Tensor]] = {}
        for peer, keys in peers.items():
            msg = SkipMessage(stage, peer, m, True) if gradient else SkipMessage(peer, stage, m, False)
            if self._local(peer):
                values.update(self._take(st.skips, msg, msg))
                continue
            tag = skip_tag(msg.src, msg.dst, m, gradient, self.num_stages, st.step.number)
            handle = self._start(msg, st, lambda: st.messages.recv(self._peer(msg), tag))
            tensors = handle.wait(self.timeout, self._what(msg, st.step.number))
            values.update(zip(keys, tensors) if gradient else unpack_skips(keys, tensors))
        return values

    def _skips_out(self, stage: int, m: int, st: _StepState, routes: Any,
                   values: dict[SkipKey, Optional[torch.Tensor]], gradient: bool) -> None:
        """After F: send the skips ``stage`` stashed; after B/I: the gradients of those it popped."""
        peers = routes.sources(stage) if gradient else routes.destinations(stage)
        for peer, keys in peers.items():
            msg = SkipMessage(peer, stage, m, True) if gradient else SkipMessage(stage, peer, m, False)
            if self._local(peer):
                st.skips[msg] = {k: values.get(k) for k in keys}
                continue
            tensors = pack_skip_grads(keys, values) if gradient else pack_skips(keys, values)
            tag = skip_tag(msg.src, msg.dst, m, gradient, self.num_stages, st.step.number)
            st.sends.append((msg, self._start(msg, st, lambda: st.messages.send(tensors, self._peer(msg), tag,
                                                                                gradient))))

    def _take(self, d: dict, key: Any, a: Any) -> Any:
        try:
            return d.pop(key)
        except KeyError:
            raise RuntimeError(
                f"rank {self.rank}: {a} needs data that no earlier action produced "
                "(is the schedule lowered and validated?)"
            ) from None
