"""Checkpoints of a pipeline with torch.distributed.checkpoint (DCP), named as the unsplit model.

Why this exists: each rank holds only its stages, and a stage module names its
parameters its own way (``layers.0.…`` on every stage), so saving each rank's
``state_dict()`` gives files nobody can load into the unsplit model, or into a
pipeline cut differently. DCP already solves sharded saving and loading
(every rank writes its part, any layout reads it back, FSDP2's DTensors and
DDP replicas included). What a pipeline adds is one thing: a map from each
stage's parameter names to the unsplit model's. With it, a pipeline's
checkpoint *is* the unsplit model's DCP checkpoint:

- keys ``"model"`` (the model's state dict, unsplit FQNs) and ``"optim"``
  (the optimizers' state, flattened as DCP's ``get_state_dict`` does with
  ``flatten_optimizer_state_dict=True``, keyed by the same FQNs), plus
  ``"extra"`` for whatever the caller adds (step counter, LR scheduler);
- the unsplit model loads it with ``load_checkpoint(path, model, optimizer)``
  or with plain DCP code, and ``torch.distributed.checkpoint.format_utils.
  dcp_to_torch_save`` turns it into one ``torch.save`` file;
- a fresh pipeline (any schedule, any stages per rank) loads it back, and
  resuming is bitwise identical to not stopping (model and optimizer state,
  and with dropout each rank's random generators: key ``"rng"``, see
  [Note: the random generators in a checkpoint]).

The map (``fqn_maps={stage_index: map}``), per stage, is one of:
``None`` (the stage already uses the unsplit names, e.g. it was made by
deleting the other layers from a copy of the whole model, as torchtitan does;
the simplest way), a ``str`` prefix (``"model."``), a ``dict`` renaming
module paths (``{"layers.0": "model.layers.4", "head": "lm_head"}``: the
longest matching path is renamed, other names are kept), or a callable
``stage_fqn -> unsplit_fqn``.
"""
from __future__ import annotations

import io
import os
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from pipeline_ext.training.stages import local_stages, unwrap

__all__ = ["FQNMap", "save_checkpoint", "load_checkpoint", "unsplit_name"]

FQNMap = Union[None, str, Mapping[str, str], Callable[[str], str]]

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_OPTIM_SECTIONS = ("state.", "param_groups.")


def unsplit_name(fqn: str, fqn_map: FQNMap) -> str:
    """The unsplit model's name for a stage's ``fqn`` under ``fqn_map`` (see the module doc)."""
    if fqn_map is None:
        return fqn
    if isinstance(fqn_map, str):
        return fqn_map + fqn if not fqn_map or fqn_map.endswith(".") else f"{fqn_map}.{fqn}"
    if isinstance(fqn_map, Mapping):
        parts = fqn.split(".")
        for cut in range(len(parts), -1, -1):  # longest module path first
            head = ".".join(parts[:cut])
            if head in fqn_map:
                rest = ".".join(parts[cut:])
                new = fqn_map[head]
                return f"{new}.{rest}" if new and rest else (new or rest)
        return fqn
    if callable(fqn_map):
        return str(fqn_map(fqn))
    raise TypeError(f"an fqn map is None, a prefix str, a dict of module paths or a callable; got {type(fqn_map)}")


