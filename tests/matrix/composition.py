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


#: sequence pieces (``seq_chunks=2``, Seq1F1B): a design of its own, so the one above keeps its cases. Each family
#: whose schedules run pieces meets every pair of the other features with pieces on (strength two among them, three
#: with the pieces); the model is position-wise, so pieces are exact by the cut, the loss weights and the schedule
#: alone, which is what meets every feature here (attention across pieces has its own tests, tests/seqchunks)
PIECES = 2
PIECE_FAMILIES: dict[str, tuple[str, ...]] = {
    "1f1b": ("1f1b",),
    "interleaved": ("interleaved_1f1b",),
    "zero_bubble": ("zb_h1",),
}
#: what cannot meet sequence pieces, and why (the refusals are tested by name in tests/seqchunks)
PIECE_CONSTRAINTS: list[tuple[str, object, str]] = [
    ("front", "pipe", "the Pipe does not run sequence pieces (it refuses seq_chunks by name)"),
]


#: combinations torch 2.13's compiler itself fails on, loudly (it raises; nothing runs wrong), each with the error:
#: left out so the matrix tests this library; every pair in them is still met in other cases
TORCH_FAILURES: list[tuple[dict, str]] = [
    ({"dp": "ddp", "compiled": "split_backend", "ckpt": "sac"},
     "inductor's min-cut partitioner raises TypeError ('>' between None and None in cleanup_recompute_tags) on "
     "the graphs DDP's compile_fn splits when they hold selective-checkpoint tags"),
    ({"seq_chunks": PIECES, "compiled": "aot_eager", "split_fn": True, "shapes": "per_microbatch"},
     "recompiling a custom autograd Function for the pieces' lengths (1 to 3 here) recurses without end in "
     "proxy_tensor's symbolic thunks (RecursionError at any recursion limit)"),
    ({"seq_chunks": PIECES, "compiled": "split_backend", "split_fn": True, "shapes": "per_microbatch"},
     "as with aot_eager: RecursionError in proxy_tensor's symbolic thunks"),
]


def allowed(family: str, case: Mapping[str, object]) -> bool:
    """Whether a (partial) case can exist in ``family`` (with sequence pieces when ``case`` has ``seq_chunks``)."""
    for f1, l1, f2, l2, _ in CONSTRAINTS:
        if case.get(f1, object()) == l1 and case.get(f2, object()) == l2:
            return False
    for levels, _ in TORCH_FAILURES:
        if all(case.get(f, 1 if f == "seq_chunks" else object()) == level for f, level in levels.items()):
            return False
    if case.get("seq_chunks", 1) > 1:
        if family not in PIECE_FAMILIES:
            return False
        if any(case.get(f, object()) == level for f, level, _ in PIECE_CONSTRAINTS):
            return False
    return True


def required_pairs(family: str) -> set[tuple[str, object, str, object]]:
    """Every pair of levels of two features that can meet in ``family``: what its cases must cover."""
    names = list(FACTORS)
    out = set()
    for i, j in itertools.combinations(range(len(names)), 2):
        a, b = names[i], names[j]
        for la, lb in itertools.product(FACTORS[a], FACTORS[b]):
            if allowed(family, {a: la, b: lb}):
                out.add((a, la, b, lb))
    return out


def pairs_of(case: Mapping[str, object]) -> set[tuple[str, object, str, object]]:
    names = list(FACTORS)
    return {(a, case[a], b, case[b]) for a, b in itertools.combinations(names, 2)}


def _fill(family: str, case: dict, todo: set) -> Optional[dict]:
    """Complete ``case`` feature by feature, each time with the level covering most of ``todo`` that keeps the
    case allowed (first level on ties, so a case stays as plain as its pairs let it)."""
    for name, levels in FACTORS.items():
        if name in case:
            continue
        best, best_gain = None, -1
        for level in levels:
            trial = {**case, name: level}
            if not allowed(family, trial):
                continue
            gain = sum(1 for (a, la, b, lb) in todo
                       if trial.get(a, object()) == la and trial.get(b, object()) == lb and name in (a, b))
            if gain > best_gain:
                best, best_gain = level, gain
        if best is None:
            return None
        case[name] = best
    return case


def required_piece_pairs(family: str) -> set[tuple[str, object, str, object]]:
    """What the family's cases with sequence pieces must cover: every allowed pair of levels, pieces on."""
    if family not in PIECE_FAMILIES:
        return set()
    return {p for p in required_pairs(family)
            if allowed(family, {p[0]: p[1], p[2]: p[3], "seq_chunks": PIECES})}


def generate(family: str, pieces: bool = False) -> list[dict]:
    """The family's cases: greedy all-pairs (deterministic), each case a dict feature -> level plus
    ``schedule`` (alternating over the family's schedules) and ``family``; with ``pieces``, the design with
    ``seq_chunks=PIECES`` in every case (empty for a family that does not run pieces)."""
    if pieces and family not in PIECE_FAMILIES:
        return []
    todo = required_piece_pairs(family) if pieces else required_pairs(family)
    seed = {"seq_chunks": PIECES} if pieces else {}
    cases: list[dict] = []
    while todo:
        # seed with the uncovered pair that sorts first, then fill greedily
        a, la, b, lb = min(todo, key=repr)
        case = _fill(family, {**seed, a: la, b: lb}, todo)
        assert case is not None, f"{family}: no allowed case holds {a}={la}, {b}={lb}"
        todo -= pairs_of(case)
        cases.append(case)
    schedules = PIECE_FAMILIES[family] if pieces else FAMILIES[family]
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
    return [c for fam in FAMILIES for c in generate(fam)] + [c for fam in PIECE_FAMILIES for c in generate(fam, True)]


def world_of(case: Mapping[str, object]) -> int:
    """Ranks the case runs on: pp=2 times dp (2 when on) times tp (2 when on); the Pipe runs in one process."""
    if case["front"] == "pipe":
        return 1
    return 2 * (2 if case["dp"] != "none" else 1) * (2 if case["tp"] != "none" else 1)


def case_id(case: Mapping[str, object]) -> str:
    """A short readable name: the schedule and every feature that is not off."""
    on = [f"{k}={v}" if not isinstance(v, bool) else k for k, v in case.items()
          if (k in FACTORS and v != FACTORS[k][0]) or (k == "seq_chunks" and v != 1)]
    return f"{case['schedule']}[{','.join(on) or 'plain'}]"


def iter_groups(cases: list[dict]) -> Iterator[tuple[int, list[dict]]]:
    """Cases grouped by the ranks they need (one group of processes runs each group)."""
    by_world: dict[int, list[dict]] = {}
    for c in cases:
        by_world.setdefault(world_of(c), []).append(c)
    yield from sorted(by_world.items())
