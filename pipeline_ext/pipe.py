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

Within a stage, a layer that returns a tuple has the next layer called with
the tuple's items as arguments, the same convention as between stages.
"""
from __future__ import annotations

import concurrent.futures as futures
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from pipeline_ext import schedules as S
from pipeline_ext.checkpoint import RngScope, checkpoint_predicate, uses_randomness
from pipeline_ext.microbatch import (
    merge_chunks,
    microbatch_sizes,
    split_args_kwargs,
    split_target,
    to_device,
)
from pipeline_ext.partition import balance_by_params
from pipeline_ext.runtime.channels import LocalHub
from pipeline_ext.runtime.connected import ConnectedRunner
from pipeline_ext.runtime.executor import Executor, StepInputs
from pipeline_ext.runtime.stage import StageRunner
from pipeline_ext.training.loss import loss_weights

__all__ = ["Pipe", "MULTI_STAGE_SCHEDULES"]

Device = Union[str, int, torch.device]

#: built-in schedules that place two stages on every rank by default
MULTI_STAGE_SCHEDULES = frozenset({"interleaved_1f1b", "looped_bfs", "zbv", "dualpipev"})


class Partition(nn.Sequential):
    """A stage: consecutive layers; a tuple returned by one layer is unpacked into the next."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        out: Any = args
        for i, layer in enumerate(self):
            out = layer(*out, **(kwargs if i == 0 else {})) if isinstance(out, tuple) else layer(out)
        return out


@dataclass
class _Context:
    """Autograd and autocast state of the calling thread, re-entered in every worker thread."""

    grad: bool
    autocast: list[tuple[str, torch.dtype]]

    @classmethod
    def capture(cls) -> "_Context":
        types = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        return cls(
            torch.is_grad_enabled(),
            [(t, torch.get_autocast_dtype(t)) for t in types if torch.is_autocast_enabled(t)],
        )

    def enter(self, stack: ExitStack) -> None:
        stack.enter_context(torch.set_grad_enabled(self.grad))
        for device_type, dtype in self.autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype))


def _devices(devices: Optional[Sequence[Device]]) -> list[torch.device]:
    if devices is None:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [torch.device("cuda", i) for i in range(n)] or [torch.device("cpu")]
    out = [torch.device("cuda", d) if isinstance(d, int) else torch.device(d) for d in devices]
    if not out:
        raise ValueError("devices must name at least one device")
    return out


