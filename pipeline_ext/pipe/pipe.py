"""Pipe: pipeline parallelism in one process, one worker thread per device.

torch removed its single-process ``Pipe`` and torchgpipe is unmaintained, but
people with one machine and several GPUs still want ``model = Pipe(model)`` and
an ordinary training loop. ``Pipe`` cuts an ``nn.Sequential`` into stages,
places them on devices, and runs the same lowered schedules through the same
``Executor`` as the multi-process API, over in-process channels:

- ``pipe.step(x, target=y, loss_fn=fn)``: forward and backward under any
  schedule (zero-bubble ones included); gradients accumulate in ``.grad`` as
  the gradient of the mean loss over the whole batch; returns that mean loss.
- ``out = pipe(x)``: fill-drain forward whose output is autograd-connected, so
  any loss and ``loss.backward()`` flow back through every stage.

torchgpipe's conventions hold by default: each layer gets the previous layer's
output as ONE argument (a tuple stays a tuple, within and between stages), the
pipe is Sequential-like (``len``, iteration, indexing) and its state-dict keys
are torchgpipe's (``partitions.1.2.weight``: a layer keeps its index in the
user's Sequential). ``unpack_tuples=True`` spreads a tuple into positional
arguments instead, the convention of the multi-process API. Forwards run in
torchgpipe's clock cycles (microbatch i on stage j in cycle i + j, after the
whole previous cycle) wherever the schedule's order allows it: ``pipe(x)``
and GPipe's ``step()``; within a cycle in partition order when the call is
seeded (``pipe/lockstep.py``).

A call is all-or-nothing: any failure (a stage error, Ctrl-C, the step's
``timeout``) cancels every worker at its next action and the step's partial
gradients are discarded (``pipe/threads.py``).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from contextlib import ExitStack
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
import torch.utils._pytree as pytree
from torch import nn

from pipeline_ext import schedules as S
from pipeline_ext.pipe.batchnorm import DeferredStats
from pipeline_ext.pipe.call import Call, CallerContext, stage_call
from pipeline_ext.pipe.lockstep import Lockstep, LockstepRunner
from pipeline_ext.pipe.placement import (Device, Partition, build_schedule, check_chunks, check_shared_layers,
                                         fit_balance, refuse_sequence_pieces, resolve_devices)
from pipeline_ext.pipe.recompute import CallRng, RngHeldBackward, checkpoint_predicate, uses_randomness
from pipeline_ext.runtime.microbatch import (given_microbatches, given_targets, loss_weights, merge_chunks,
                                             split_step_inputs, split_step_target)
from pipeline_ext.runtime.channel import check_timeout
from pipeline_ext.runtime.local import LocalHub, LocalStep
from pipeline_ext.pipe.connected import ConnectedRunner
from pipeline_ext.runtime.executor import Executor, StepInputs
from pipeline_ext.runtime.tags import check_tag_space
from pipeline_ext.runtime.stage import StageRunner, split_report
from pipeline_ext.pipe.threads import Activity, CancelToken, GuardedRunner, StepOutcome, run_step_threads
from pipeline_ext.runtime.skips import SkipRoutes
from pipeline_ext.skip import verify_skippables


__all__ = ["Pipe", "PipeBusyError"]


class PipeBusyError(RuntimeError):
    """The Pipe is already running a call (on another thread), or a cancelled call's worker is still running."""


