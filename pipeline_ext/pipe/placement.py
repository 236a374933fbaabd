"""Where a ``Pipe``'s layers go: stages of consecutive layers, on devices, under a schedule (torchgpipe's rules).

``Pipe(module, balance, devices, chunks, schedule)``'s arguments, checked and
resolved before anything runs: the devices (``resolve_devices``: every
visible GPU by default, else the CPU), the number of microbatches
(``check_chunks``), no sequence pieces (``refuse_sequence_pieces``), the
balance and the devices it uses (``fit_balance``: extra devices ignored and
fewer an ``IndexError`` for one-stage-per-device schedules, parameter-count
balancing when none is given), the schedule for them (``build_schedule``),
and that no module or parameter is shared by stages on different devices
(``check_shared_layers``). ``Partition`` is the stage module that results:
consecutive layers under their names in the user's Sequential, passing
outputs on as torchgpipe does. The functions depend on the arguments alone;
running the pipe is ``pipe.py``'s.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

from pipeline_ext import schedules as S
from pipeline_ext.pipe.partition import balance_by_params

__all__ = ["Device", "MULTI_STAGE_SCHEDULES", "Partition", "build_schedule", "check_chunks", "check_shared_layers",
           "fit_balance", "refuse_sequence_pieces", "resolve_devices"]

Device = Union[str, int, torch.device]

#: built-in schedules that put several stages on a device by default (from the schedule registry)
MULTI_STAGE_SCHEDULES = frozenset(n for n in S.available() if S.default_stages_per_rank(n) > 1)


class Partition(nn.Sequential):
    """A stage: consecutive layers, under their names in the user's Sequential.

    The first layer gets the stage's inputs; every later one gets the previous
    layer's output as one argument (torchgpipe), or, with ``unpack_tuples``, a
    tuple spread into positional arguments.
    """

    def __init__(self, layers: "OrderedDict[str, nn.Module]", unpack_tuples: bool = False) -> None:
        super().__init__(layers)
        self.unpack_tuples = unpack_tuples

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        layers = iter(self._modules.values())
        first = next(layers, None)
        if first is None:
            return args[0] if len(args) == 1 else args
        out = first(*args, **kwargs)
        for layer in layers:
            out = layer(*out) if self.unpack_tuples and isinstance(out, tuple) else layer(out)
        return out


def resolve_devices(devices: Optional[Sequence[Device]]) -> list[torch.device]:
    """The devices asked for; ``None``: every visible GPU, else the CPU."""
    if devices is None:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [torch.device("cuda", d) for d in range(n)] or [torch.device("cpu")]
    out = [torch.device("cuda", d) if isinstance(d, int) else torch.device(d) for d in devices]
    if not out:
        raise ValueError("devices must name at least one device")
    return out


def check_chunks(chunks: Any) -> int:
    """torchgpipe accepts any integral number (``chunks=42.0``)."""
    if isinstance(chunks, bool) or not isinstance(chunks, (int, float)) or int(chunks) != chunks or chunks < 1:
        raise ValueError(f"chunks must be a positive int, got {chunks!r}")
    return int(chunks)


def check_shared_layers(layers: list[tuple[str, nn.Module]], balance: list[int], devices: list[torch.device]) -> None:
    """A module or parameter used by stages on different devices cannot work; same device is fine."""
    owner: dict[int, tuple[int, str]] = {}
    stage_of = [s for s, b in enumerate(balance) for _ in range(b)]
    for (name, layer), s in zip(layers, stage_of):
        for obj, what in [(layer, f"layer {name!r}")] + [(p, f"a parameter of layer {name!r}") for p in layer.parameters()]:
            first = owner.setdefault(id(obj), (s, name))
            if devices[first[0]] != devices[s]:
                raise ValueError(
                    f"{what} is also used by layer {first[1]!r}, which is on stage {first[0]} ({devices[first[0]]}), "
                    f"but this stage {s} is on {devices[s]}: a module or parameter shared by stages on different "
                    "devices cannot live on both; put those stages on one device (or untie the weights)"
                )


def fit_balance(
    module: nn.Sequential,
    layers: list,
    balance: Optional[Sequence[int]],
    devices: list[torch.device],
    schedule: Union[str, S.Schedule],
) -> tuple[list[int], list[torch.device]]:
    """Balance and the devices it uses: torchgpipe's rules for one-stage-per-device schedules."""
    one_per_device = isinstance(schedule, str) and schedule not in MULTI_STAGE_SCHEDULES
    if balance is None:
        n = len(devices) * (1 if one_per_device or not isinstance(schedule, str) else 2)
        if isinstance(schedule, S.Schedule):
            n = schedule.num_stages
        if n > len(layers) and one_per_device:
            devices, n = devices[: len(layers)], len(layers)
        return balance_by_params(module, n), devices
    balance = [int(b) for b in balance]
    if any(b < 1 for b in balance) or sum(balance) != len(layers):
        raise ValueError(f"balance {balance} must be positive layer counts summing to the module's {len(layers)} layers")
    if one_per_device:
        if len(balance) > len(devices):
            raise IndexError(
                f"balance has {len(balance)} stages but only {len(devices)} devices were given "
                f"(schedule {schedule!r} places one stage per device)"
            )
        devices = devices[: len(balance)]  # extra devices are ignored, as in torchgpipe
    return balance, devices


def refuse_sequence_pieces(seq_chunks: Any, schedule: Union[str, S.Schedule]) -> None:
    """``ValueError`` for sequence pieces (Seq1F1B): ``seq_chunks`` other than 1, or a ``Schedule`` that
    over pieces (``Schedule.pieces``, as ``build_pieces`` makes them).

    The Pipe cuts a batch into microbatches along its rows only and carries no
    keys and values between pieces, so a schedule over pieces would run each
    piece as one more microbatch of rows: a wrong step, not a slow one. The
    error names what does run pieces.
    """
    where = ("they run over processes: PipelineStage with Schedule1F1B, ScheduleZBH1 or ScheduleInterleaved1F1B "
             "and seq_chunks=K (docs/training.md, 'Long context: sequence pieces (Seq1F1B)')")
    if seq_chunks != 1:
        raise ValueError(f"the Pipe does not run sequence pieces (seq_chunks={seq_chunks!r}); {where}")
    pieces = schedule.pieces if isinstance(schedule, S.Schedule) else 1
    if pieces > 1:
        raise ValueError(f"schedule {schedule.name!r} is built over sequence pieces (seq_chunks={pieces}), which the "
                         f"Pipe does not run; {where}")


def build_schedule(schedule: Union[str, S.Schedule], p: int, chunks: int, balance: Sequence[int]) -> S.Schedule:
    """The schedule for ``p`` devices, ``chunks`` microbatches and ``len(balance)`` stages (a given one, checked)."""
    if isinstance(schedule, S.Schedule):
        if schedule.num_ranks != p or schedule.n_microbatches != chunks:
            raise ValueError(
                f"schedule {schedule.name!r} is for {schedule.num_ranks} ranks and {schedule.n_microbatches} "
                f"microbatches, but the pipe has {p} devices and chunks={chunks}"
            )
        return schedule
    if len(balance) % p:
        raise ValueError(f"balance has {len(balance)} stages, not a multiple of the {p} devices")
    return S.build(schedule, p, chunks, stages_per_rank=len(balance) // p)