class Pipe(nn.Module):
    """Single-process pipeline over ``devices`` (one worker thread each).

    Args:
        module: the model, an ``nn.Sequential`` (its layers are moved to their
            stages' devices and shared, not copied: an optimizer over
            ``module.parameters()`` or ``pipe.parameters()`` trains the same weights).
        balance: layers per stage; ``None`` balances by parameter count. The
            number of stages is ``len(balance)``; several stages per device are
            allowed (interleaved and V schedules place 2 per device by default).
        devices: one per rank; ``None`` means every visible GPU, else the CPU.
        chunks: microbatches per step.
        schedule: a built-in name (``pipeline_ext.schedules.available()``) or a
            ``Schedule`` (then ``chunks`` must equal its ``n_microbatches``).
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        deterministic: seed randomness per (stage, microbatch) so dropout does
            not depend on thread timing (required for exact recomputation);
            ``None`` turns it on when the model has dropout.
        timeout: seconds any worker may wait for another before failing.
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
        timeout: float = 300.0,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Sequential):
            raise TypeError(f"Pipe needs an nn.Sequential, got {type(module).__name__}")
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be a positive int, got {chunks!r}")
        self.devices = _devices(devices)
        self.chunks = chunks
        self.timeout = timeout
        self._ckpt_mode = checkpoint
        self._ckpt = checkpoint_predicate(checkpoint, chunks)
        p = len(self.devices)
        schedule_obj = self._schedule(schedule, p, chunks, balance)
        n = schedule_obj.num_stages
        layers = list(module.children())
        balance = list(balance) if balance is not None else balance_by_params(module, n)
        if len(balance) != n or any(b < 1 for b in balance) or sum(balance) != len(layers):
            raise ValueError(
                f"balance {balance} must have {n} positive entries (stages of schedule {schedule_obj.name!r}) "
                f"summing to the module's {len(layers)} layers"
            )
        self.balance = balance
        bounds = [sum(balance[:i]) for i in range(n + 1)]
        self.partitions = nn.ModuleList(Partition(*layers[bounds[i] : bounds[i + 1]]) for i in range(n))
        self.stage_devices = [self.devices[r] for r in schedule_obj.stage_to_rank]
        for part, dev in zip(self.partitions, self.stage_devices):
            nn.Module.to(part, dev)
        self.schedule = S.lower(schedule_obj)
        S.validate(self.schedule)
        self._forward_schedule = S.forward_only(self.schedule)
        self._rng = RngScope(uses_randomness(module) if deterministic is None else deterministic)
        self._pool: Optional[futures.ThreadPoolExecutor] = None
        #: per stage, the most microbatches whose activations were held at once in the last step()
        self.peak_live_microbatches: list[int] = []

    @staticmethod
    def _schedule(schedule: Union[str, S.Schedule], p: int, chunks: int, balance: Optional[Sequence[int]]) -> S.Schedule:
        if isinstance(schedule, S.Schedule):
            if schedule.num_ranks != p or schedule.n_microbatches != chunks:
                raise ValueError(
                    f"schedule {schedule.name!r} is for {schedule.num_ranks} ranks and {schedule.n_microbatches} "
                    f"microbatches, but the pipe has {p} devices and chunks={chunks}"
                )
            return schedule
        if balance is not None:
            if len(balance) % p:
                raise ValueError(f"balance has {len(balance)} stages, not a multiple of the {p} devices")
            v = len(balance) // p
        else:
            v = 2 if schedule in MULTI_STAGE_SCHEDULES else 1
        return S.build(schedule, p, chunks, stages_per_rank=v)

    # -- device placement belongs to the pipe ---------------------------------------------------
    def to(self, *args: Any, **kwargs: Any) -> "Pipe":  # type: ignore[override]
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None:
            raise ValueError(
                "Pipe places each stage on its own device; moving the whole pipe to one device would undo "
                "that. Choose devices with Pipe(..., devices=[...]); .to(dtype) is allowed."
            )
        return super().to(*args, **kwargs)

    def cuda(self, device: Any = None) -> "Pipe":  # type: ignore[override]
        raise ValueError("Pipe places each stage on its own device; choose devices with Pipe(..., devices=[...])")

    def cpu(self) -> "Pipe":  # type: ignore[override]
        raise ValueError("Pipe places each stage on its own device; choose devices with Pipe(..., devices=[...])")

    # -- running --------------------------------------------------------------------------------
    def _call_for(self, stage: int) -> Callable[[int, nn.Module, Sequence[Any], dict[str, Any]], Any]:
        device = self.stage_devices[stage]

        def call(mb: int, module: nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
            with self._rng(stage, mb, device):
                return module(*args, **kwargs)

        return call

    def _split(self, args: tuple, kwargs: dict) -> tuple[list, list, list[int]]:
        sizes = microbatch_sizes(args, kwargs, self.chunks)
        args, kwargs = to_device((args, kwargs), self.stage_devices[0])
        args_chunks, kwargs_chunks = split_args_kwargs(args, kwargs, self.chunks)
        return args_chunks, kwargs_chunks, sizes

    def _run(self, schedule: S.Schedule, runners: dict[int, Any], inputs: StepInputs) -> None:
        """Every rank's executor on its worker thread; the first failure closes the hub and is raised."""
        if self._pool is None:
            self._pool = futures.ThreadPoolExecutor(max_workers=len(self.devices), thread_name_prefix="pipe-rank")
        hub = LocalHub(self.devices, send_timeout=self.timeout)
        context = _Context.capture()
        self._rng.new_step()

        executors = [
            Executor(schedule, r, {s: runners[s] for s in schedule.stages_of(r)}, hub.channel(r), timeout=self.timeout)
            for r in range(len(self.devices))
        ]

        def work(rank: int) -> None:
            with ExitStack() as stack:
                context.enter(stack)
                executors[rank].run(inputs)

        jobs = {self._pool.submit(work, r): r for r in range(len(self.devices))}
        done, _ = futures.wait(jobs, return_when=futures.FIRST_EXCEPTION)
        failed = [f for f in done if f.exception() is not None]
        if failed:
            # Wake every other worker at once with the reason instead of letting them time out.
            rank = jobs[failed[0]]
            exc = failed[0].exception()
            a = executors[rank].failed_action
            where = f" in {a.kind.value} of stage {a.stage}, microbatch {a.microbatch}" if a is not None else ""
            hub.close(f"rank {rank} failed{where}: {type(exc).__name__}: {exc}")
            futures.wait(jobs)
            raise exc  # type: ignore[misc]

    def step(self, *args: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor], **kwargs: Any) -> torch.Tensor:
        """Forward and backward of one batch under the pipe's schedule; returns the mean loss.

        Gradients accumulate into the parameters' ``.grad`` (call
        ``zero_grad`` between steps as usual).
        """
        if not torch.is_grad_enabled():
            raise RuntimeError("Pipe.step runs a backward; call it with autograd enabled (not under no_grad)")
        args_chunks, kwargs_chunks, sizes = self._split(args, kwargs)
        target = to_device(target, self.stage_devices[-1])
        target_sizes = microbatch_sizes((target,), {}, self.chunks)
        if target_sizes != sizes:
            raise ValueError(f"target splits into microbatches of {target_sizes} rows but the inputs into {sizes}")
        targets = split_target(target, self.chunks)
        weights = loss_weights(loss_fn, sizes, targets)  # row shares, or the loss_fn's own (token counts)
        n = len(self.partitions)
        runners = {
            s: StageRunner(part, s, n, loss_fn, call=self._call_for(s), checkpoint=self._ckpt)
            for s, part in enumerate(self.partitions)
        }
        self._run(self.schedule, runners, StepInputs(args_chunks, kwargs_chunks, targets, weights))
        self.peak_live_microbatches = [runners[s].peak_live_microbatches for s in range(n)]
        last = runners[n - 1]
        return sum(w * last.losses[m] for m, w in enumerate(weights))  # type: ignore[return-value]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Fill-drain forward; the output is connected to every stage's autograd graph."""
        args_chunks, kwargs_chunks, _ = self._split(args, kwargs)
        n = len(self.partitions)
        links: dict = {}
        ckpt = self._ckpt if torch.is_grad_enabled() else None
        runners = {
            s: ConnectedRunner(part, s, n, links, call=self._call_for(s), checkpoint=ckpt)
            for s, part in enumerate(self.partitions)
        }
        self._run(self._forward_schedule, runners, StepInputs(args_chunks, kwargs_chunks))
        return merge_chunks([runners[n - 1].outputs[m] for m in range(self.chunks)])

    def __del__(self) -> None:
        if getattr(self, "_pool", None) is not None:
            self._pool.shutdown(wait=False)