class Pipe(nn.Module):
    """Single-process pipeline over ``devices`` (one worker thread each).

    Args:
        module: the model, an ``nn.Sequential`` (its layers are moved to their
            stages' devices and shared, not copied: an optimizer over
            ``module.parameters()`` or ``pipe.parameters()`` trains the same
            weights). A layer may appear several times (``Sequential(b, b)``)
            when its uses are on one device.
        balance: layers per stage; ``None`` balances by parameter count. The
            number of stages is ``len(balance)``. With a one-stage-per-device
            schedule, extra devices are ignored (torchgpipe) and fewer devices
            than stages is an ``IndexError``; multi-stage schedules (interleaved,
            V) take ``len(balance)`` a multiple of the devices.
        devices: one per rank; ``None`` means every visible GPU, else the CPU.
        chunks: microbatches per step (a smaller batch gets one row per microbatch).
        schedule: a built-in name (``pipeline_ext.schedules.available()``) or a
            ``Schedule`` (then ``chunks`` must equal its ``n_microbatches``).
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"`` (training mode only).
        deterministic: seed randomness per (call, stage, microbatch) so random
            numbers do not depend on thread timing. ``None``: on whenever a
            microbatch recomputes (required for exact recomputation, whatever
            draws the numbers) or the model has dropout. ``False`` is refused
            with checkpointing. A model whose own ``torch.utils.checkpoint``
            wraps randomness that is no dropout layer (``torch.rand``,
            ``F.dropout``) needs ``True`` with ``checkpoint="never"``: its
            recomputation replays the generator state it stashed, exact only
            when no other stage draws in between.
        timeout: seconds a whole ``step()`` or ``pipe(x)`` may take; then it is
            cancelled and raises ``ChannelTimeout`` (within ``timeout``:
            its last 20 %, at most 5 s, let the workers stop). A positive,
            finite number, or None for no limit.
        deferred_batch_norm: update BatchNorm running statistics once per
            call from the whole batch, not once per microbatch.
        unpack_tuples: spread a tuple returned by a layer into the next layer's
            positional arguments (the multi-process API's convention) instead
            of passing it as one argument (torchgpipe's).
        seq_chunks, seq_dim, seq_split: the schedules' sequence pieces
            (Seq1F1B), which the Pipe does not run: taken only so that
            ``seq_chunks > 1`` is a ``ValueError`` naming what does run them,
            not Python's "unexpected keyword argument" (``seq_chunks=1``, no
            pieces, is accepted and the other two are then ignored, as the
            schedules ignore them). A ``Schedule`` built over pieces
            (``build_pieces``) is refused the same way.
    """

    def __init__(
        self,
        module: nn.Sequential,
        balance: Optional[Sequence[int]] = None,
        devices: Optional[Sequence[Device]] = None,
        chunks: int = 1,
        schedule: Union[str, S.Schedule] = "gpipe",
        checkpoint: str = "except_last",
        deterministic: Optional[bool] = None,
        timeout: Optional[float] = 300.0,
        deferred_batch_norm: bool = False,
        unpack_tuples: bool = False,
        *,
        seq_chunks: int = 1,
        seq_dim: int = 1,
        seq_split: Union[str, float] = "equal",
    ) -> None:
        super().__init__()
        refuse_sequence_pieces(seq_chunks, schedule)
        if not isinstance(module, nn.Sequential):
            raise TypeError(f"Pipe needs an nn.Sequential, got {type(module).__name__}")
        self.chunks = check_chunks(chunks)
        checkpoint = str(checkpoint)
        checkpoint_predicate(checkpoint, self.chunks)  # validates the mode
        if deterministic is False and checkpoint != "never":
            raise ValueError(
                "deterministic=False with checkpointing: recomputation must redraw the forward's random numbers, "
                "which needs seeded generators; use checkpoint='never' to turn seeding off"
            )
        self.checkpoint = checkpoint
        self.timeout = check_timeout(timeout, "no limit")
        self.unpack_tuples = unpack_tuples
        self._deterministic = deterministic
        verify_skippables(module)  # every stash has its pop (torchgpipe checks this here too)
        layers = list(module._modules.items())  # every entry, a repeated module too (children() lists it once)
        devices_ = resolve_devices(devices)
        if not layers:
            if balance is not None and list(balance) not in ([], [0]):
                raise ValueError(f"balance {list(balance)} for an empty Sequential must be []")
            self._init_empty()
            return
        balance, devices_ = fit_balance(module, layers, balance, devices_, schedule)
        self.devices = devices_
        schedule_obj = build_schedule(schedule, len(devices_), self.chunks, balance)
        n = schedule_obj.num_stages
        if len(balance) != n or any(b < 1 for b in balance) or sum(balance) != len(layers):
            raise ValueError(
                f"balance {balance} must have {n} positive entries (stages of schedule {schedule_obj.name!r}) "
                f"summing to the module's {len(layers)} layers"
            )
        self.balance = balance
        self.stage_devices = [devices_[r] for r in schedule_obj.stage_to_rank]
        check_shared_layers(layers, balance, self.stage_devices)
        bounds = [sum(balance[:i]) for i in range(n + 1)]
        self.partitions = nn.ModuleList(
            Partition(OrderedDict(layers[bounds[i] : bounds[i + 1]]), unpack_tuples) for i in range(n)
        )
        for part, dev in zip(self.partitions, self.stage_devices):
            nn.Module.to(part, dev)
        #: which stage sends which skip connection to which (pipeline_ext.skip)
        self.skip_routes = SkipRoutes.of_modules(list(self.partitions))
        self._schedule_name = schedule if isinstance(schedule, str) else None
        self._v = n // len(devices_)
        self.schedule = S.lower(schedule_obj)
        S.validate(self.schedule)
        self._schedules: dict[int, tuple[S.Schedule, S.Schedule]] = {
            self.chunks: (self.schedule, S.forward_only(self.schedule))
        }
        self._has_dropout = uses_randomness(module)
        self._bn = DeferredStats(list(self.partitions)) if deferred_batch_norm else None
        self._busy = threading.Lock()
        self._abandoned: list[tuple[threading.Thread, Activity]] = []
        self._abandoned_backward = False
        #: per stage, the most microbatches whose activations were held at once in the last step()
        self.peak_live_microbatches: list[int] = []
        #: per stage whose I ran in the last step(): None where the I/W split held, else why it fell back
        #: to a whole backward at I (``runtime/split/obstacles.py``)
        self.split_report: dict[int, Optional[str]] = {}

    def _init_empty(self) -> None:
        """An empty Sequential is the identity (torchgpipe allows it)."""
        self.balance, self.devices, self.stage_devices = [], [], []
        self.partitions = nn.ModuleList()
        self.skip_routes = SkipRoutes([])
        self._bn = None
        self._busy = threading.Lock()
        self._abandoned = []
        self._abandoned_backward = False
        self.peak_live_microbatches = []
        self.split_report = {}

    def _schedules_for(self, m: int, why: str) -> tuple[S.Schedule, S.Schedule]:
        """Training and forward-only schedules for ``m`` microbatches (``why`` it is not ``chunks``)."""
        if m not in self._schedules:
            if self._schedule_name is None:
                raise ValueError(f"{why}, and a hand-written schedule is for exactly {self.chunks} microbatches")
            try:
                lowered = S.lower(S.build(self._schedule_name, len(self.devices), m, stages_per_rank=self._v))
            except S.ScheduleError as exc:
                raise ValueError(f"{why}: {exc}") from exc
            S.validate(lowered)
            self._schedules[m] = (lowered, S.forward_only(lowered))
        return self._schedules[m]

    # -- Sequential-like (torchgpipe) -----------------------------------------------------------
    def __len__(self) -> int:
        return sum(len(p) for p in self.partitions)

    def __iter__(self) -> Iterator[nn.Module]:
        for part in self.partitions:
            yield from part._modules.values()

    def __getitem__(self, index: int) -> nn.Module:
        layers = list(self)
        if not isinstance(index, int):
            raise TypeError(f"Pipe indices must be integers, got {type(index).__name__}")
        if not -len(layers) <= index < len(layers):
            raise IndexError(f"layer index {index} is out of range for a Pipe of {len(layers)} layers")
        return layers[index]

    # -- device placement belongs to the pipe ---------------------------------------------------
    _MOVE = (
        "Pipe places each stage on its own device; moving the whole pipe to one device would undo that. "
        "Choose devices with Pipe(..., devices=[...]); .to(dtype) is allowed."
    )

    def to(self, *args: Any, **kwargs: Any) -> "Pipe":  # type: ignore[override]
        try:
            device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        except RuntimeError as exc:  # a device torch cannot even name here (cuda:0 on a CPU-only machine)
            raise TypeError(f"{self._MOVE} ({exc})") from exc
        if device is not None:
            raise TypeError(self._MOVE)
        return super().to(*args, **kwargs)

    def cuda(self, device: Any = None) -> "Pipe":  # type: ignore[override]
        raise TypeError(self._MOVE)

    def cpu(self) -> "Pipe":  # type: ignore[override]
        raise TypeError(self._MOVE)

    # -- running --------------------------------------------------------------------------------
    def _new_call(self, m: int) -> Call:
        """A call over ``m`` microbatches: recomputation in training mode only (torchgpipe), seeds when needed."""
        recomputes = self.training and torch.is_grad_enabled() and self.checkpoint != "never"
        det = self._deterministic
        seeded = det is True or (det is None and (recomputes or self._has_dropout))
        return Call(CallRng.draw(seeded), checkpoint_predicate(self.checkpoint, m) if recomputes else None)

    def _call_for(self, stage: int, call: Call, alias_inputs: bool) -> Callable[[int, nn.Module, Sequence[Any], dict[str, Any]], Any]:
        """How stage ``stage`` runs its module on a microbatch within ``call``."""
        return stage_call(call, stage, self.stage_devices[stage], self.unpack_tuples, alias_inputs)

    def _split(self, args: tuple, kwargs: dict) -> tuple[list, list, list[int], str]:
        """The batch cut into ``chunks`` microbatches (fewer when it has fewer rows), and what to call their number."""
        m = min(self.chunks, max(_batch_rows(args, kwargs, self.chunks), 1))  # torchgpipe: a smaller batch is allowed
        return (*split_step_inputs(args, kwargs, m, self.stage_devices[0]),
                f"the batch has {m} rows, fewer than chunks={self.chunks}")

    def _enter(self) -> None:
        """One call at a time; never while a cancelled call's worker still runs."""
        alive = [(t, a) for t, a in self._abandoned if t.is_alive()]
        if alive:
            raise PipeBusyError(
                "a worker of an earlier, cancelled call is still running ("
                + "; ".join(a.describe(time.monotonic()) for _, a in alive)
                + "): it stops before its next action; this Pipe can be used once it has returned"
            )
        self._abandoned = []
        if self._abandoned_backward:
            self._abandoned_backward = False
            self._discard_grads()
            raise PipeBusyError(
                "a worker abandoned inside a backward of an earlier, cancelled call returned afterwards and may have "
                "written partial gradients: every parameter's .grad was reset to None; call again"
            )
        if not self._busy.acquire(blocking=False):
            raise PipeBusyError(
                "this Pipe is already running a step() or forward on another thread; one Pipe runs one call at a "
                "time (use a lock, or one Pipe per thread over separate modules)"
            )

    def _discard_grads(self) -> None:
        for p in self.parameters():
            p.grad = None

    def _on_failure(self, outcome: StepOutcome) -> Optional[str]:
        if self._bn is not None:
            self._bn.discard()
        self._abandoned = list(outcome.abandoned)
        if any(a.ran_backward and a.current is not None and a.current[0] != "F" for _, a in outcome.abandoned):
            self._abandoned_backward = True
        if outcome.ran_backward:
            self._discard_grads()
            return (
                "pipeline_ext: the step was cancelled after some backward work ran; its partial gradients were "
                "discarded: every parameter's .grad is None (what earlier steps had accumulated too)"
            )
        return None

    def _run(self, schedule: S.Schedule, runners: dict[int, Any], inputs: StepInputs,
             loss_weights: Sequence[Union[float, torch.Tensor]] = (), seeded: bool = False) -> None:
        """Every rank's executor on its worker thread; the first failure cancels all of them and is raised.

        ``seeded``: the call's forwards hold the RNG lock, so its clock runs them in partition order
        ([Note: partition order within a cycle] in ``lockstep.py``).
        """
        # The step's deadline bounds everything and names every stuck rank; its last `grace` seconds
        # let the workers stop. The channel waits' own timeouts are a backstop behind it.
        grace = 5.0 if self.timeout is None else min(0.2 * self.timeout, 5.0)
        wait_timeout = None if self.timeout is None else self.timeout + 1.0
        if self.skip_routes:
            check_tag_space(schedule.num_stages, schedule.n_microbatches, skips=True)
        hub = LocalHub(self.devices, send_timeout=wait_timeout, num_stages=schedule.num_stages)
        context = CallerContext.capture()
        token = CancelToken()
        activities = [Activity(r) for r in range(len(self.devices))]
        clock = Lockstep.of(schedule, serial=seeded)  # torchgpipe's clock cycles, where the schedule allows them

        def runner(s: int, r: int) -> Any:
            guarded = GuardedRunner(runners[s], token, activities[r])
            # a forward waiting for its cycle is not in an action yet (the activity says "waiting")
            return guarded if clock is None else LockstepRunner(guarded, clock)

        executors = [
            Executor(schedule, r, {s: runner(s, r) for s in schedule.stages_of(r)}, timeout=wait_timeout)
            for r in range(len(self.devices))
        ]

        def job(rank: int) -> Callable[[], None]:
            def work() -> None:
                with ExitStack() as stack:
                    context.enter(stack)
                    executors[rank].run(inputs, LocalStep(hub.channel(rank), self.skip_routes, loss_weights))

            return work

        def cancel(reason: str) -> None:
            hub.close(f"step cancelled: {reason}")
            if clock is not None:
                clock.close(reason)

        run_step_threads(
            [job(r) for r in range(len(self.devices))],
            activities,
            token,
            self.timeout,
            on_cancel=cancel,
            on_failure=self._on_failure,
            grace=grace,
        )

    def step(self, *args: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor], **kwargs: Any) -> torch.Tensor:
        """Forward and backward of one batch under the pipe's schedule; returns the mean loss.

        Gradients accumulate into the parameters' ``.grad`` (call
        ``zero_grad`` between steps as usual). A failed step leaves no partial
        gradients: it raises, and when some backward work had run, every
        parameter's ``.grad`` is None. Keyword arguments are the model's
        inputs, as in ``pipe(x, **kwargs)``: cut into microbatches with the
        positional ones and given to the first partition's first layer only
        (the multi-process API gives a rank's to each of its stages: [Note:
        keyword arguments per rank] in ``runtime/executor.py``).
        """
        if not torch.is_grad_enabled():
            raise RuntimeError("Pipe.step runs a backward; call it with autograd enabled (not under no_grad)")
        if not self.partitions:
            loss = loss_fn(args[0] if len(args) == 1 else args, target)
            if loss.requires_grad:
                loss.backward()
            return loss.detach()
        self._enter()
        try:
            return self._step(args, kwargs, target, loss_fn)
        finally:
            self._busy.release()

    def step_microbatches(self, arg_mbs: Optional[list] = None, kwarg_mbs: Optional[list] = None,
                          target_mbs: Optional[list] = None, *,
                          loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """``step`` over microbatches the caller cut, of any shapes (length-bucketed or packed sequences).

        ``arg_mbs``: one tuple of positional arguments per microbatch (a lone
        tensor stands for a 1-tuple); ``kwarg_mbs``: one dict each, or None;
        ``target_mbs``: one target each. Microbatch ``k``'s loss is weighted by
        the loss function's own ``microbatch_weights`` (``TokenMeanLoss``:
        tokens) or by its share of the rows, as in ``step``; returns the
        weighted loss. The number of microbatches is ``len(arg_mbs)``.
        """
        if not torch.is_grad_enabled():
            raise RuntimeError("Pipe.step_microbatches runs a backward; call it with autograd enabled")
        if not self.partitions:
            raise ValueError("an empty Pipe has no stages to run microbatches through; use step()")
        args_chunks, kwargs_chunks, sizes = given_microbatches(arg_mbs, kwarg_mbs, None, self.stage_devices[0])
        m = len(sizes)
        targets, target_sizes = given_targets(target_mbs, m, self.stage_devices[-1])
        differ = [k for k in range(m) if target_sizes[k] != sizes[k]]
        if differ:
            k = differ[0]
            raise ValueError(f"target_mbs[{k}] has {target_sizes[k]} rows but microbatch {k} of the inputs has "
                             f"{sizes[k]}: microbatch k of the target must have the rows of microbatch k")
        self._enter()
        try:
            return self._train(args_chunks, kwargs_chunks, sizes, targets, loss_fn,
                               f"this step has {m} microbatches, not chunks={self.chunks}")
        finally:
            self._busy.release()

    def _step(self, args: tuple, kwargs: dict, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        args_chunks, kwargs_chunks, sizes, why = self._split(args, kwargs)
        targets = split_step_target(target, len(sizes), self.stage_devices[-1], sizes)
        return self._train(args_chunks, kwargs_chunks, sizes, targets, loss_fn, why)

    def _train(self, args_chunks: list, kwargs_chunks: list, sizes: list[int], targets: list,
               loss_fn: Callable[[Any, Any], torch.Tensor], why: str) -> torch.Tensor:
        """Forward and backward of the microbatches under the schedule for their number; the weighted loss."""
        m = len(sizes)
        weights = loss_weights(loss_fn, sizes, targets)  # row shares, or the loss_fn's own (token counts)
        schedule, _ = self._schedules_for(m, why)
        call = self._new_call(m)
        n = len(self.partitions)
        runners = {
            s: StageRunner(part, s, n, call=self._call_for(s, call, s > 0), checkpoint=call.ckpt)
            for s, part in enumerate(self.partitions)
        }
        if self._bn is not None:
            self._bn.begin(self.training)
        # a backward may recompute the user's own checkpointed regions, which set the generators' states
        held = {s: RngHeldBackward(r, call.rng, self.stage_devices[s]) for s, r in runners.items()}
        self._run(schedule, held, StepInputs(args_chunks, kwargs_chunks, targets, loss_fn), weights, call.rng.seeded)
        if self._bn is not None:
            self._bn.commit()
        self.peak_live_microbatches = [runners[s].peak_live_microbatches for s in range(n)]
        self.split_report = split_report(runners)
        last = runners[n - 1]
        return sum(w * last.losses[k] for k, w in enumerate(weights))  # type: ignore[return-value]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Fill-drain forward; the output is connected to every stage's autograd graph.

        ``kwargs`` are cut into microbatches with ``args`` and go to the first
        layer of the first partition only, never to a later one (as a
        Sequential's later layers get only the previous layer's output).
        """
        if not self.partitions:
            return _identity(args, kwargs)
        self._enter()
        try:
            return self._forward(args, kwargs)
        finally:
            self._busy.release()

    def _forward(self, args: tuple, kwargs: dict) -> Any:
        _check_tensors(args, "input")
        args_chunks, kwargs_chunks, sizes, why = self._split(args, kwargs)
        m = len(sizes)
        _, schedule = self._schedules_for(m, why)
        call = self._new_call(m)
        n = len(self.partitions)
        links: dict = {}
        runners = {
            s: ConnectedRunner(part, s, n, links, call=self._call_for(s, call, False), checkpoint=call.ckpt)
            for s, part in enumerate(self.partitions)
        }
        if self._bn is not None:
            self._bn.begin(self.training)
        self._run(schedule, runners, StepInputs(args_chunks, kwargs_chunks), seeded=call.rng.seeded)
        if self._bn is not None:
            self._bn.commit()
        out = merge_chunks([runners[n - 1].outputs[k] for k in range(m)])
        _check_tensors((out,), "output")
        return out


def _batch_rows(args: tuple, kwargs: dict, unknown: int) -> int:
    """Rows of the batch, read without checking or warning; ``unknown`` where they cannot be read here.

    [Note: one look at the batch per call]
    How many microbatches a call runs depends on the batch's rows (fewer
    rows than ``chunks``: one row each), so they are needed before the split.
    Asking ``microbatch_sizes`` for them (a cut into 1 microbatch) checked the
    inputs twice and, for a keyword input with rows of its own, warned twice
    per call, once about a cut into 1 part that never runs. The batch is the
    first tensor among the positional then the keyword inputs (a Pipe always
    splits every tensor on dim 0): its rows are read here, and
    ``split_step_inputs`` alone checks the inputs and warns, with the real
    number of microbatches. A first tensor whose rows cannot be read (0-d, a
    nested tensor) is left to that check, which names it.
    """
    for leaf in pytree.tree_leaves((tuple(args), dict(kwargs))):
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() == 0:
                return unknown
            try:
                return int(leaf.shape[0])
            except RuntimeError:
                return unknown
    return unknown


def _check_tensors(values: Any, what: str) -> None:
    """What goes in and out of ``pipe(x)`` is tensors: alone, or in tuples, lists or dicts (None allowed).

    torchgpipe takes tensors and tuples only and refuses a list with a
    TypeError; a list (or dict) of tensors is split and merged like a tuple
    here, so a model written for the multi-process API runs unchanged.
    """
    for v in pytree.tree_leaves(values):
        if v is not None and not isinstance(v, torch.Tensor):
            raise TypeError(f"Pipe {what}s must be tensors, or tuples, lists or dicts of tensors; "
                            f"got a {type(v).__name__}")


def _identity(args: tuple, kwargs: dict) -> Any:
    if kwargs:
        raise TypeError("an empty Pipe takes no keyword arguments")
    _check_tensors(args, "input")
    return args[0] if len(args) == 1 else args