class _Names:
    """Local container name <-> unsplit name, for this rank's stages (checked one-to-one)."""

    def __init__(self, modules: Mapping[int, nn.Module], fqn_maps: Mapping[int, FQNMap]) -> None:
        unknown = sorted(set(fqn_maps) - set(modules))
        if unknown:
            raise ValueError(f"fqn_maps names stages {unknown}, but this rank holds stages {sorted(modules)}")
        self.to_full: dict[str, str] = {}
        for s, module in modules.items():
            for fqn in module.state_dict():
                self.to_full[f"{s}.{fqn}"] = unsplit_name(fqn, fqn_maps.get(s))
        seen: dict[str, str] = {}
        for local, full in self.to_full.items():
            if full in seen and not _same_tensor(modules, seen[full], local):
                raise ValueError(f"fqn_maps send two different tensors to {full!r}: {seen[full]!r} and {local!r} "
                                 "(stage.name)")
            seen[full] = local
        self.to_local = {full: local for local, full in self.to_full.items()}
        self.params = set(self.to_full)

    def model(self, sd: Mapping[str, Any], forward: bool) -> dict[str, Any]:
        names = self.to_full if forward else self.to_local
        return {names[k]: v for k, v in sd.items()}

    def optim(self, sd: Mapping[str, Any], forward: bool) -> dict[str, Any]:
        """Rename flattened optimizer keys ``state.<fqn>.<key>`` / ``param_groups.<fqn>.<key>``."""
        names = self.to_full if forward else self.to_local
        out = {}
        for key, value in sd.items():
            section = next((p for p in _OPTIM_SECTIONS if key.startswith(p)), None)
            fqn, _, leaf = key[len(section):].rpartition(".") if section else ("", "", "")
            if section is None or fqn not in names:
                raise ValueError(f"unexpected optimizer state key {key!r} (flattened keys are "
                                 "state.<fqn>.<key> / param_groups.<fqn>.<key>)")
            out[f"{section}{names[fqn]}.{leaf}"] = value
        return out


def _same_tensor(modules: Mapping[int, nn.Module], a: str, b: str) -> bool:
    """Two stages' entries are one tensor (a Parameter shared by two stages on this rank)."""
    def get(name: str) -> torch.Tensor:
        s, _, fqn = name.partition(".")
        return modules[int(s)].state_dict(keep_vars=True)[fqn]
    return get(a) is get(b)


def _optimizers(optimizers: Any) -> list[torch.optim.Optimizer]:
    if optimizers is None:
        return []
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    return list(optimizers)


def _state(obj: Any, optimizers: Any, fqn_maps: Optional[Mapping[int, FQNMap]], extra: Optional[dict[str, Any]]):
    """(container of this rank's stages, its optimizers, names, the DCP state dict under the unsplit names)."""
    stages = local_stages(obj)
    modules = {s: unwrap(m) for s, m in stages.modules.items()}
    container = nn.ModuleDict({str(s): m for s, m in modules.items()})
    optims, names = _optimizers(optimizers), _Names(modules, dict(fqn_maps or {}))
    msd, osd = get_state_dict(container, optims, options=_OPTIONS)
    state: dict[str, Any] = {"model": names.model(msd, True)}
    if optims:
        state["optim"] = names.optim(osd, True)
    if extra is not None:
        state["extra"] = extra
    return container, optims, names, state


# [Note: the random generators in a checkpoint]
# A restart is bitwise only if the random numbers after it are those a run
# never stopped would have drawn: dropout masks come from the process's
# generators, and a fresh process seeds them its own way (the parameters of a
# model with dropout differed by 0.034 after 6 steps). So each process's
# generator states go into the checkpoint: torch's CPU generator (which also
# gives a ``Pipe`` each call's seeds: it has no counter of its own) and every
# CUDA generator, when this process has initialised CUDA (one that never did
# has drawn nothing from them, and reading them would initialise CUDA in a
# CPU-only rank). They are one process's state, not the model's: DCP keeps
# one value per key across ranks, so each rank saves them under a key naming
# its global rank, ``"rng": {"rank<r>": ...}``, as one opaque value (bytes of
# ``torch.save``: its shape may differ between ranks, e.g. their GPU counts),
# and ``load_checkpoint`` restores the entry of its own rank, after the
# model was built (building it draws from the generators). A checkpoint
# without that entry (written before, by plain DCP, or by fewer ranks) leaves
# the generators as they are; ``rng=False`` does too, e.g. when a pipeline's
# checkpoint starts another run. Python's ``random`` and NumPy are not saved.
_RNG = "rng"


def _rng_key() -> str:
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return f"rank{rank}"


