"""The composition matrix: which features meet which schedule family, generated as an all-pairs design.

Each feature was tested alone, or with the schedules its author thought of;
the bugs that reached users came from pairs nobody wrote down (DTensor
parameters under the I/W split, a communicating forward inside DualPipeV's
overlapped pair, DTensor inputs cut beside plain targets). So the cases are
generated, not listed: every pair of feature levels meets every schedule
family in at least one case (a covering array of strength two per family),
under the constraints below, which are the only combinations left out.

Pure Python (no torch): ``test_composition.py`` checks the design's coverage
without running anything, and runs the cases (``composition_case.py``).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional

#: family -> the built-in schedules that stand for it (cases alternate between them)
FAMILIES: dict[str, tuple[str, ...]] = {
    "1f1b": ("1f1b", "gpipe"),  # one stage per rank, whole backward
    "interleaved": ("interleaved_1f1b",),  # several stages per rank, whole backward
    "zero_bubble": ("zb_h1", "zb_h2"),  # one stage per rank, the I/W split
    "v": ("zbv",),  # V-shaped, two stages per rank, the I/W split
    "dualpipev": ("dualpipev",),  # V-shaped with overlapped F/B pairs (checked bitwise against overlap=False)
}

#: feature -> its levels (the first is "off")
FACTORS: dict[str, tuple] = {
    "front": ("stage", "pipe"),  # PipelineStage + Schedule* on ranks, or the single-process Pipe
    "tp": ("none", "local", "replicate", "sequence"),  # DTensor activations of each placement (see below)
    "dp": ("none", "ddp", "fsdp"),  # data parallel over a second mesh dimension
    # every block torch.compile'd: aot_eager (one opaque compiled backward node: I runs it whole) or
    # pe.split_backend (the compiled backward cut into I and W graphs)
    "compiled": ("off", "aot_eager", "split_backend"),
    "ckpt": ("none", "sac", "user", "offload"),  # selective / plain activation checkpointing, save_on_cpu hooks
    "split_fn": (False, True),  # a pe.SplitFunction layer (its own I and W halves)
    "tied": (False, True),  # the first stage's input projection tied to the last stage's output projection
    "shapes": ("fixed", "per_microbatch"),  # step(x) or step_microbatches with a sequence length per microbatch
    "kwargs": (False, True),  # a keyword tensor argument for the first stage, cut into microbatches
}
#: tp levels: "local" = TP parameters, plain tensors between stages; "replicate" = Replicate DTensor activations
#: and DTensor parameters in a non-TP module (each LayerNorm a replicated module); "sequence" = Shard(1)
#: activations (sequence parallel), LayerNorms under SequenceParallel

#: (feature, level, feature, level) that cannot exist, and why; checked on partial cases, so each is a pair
CONSTRAINTS: list[tuple[str, object, str, object, str]] = [
    ("front", "pipe", "tp", "local", "the Pipe runs in one process: no tensor-parallel mesh"),
    ("front", "pipe", "tp", "replicate", "the Pipe runs in one process: no tensor-parallel mesh"),
    ("front", "pipe", "tp", "sequence", "the Pipe runs in one process: no tensor-parallel mesh"),
    ("front", "pipe", "dp", "ddp", "the Pipe runs in one process: no data-parallel group"),
    ("front", "pipe", "dp", "fsdp", "the Pipe runs in one process: no data-parallel group"),
    ("front", "pipe", "tied", True, "tie_parameters ties stages on different ranks; in one process share the module"),
    ("dp", "ddp", "tp", "local", "DDP does not take DTensor parameters (torch composes TP with FSDP2)"),
    ("dp", "ddp", "tp", "replicate", "DDP does not take DTensor parameters (torch composes TP with FSDP2)"),
    ("dp", "ddp", "tp", "sequence", "DDP does not take DTensor parameters (torch composes TP with FSDP2)"),
    ("split_fn", True, "tp", "sequence", "a SplitFunction's plain weight would see one sequence shard per tp rank: "
     "its gradient needs a DTensor weight, which a custom Function's halves do not take"),
]


@dataclass(frozen=True)
class Design:
    """A design of its own: one feature fixed on in every case, all-pairs over the rest, so that feature meets
    every pair of the others (strength three with it) and the base design keeps its cases.

    ``fixed``: feature -> level in every case (a key outside ``FACTORS`` is a schedule argument);
    ``families``: the families that run it, with the schedules that stand for each; ``refused``: (feature,
    level, why) that cannot meet it."""

    fixed: dict
    families: dict
    refused: tuple = ()


#: what each schedule argument outside ``FACTORS`` is when a case does not set it
ARGUMENT_DEFAULTS: dict[str, object] = {"seq_chunks": 1, "max_active_stages": None}

DESIGNS: dict[str, Design] = {
    # sequence pieces (Seq1F1B). The model is position-wise, so pieces are exact by the cut, the loss weights and
    # the schedule alone, which is what meets every feature here (attention across pieces: tests/seqchunks)
    "pieces": Design(
        fixed={"seq_chunks": 2},
        families={"1f1b": ("1f1b",), "interleaved": ("interleaved_1f1b",), "zero_bubble": ("zb_h1",)},
        refused=(("front", "pipe", "the Pipe does not run sequence pieces (it refuses seq_chunks by name)"),)),
    # FSDP under a parameter budget: one stage's parameters gathered at a time on each rank, the all-gathers,
    # reshards and reduce-scatters placed as schedule actions (schedules/fsdp.py), on the schedules with several
    # stages per rank, which take a budget (ZBV: each reduce-scatter after a stage's last W). DualPipeV's
    # overlapped pairs need two stages at once, all of its rank's (a budget of 1 is refused by name)
    "budget": Design(
        fixed={"dp": "fsdp", "max_active_stages": 1},
        families={"interleaved": ("interleaved_1f1b",), "v": ("zbv",)},
        refused=(("front", "pipe", "the Pipe runs in one process: no data-parallel group"),)),
    # the two together: sequence pieces under the parameter budget, on the one schedule class that runs both
    # (the V-shaped ones refuse pieces by name)
    "pieces_budget": Design(
        fixed={"seq_chunks": 2, "dp": "fsdp", "max_active_stages": 1},
        families={"interleaved": ("interleaved_1f1b",)},
        refused=(("front", "pipe", "the Pipe runs in one process: no data-parallel group"),)),
}


#: combinations torch 2.13's compiler itself fails on, loudly (it raises; nothing runs wrong), each with the error:
#: left out so the matrix tests this library; every pair in them is still met in other cases
TORCH_FAILURES: list[tuple[dict, str]] = [
    ({"dp": "ddp", "compiled": ("aot_eager", "split_backend"), "ckpt": "sac"},
     "AOTAutograd's min-cut partitioner (aot_eager's, and pe.split_backend's, which partitions as inductor does) "
     "raises TypeError ('>' between None and None in cleanup_recompute_tags) on the graphs DDP's compile_fn splits "
     "when they hold selective-checkpoint tags"),
    ({"tp": ("local", "replicate", "sequence"), "compiled": ("aot_eager", "split_backend"),
      "shapes": "per_microbatch"},
     "tensor-parallel blocks (ColwiseParallel / RowwiseParallel, SequenceParallel norms) compiled, then called "
     "with another sequence length: the recompile recurses without end in proxy_tensor's symbolic thunks "
     "(RecursionError at any recursion limit; also without a pipeline: the same blocks in a plain loop over "
     "lengths 4, 6, 2, 6, or for sequence parallelism over the pieces' lengths 2, 3, 1)"),
]


_UNSET = object()


def _level(case: Mapping[str, object], feature: str) -> object:
    """A feature's level in a (partial) case; a schedule argument it does not set is at its default."""
    return case.get(feature, ARGUMENT_DEFAULTS.get(feature, _UNSET))


def allowed(family: str, case: Mapping[str, object], design: Optional[str] = None) -> bool:
    """Whether a (partial) case can exist in ``family`` (in ``design``, one of ``DESIGNS``, when given)."""
    for f1, l1, f2, l2, _ in CONSTRAINTS:
        if case.get(f1, _UNSET) == l1 and case.get(f2, _UNSET) == l2:
            return False
    for levels, _ in TORCH_FAILURES:  # a tuple of levels: any of them
        if all(_level(case, f) in (level if isinstance(level, tuple) else (level,)) for f, level in levels.items()):
            return False
    if design is not None:
        d = DESIGNS[design]
        if family not in d.families:
            return False
        if any(case.get(f, level) != level for f, level in d.fixed.items()):
            return False
        if any(case.get(f, _UNSET) == level for f, level, _ in d.refused):
            return False
    return True


def required_pairs(family: str, design: Optional[str] = None) -> set[tuple[str, object, str, object]]:
    """Every pair of levels of two features that can meet in ``family`` (in ``design``): what its cases must
    cover."""
    names = list(FACTORS)
    out = set()
    for i, j in itertools.combinations(range(len(names)), 2):
        a, b = names[i], names[j]
        for la, lb in itertools.product(FACTORS[a], FACTORS[b]):
            if allowed(family, {a: la, b: lb}, design):
                out.add((a, la, b, lb))
    return out