def _rng_state() -> bytes:
    """This process's torch generators, as one value ([Note: the random generators in a checkpoint])."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    buf = io.BytesIO()
    torch.save({"cpu": torch.get_rng_state(), "cuda": cuda}, buf)
    return buf.getvalue()


def _set_rng_state(saved: bytes) -> None:
    state = torch.load(io.BytesIO(saved), weights_only=True)
    torch.set_rng_state(state["cpu"])
    for index, cuda in enumerate(state["cuda"][: torch.cuda.device_count()]):
        torch.cuda.set_rng_state(cuda, index)  # deferred until CUDA is initialised, as torch.cuda.manual_seed


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's default plan, which reads a rank's generator states only where the checkpoint has them."""

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        rngs = state_dict.get(_RNG)
        if metadata is not None and rngs is not None:  # "rng" itself stays: dcp.load writes each top key back
            for key in [k for k in rngs if f"{_RNG}.{k}" not in metadata.state_dict_metadata]:
                del rngs[key]
        super().set_up_planner(state_dict, metadata, is_coordinator)


def _dcp_kwargs(process_group: Optional[dist.ProcessGroup]) -> dict[str, Any]:
    distributed = dist.is_available() and dist.is_initialized()
    return {"process_group": process_group, "no_dist": not distributed}


def save_checkpoint(path: Union[str, os.PathLike], obj: Any, optimizers: Any = None,
                    fqn_maps: Optional[Mapping[int, FQNMap]] = None, extra: Optional[dict[str, Any]] = None,
                    process_group: Optional[dist.ProcessGroup] = None, rng: bool = True) -> None:
    """Save this rank's stages (model and optimizer state) as part of one DCP checkpoint at ``path``.

    A collective over ``process_group`` (default: every rank): every rank of
    every pipeline (and every DP replica) calls it. ``obj`` is the
    ``PipelineSchedule``, this rank's stage(s), a ``Pipe``, or the unsplit
    ``nn.Module``. ``optimizers``: one optimizer or several, over this rank's
    stages. ``rng``: also save this process's random generators (under
    ``"rng"``, one entry per rank), so that a restart draws the dropout masks
    a run never stopped would have drawn.
    """
    _, _, _, state = _state(obj, optimizers, fqn_maps, extra)
    if rng:
        state[_RNG] = {_rng_key(): _rng_state()}
    dcp.save(state, checkpoint_id=path, **_dcp_kwargs(process_group))


def load_checkpoint(path: Union[str, os.PathLike], obj: Any, optimizers: Any = None,
                    fqn_maps: Optional[Mapping[int, FQNMap]] = None, extra: Optional[dict[str, Any]] = None,
                    process_group: Optional[dist.ProcessGroup] = None, rng: bool = True) -> None:
    """Load a checkpoint written by ``save_checkpoint`` (or by DCP for the unsplit model) into ``obj``.

    ``obj`` may be cut differently from the pipeline that saved it: each rank
    reads exactly the unsplit names its stages map to. ``extra``, when given,
    is filled in place from the saved ``"extra"`` (same keys). A collective
    like ``save_checkpoint``; an unsplit ``nn.Module`` (or a ``Pipe``) in a
    process without ``torch.distributed`` loads on its own. ``rng``: restore
    this rank's random generators where the checkpoint has them (call it
    after building the model, which draws from them); False leaves them as
    they are.
    """
    container, optims, names, state = _state(obj, optimizers, fqn_maps, extra)
    if rng:
        state[_RNG] = {_rng_key(): b""}  # replaced by the saved value, or dropped where there is none
    dcp.load(state, checkpoint_id=path, planner=_LoadPlanner(), **_dcp_kwargs(process_group))
    set_state_dict(container, optims, model_state_dict=names.model(state["model"], False),
                   optim_state_dict=names.optim(state["optim"], False) if optims else {}, options=_OPTIONS)
    saved = state.get(_RNG, {}).get(_rng_key()) if rng else None
    if saved:
        _set_rng_state(saved)