def pairs_of(case: Mapping[str, object]) -> set[tuple[str, object, str, object]]:
    names = list(FACTORS)
    return {(a, case[a], b, case[b]) for a, b in itertools.combinations(names, 2)}


def _fill(family: str, case: dict, todo: set, design: Optional[str] = None) -> Optional[dict]:
    """Complete ``case`` feature by feature, each time with the level covering most of ``todo`` that keeps the
    case allowed (first level on ties, so a case stays as plain as its pairs let it)."""
    for name, levels in FACTORS.items():
        if name in case:
            continue
        best, best_gain = None, -1
        for level in levels:
            trial = {**case, name: level}
            if not allowed(family, trial, design):
                continue
            gain = sum(1 for (a, la, b, lb) in todo
                       if trial.get(a, object()) == la and trial.get(b, object()) == lb and name in (a, b))
            if gain > best_gain:
                best, best_gain = level, gain
        if best is None:
            return None
        case[name] = best
    return case


def generate(family: str, design: Optional[str] = None) -> list[dict]:
    """The family's cases: greedy all-pairs (deterministic), each case a dict feature -> level plus
    ``schedule`` (alternating over the family's schedules) and ``family``; with ``design`` (one of ``DESIGNS``),
    that design's cases, its fixed levels in each (none for a family that does not run it)."""
    d = DESIGNS[design] if design is not None else None
    if d is not None and family not in d.families:
        return []
    todo = required_pairs(family, design)
    cases: list[dict] = []
    while todo:
        # seed with the uncovered pair that sorts first, then fill greedily
        a, la, b, lb = min(todo, key=repr)
        case = _fill(family, {**(d.fixed if d else {}), a: la, b: lb}, todo, design)
        assert case is not None, f"{family}: no allowed case holds {a}={la}, {b}={lb}"
        todo -= pairs_of(case)
        cases.append(case)
    schedules = d.families[family] if d is not None else FAMILIES[family]
    return [{**c, "family": family, "schedule": schedules[k % len(schedules)]} for k, c in enumerate(cases)]


#: the default tier's slice (about 20 s): DTensor parameters and activations under the I/W split, a forward
#: that communicates (TP all-reduces) inside DualPipeV's overlapped pairs, and the Pipe with keyword arguments,
#: per-microbatch shapes and selective checkpointing; each is a case of the generated design
QUICK = ["zb_h2[tp=replicate]", "dualpipev[tp=local,ckpt=user]", "zb_h1[ckpt=sac,kwargs,front=pipe,split_fn,shapes=per_microbatch]"]


def quick_cases() -> list[dict]:
    by_id = {case_id(c): c for c in all_cases()}
    missing = [q for q in QUICK if q not in by_id]
    assert not missing, f"quick cases no longer generated: {missing}"
    return [by_id[q] for q in QUICK]


def all_cases() -> list[dict]:
    return [c for design in (None, *DESIGNS) for fam in FAMILIES for c in generate(fam, design)]


def world_of(case: Mapping[str, object]) -> int:
    """Ranks the case runs on: pp=2 times dp (2 when on) times tp (2 when on); the Pipe runs in one process."""
    if case["front"] == "pipe":
        return 1
    return 2 * (2 if case["dp"] != "none" else 1) * (2 if case["tp"] != "none" else 1)


def case_id(case: Mapping[str, object]) -> str:
    """A short readable name: the schedule and every feature that is not off."""
    on = [f"{k}={v}" if not isinstance(v, bool) else k for k, v in case.items()
          if (k in FACTORS and v != FACTORS[k][0]) or (k in ARGUMENT_DEFAULTS and v != ARGUMENT_DEFAULTS[k])]
    return f"{case['schedule']}[{','.join(on) or 'plain'}]"


def iter_groups(cases: list[dict]) -> Iterator[tuple[int, list[dict]]]:
    """Cases grouped by the ranks they need (one group of processes runs each group)."""
    by_world: dict[int, list[dict]] = {}
    for c in cases:
        by_world.setdefault(world_of(c), []).append(c)
    yield from sorted(by_world.items())
