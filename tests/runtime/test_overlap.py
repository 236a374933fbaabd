"""Overlapped pairs (DualPipeV's OVERLAP_F_B) run as two threads under a baton (runtime/overlap.py), over Gloo.

- A small MoE model (its all-to-alls torch.distributed's or functional
  collectives), experts spread over the 2 ranks of an expert-parallel
  group (all-to-all dispatch and combine on its own ``new_group``), in a
  DualPipeV pipeline on 2 pipeline ranks (4 processes): with overlap on, the
  parameters after 3 steps equal those with overlap off bit for bit, and are
  close to those of the same EP-parallel model run unpipelined.
- A model with no collective: the same with overlap on and off; and so is a
  training loop with an eval between steps (losses and parameters).
- A half that raises fails the step on every rank, the pair named; a process
  that dies inside a pair fails every surviving rank, and its expert-parallel
  peer names the pair its half was in.
- The measured trace shows each pair's F and B spans overlapping.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from mp_utils import rank_values, run_ranks
from models import TOL

D = 8
M = 4  # microbatches (dualpipev needs m >= 2p)
BATCH = 8


class _AllToAll(torch.autograd.Function):
    """Equal-split all_to_all_single; its backward is the same exchange of the gradients."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        import torch.distributed as dist

        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)  # looked up at call time: a handover point
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        import torch.distributed as dist

        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


class MoEStage(nn.Module):
    """Token i of a microbatch goes to expert i * E // n (E = EP ranks, one expert each); gated, residual."""

    def __init__(self, group, last: bool = False, delay: float = 0.0, funcol: bool = False) -> None:
        super().__init__()
        self.group, self.delay, self.funcol = group, delay, funcol
        self.inp = nn.Linear(D, D)
        self.gate = nn.Linear(D, 1)
        self.expert = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))  # this EP rank's own
        self.head = nn.Linear(D, 4) if last else None

    def _exchange(self, h: torch.Tensor) -> torch.Tensor:
        if self.delay:
            import pipeline_ext as pe

            with pe.comm_region():  # a slow network's latency, as a wait the other half can hide
                import time

                time.sleep(self.delay)
        if self.group is None:
            return h
        if self.funcol:  # a functional collective: issued here, waited on at the result's first use
            import torch.distributed._functional_collectives as funcol

            return funcol.all_to_all_single_autograd(h, None, None, self.group)
        return _AllToAll.apply(h, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        routed = self._exchange(h)  # dispatch
        e = self._exchange(self.expert(routed))  # combine
        x = x + torch.sigmoid(self.gate(h)) * e
        return self.head(x) if self.head is not None else x


def moe_stages(num_stages: int, ep_rank: int, group, delay: float = 0.0, funcol: bool = False) -> list[nn.Module]:
    """The same replicated weights on every EP rank, each EP rank's experts its own (seeded by it)."""
    torch.manual_seed(0)
    stages = [MoEStage(group, last=s == num_stages - 1, delay=delay, funcol=funcol) for s in range(num_stages)]
    torch.manual_seed(100 + ep_rank)
    with torch.no_grad():
        for s in stages:
            for p in s.expert.parameters():
                p.copy_(torch.randn_like(p) * 0.3)
    return stages


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def _data(ep_rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * ep_rank + step)
    return torch.randn(BATCH, D, generator=g), torch.randn(BATCH, 4, generator=g)


def _groups(rank: int):
    """4 processes: pipeline rank = rank // 2, EP rank = rank % 2; every process makes every group, in order."""
    import torch.distributed as dist

    ep = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return rank // 2, rank % 2, ep[rank // 2], pp[rank % 2]


def _train_moe(rank: int, world: int, funcol: bool = False) -> dict:
    import pipeline_ext as pe

    p, e, ep_group, pp_group = _groups(rank)
    n = 2 * 2
    out: dict = {}
    from pipeline_ext.runtime.overlap import handover_count

    for mode in ("off", "on", "ref"):
        before = handover_count()
        modules = moe_stages(n, e, ep_group, funcol=funcol)
        mine = [p, n - 1 - p] if mode != "ref" else list(range(n))
        opt = torch.optim.SGD([q for s in mine for q in modules[s].parameters()], lr=0.1)
        sched = None
        if mode != "ref":
            stages = [pe.PipelineStage(modules[s], s, n, "cpu", group=pp_group) for s in mine]
            sched = pe.ScheduleDualPipeV(stages, M, loss_fn=_loss, overlap=mode == "on", timeout=60.0)
        for step in range(3):
            x, y = _data(e, step)
            opt.zero_grad()
            if sched is not None:
                sched.step(x if p == 0 else None, target=y if p == 0 else None)
            else:  # the same EP-parallel model, unpipelined: microbatch by microbatch, the a2a with the EP peer
                for xm, ym in zip(x.chunk(M), y.chunk(M)):
                    h = xm
                    for s in modules:
                        h = s(h)
                    (_loss(h, ym) / M).backward()
            opt.step()
        if sched is not None:
            out["pairs"] = sum(1 for f, _ in sched.schedule.overlapped if f.stage in mine)
        out[f"handovers {mode}"] = handover_count() - before
        out[mode] = {s: [q.detach().tolist() for q in modules[s].parameters()] for s in mine}
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("funcol", [False, True], ids=["c10d", "functional"])
def test_moe_with_expert_all_to_all_overlapped_equals_sequential_and_unsplit(funcol):
    said = rank_values(_train_moe, 4, funcol, timeout=280)
    assert all(v["pairs"] > 0 for v in said.values())  # every rank has pairs to overlap
    # the expert all-to-alls (forward and backward) inside pairs handed over; nothing did without overlap
    assert all(v["handovers on"] >= 4 * v["pairs"] * 3 and v["handovers off"] == 0 for v in said.values()), said
    for rank, v in said.items():
        assert v["on"].keys() == v["off"].keys()
        for s in v["on"]:
            for a, b, r in zip(v["on"][s], v["off"][s], v["ref"][s]):
                assert torch.equal(torch.tensor(a), torch.tensor(b)), (rank, s)  # bit for bit
                torch.testing.assert_close(torch.tensor(a), torch.tensor(r), **TOL)


def _mlp(rank: int, world: int, overlap: bool, fail: str = "") -> dict:
    import pipeline_ext as pe

    from models import build, make_batch

    n = 2 * world
    modules = build("mlp", n)
    mine = [rank, n - 1 - rank]
    stages = [pe.PipelineStage(modules[s], s, n, "cpu") for s in mine]
    sched = pe.ScheduleDualPipeV(stages, M, loss_fn=_loss, overlap=overlap, timeout=30.0)
    if fail:
        pair = sched.schedule.overlapped[0]  # the first pair (in either order); make its F (or B) half raise
        target = next(a for a in pair if (a.kind.value == "F") == (fail == "F"))
        if target.stage in mine:
            calls = {"n": 0}

            def boom_grad(g):
                raise RuntimeError(f"stage {target.stage} backward refused microbatch {target.microbatch}")

            def pre(module, args):
                m, calls["n"] = calls["n"], calls["n"] + 1  # a stage's forwards run in microbatch order
                if m == target.microbatch:
                    if fail == "F":
                        raise RuntimeError(f"stage {target.stage} forward refused microbatch {m}")
                    args[0].register_hook(boom_grad)
            modules[target.stage].register_forward_pre_hook(pre)
    opt = torch.optim.SGD([q for s in mine for q in modules[s].parameters()], lr=0.1)
    for step in range(3 if not fail else 1):
        x, y = make_batch("mlp", 8, seed=step)
        opt.zero_grad()
        try:
            sched.step(x if rank == 0 else None, target=y if rank == 0 else None)
        except Exception as exc:  # noqa: BLE001 - what each rank saw is the point
            return {"error": "\n".join([f"{type(exc).__name__}: {exc}", *getattr(exc, "__notes__", [])])}
        opt.step()
    return {"params": {s: [q.detach().tolist() for q in modules[s].parameters()] for s in mine}, "error": None}


@pytest.mark.timeout(240)
def test_a_model_without_collectives_trains_the_same_with_and_without_overlap():
    on = rank_values(_mlp, 2, True, timeout=100)
    off = rank_values(_mlp, 2, False, timeout=100)
    for rank in (0, 1):
        for s in on[rank]["params"]:
            for a, b in zip(on[rank]["params"][s], off[rank]["params"][s]):
                assert torch.equal(torch.tensor(a), torch.tensor(b))


@pytest.mark.isolated
@pytest.mark.timeout(240)
@pytest.mark.parametrize("half", ["F", "B"])
def test_a_half_that_raises_fails_the_step_on_every_rank_naming_the_pair(half):
    said = {r: v for r, (_, v) in run_ranks(_mlp, 2, True, half, timeout=100, expect_errors=True).items()}
    errors = {r: (v["error"] if isinstance(v, dict) else str(v)) for r, v in said.items()}
    assert all(e for e in errors.values()), errors  # every rank is told, none hangs
    named = [e for e in errors.values() if "refused" in e and "overlapped pair" in e]
    assert named, errors


class _YieldFn(torch.autograd.Function):
    """Hands the turn to the other half of a pair (``pe.overlap_point``: a declared wait) in forward and backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        import pipeline_ext as pe

        pe.overlap_point()
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        import pipeline_ext as pe

        pe.overlap_point()
        return grad


class _Yield(nn.Module):
    """A stage's last module: whichever half of a pair runs first hands over once, so the two spans overlap."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _YieldFn.apply(x)


def _traced(rank: int, world: int, yields: bool) -> dict:
    import pipeline_ext as pe

    from models import build, make_batch

    n = 2 * world
    modules = [nn.Sequential(m, _Yield()) if yields else m for m in build("mlp", n)]
    mine = [rank, n - 1 - rank]
    stages = [pe.PipelineStage(modules[s], s, n, "cpu") for s in mine]
    sched = pe.ScheduleDualPipeV(stages, M, loss_fn=_loss, trace=True, timeout=30.0)
    x, y = make_batch("mlp", 8)
    sched.step(x if rank == 0 else None, target=y if rank == 0 else None)
    report = sched.trace_report(dst=0)
    if report is None:
        return {}
    spans = {(s.rank, s.action): (s.start, s.end) for step in report.steps for s in step}
    pairs, sent_first = [], []
    for a, b in sched.schedule.overlapped:
        r = sched.schedule.stage_to_rank[a.stage]
        (a0, a1), (b0, b1) = spans[(r, a)], spans[(r, b)]
        pairs.append((str(a), str(b), a0 < b1 and b0 < a1))  # the two spans overlap in the measured timeline
        # the first's sends to another rank, each posted before the second began
        kind = "SEND_F" if a.kind.value == "F" else "SEND_B"
        sends = [v for (r2, x), v in spans.items() if r2 == r and x.kind.value == kind and x.stage == a.stage
                 and x.microbatch == a.microbatch]
        sent_first.append((str(a), str(b), len(sends), all(end <= b0 for _, end in sends)))
    return {"pairs": pairs, "bubble": report.bubble_per_step[0], "sent_first": sent_first}


@pytest.mark.timeout(120)
def test_overlapped_pairs_overlap_in_the_measured_trace():
    said = rank_values(_traced, 2, True, timeout=100)
    assert said[0]["pairs"] and all(ok for _, _, ok in said[0]["pairs"]), said[0]
    assert 0.0 <= said[0]["bubble"] < 1.0  # busy time is the union of spans: never more than the wall clock


@pytest.mark.timeout(120)
def test_a_pair_that_never_hands_over_sends_its_first_output_before_its_second_runs():
    """Without handovers a pair is its two actions one after the other, messages included (what the simulator
    counts): the first's output leaves before the second starts, it is not held until the pair ends."""
    said = rank_values(_traced, 2, False, timeout=100)
    sent = said[0]["sent_first"]
    assert sum(n for _, _, n, _ in sent) >= len(sent) // 2, sent  # the firsts (Bs) off stage 0 send a gradient
    assert all(ok for _, _, _, ok in sent), sent


class _DiesInPair(nn.Module):
    """Kills its own process the first time it runs inside a pair's half: a peer that dies mid-pair."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import os

        import pipeline_ext as pe

        if pe.in_overlap():
            os._exit(3)
        return x


def _moe_peer_dies(rank: int, world: int) -> dict:
    """The 4-process MoE pipeline; process 3 (pipeline rank 1, EP rank 1) dies inside its first pair."""
    import pipeline_ext as pe

    p, e, ep_group, pp_group = _groups(rank)
    n = 2 * 2
    modules = moe_stages(n, e, ep_group)
    mine = [p, n - 1 - p]
    if rank == 3:
        modules = [nn.Sequential(_DiesInPair(), m) for m in modules]
    stages = [pe.PipelineStage(modules[s], s, n, "cpu", group=pp_group) for s in mine]
    sched = pe.ScheduleDualPipeV(stages, M, loss_fn=_loss, overlap=True, timeout=20.0)
    x, y = _data(e, 0)
    try:
        sched.step(x if p == 0 else None, target=y if p == 0 else None)
    except Exception as exc:  # noqa: BLE001 - what each surviving rank saw is the point
        return {"error": "\n".join([f"{type(exc).__name__}: {exc}", *getattr(exc, "__notes__", [])])}
    return {"error": ""}


@pytest.mark.isolated
@pytest.mark.timeout(240)
def test_a_peer_that_dies_inside_a_pair_fails_every_surviving_rank_and_the_pair_is_named():
    said = run_ranks(_moe_peer_dies, 4, timeout=150, pg_timeout=20, expect_errors=True)
    assert said[3] == ("died", 3), said[3]
    errors = {r: (v["error"] if isinstance(v, dict) else str(v)) for r, (_, v) in said.items() if r != 3}
    assert all(errors.values()), errors  # every surviving rank raised within the timeout, none hung
    # process 2 is the dead one's expert-parallel peer: its own pair half waited on the dead rank's all-to-all
    assert "overlapped pair" in errors[2], errors[2]


def _train_and_eval(rank: int, world: int) -> dict:
    """A user's loop: training steps with an eval between them, overlap on and off in the same processes."""
    import pipeline_ext as pe

    from models import build, make_batch

    n = 2 * world
    mine = [rank, n - 1 - rank]
    out: dict = {}
    for overlap in (True, False):
        modules = build("mlp", n)
        stages = [pe.PipelineStage(modules[s], s, n, "cpu") for s in mine]
        sched = pe.ScheduleDualPipeV(stages, M, loss_fn=_loss, overlap=overlap, timeout=30.0)
        opt = torch.optim.SGD([q for s in mine for q in modules[s].parameters()], lr=0.1)
        evals = []
        for step in range(3):
            x, y = make_batch("mlp", 8, seed=step)
            opt.zero_grad()
            sched.step(x if rank == 0 else None, target=y if rank == 0 else None)
            opt.step()
            losses: list = []
            xe, ye = make_batch("mlp", 8, seed=100 + step)
            sched.eval(xe if rank == 0 else None, target=ye if rank == 0 else None, losses=losses)
            evals.append([float(v) for v in losses])
        out[overlap] = {"params": {s: [q.detach().tolist() for q in modules[s].parameters()] for s in mine},
                        "evals": evals}
    return out


@pytest.mark.timeout(240)
def test_training_with_eval_between_steps_is_bitwise_the_same_with_and_without_overlap():
    said = rank_values(_train_and_eval, 2, timeout=200)
    assert any(v[True]["evals"][0] for v in said.values())  # the rank holding the loss saw eval losses
    for rank, v in said.items():
        assert v[True]["evals"] == v[False]["evals"], rank
        for s in v[True]["params"]:
            for a, b in zip(v[True]["params"][s], v[False]["params"][s]):
                assert torch.equal(torch.tensor(a), torch.tensor(b)), (rank, s)


def _run_pair(first: str, hand_over: bool) -> dict:
    """run_overlapped on one process: which thread ran each half, in what order, and what saved-tensor hooks
    each half's forward compute saw (a ``saved_tensors_hooks`` pair entered around the pair, as around step())."""
    import threading

    import pipeline_ext as pe
    from pipeline_ext.runtime.overlap import run_overlapped
    from pipeline_ext.schedules import Action, ActionKind

    f, b = Action(1, ActionKind.F, 1), Action(0, ActionKind.B, 0)
    said: list[tuple[str, str, int]] = []
    packed: list[str] = []  # the half whose compute a pack hook saw
    half = threading.local()
    w = torch.ones(3, requires_grad=True)

    def run(a: Action) -> None:
        half.kind = a.kind.value
        said.append((half.kind, "start", threading.get_ident()))
        if hand_over:
            pe.overlap_point()
        (w * torch.ones(3)).sum()  # saves a tensor for backward: through the hooks in force
        said.append((half.kind, "end", threading.get_ident()))

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(half.kind)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run_overlapped([f, b] if first == "F" else [b, f], run)
    return {"said": said, "packed": packed, "caller": threading.get_ident()}


@pytest.mark.parametrize("first", ["F", "B"])
def test_a_pair_that_never_hands_over_runs_both_actions_in_order_in_the_callers_thread(first):
    out = _run_pair(first, hand_over=False)
    second = "B" if first == "F" else "F"
    assert [(k, e) for k, e, _ in out["said"]] == [(first, "start"), (first, "end"), (second, "start"),
                                                     (second, "end")]
    assert {t for _, _, t in out["said"]} == {out["caller"]}  # no thread started, no switch
    assert sorted(out["packed"]) == ["B", "F"]


@pytest.mark.parametrize("first", ["F", "B"])
def test_a_pair_that_hands_over_runs_its_second_half_in_another_thread_with_the_callers_saved_tensor_hooks(first):
    out = _run_pair(first, hand_over=True)
    second = "B" if first == "F" else "F"
    order = [(k, e) for k, e, _ in out["said"]]
    assert order[:2] == [(first, "start"), (second, "start")], order  # the first handed over: the second began
    threads = {k: t for k, _, t in out["said"]}
    assert threads[first] == out["caller"] and threads[second] != out["caller"], threads
    assert sorted(out["packed"]) == ["B", "F"]  # the hooks entered around the pair reached both halves


def test_a_first_half_that_raises_before_any_handover_never_runs_the_second():
    from pipeline_ext.runtime.overlap import run_overlapped
    from pipeline_ext.schedules import Action, ActionKind

    ran: list[str] = []

    def run(a: Action) -> None:
        ran.append(a.kind.value)
        if a.kind == ActionKind.B:
            raise ValueError("boom")

    with pytest.raises(ValueError, match="boom") as info:
        run_overlapped([Action(0, ActionKind.B, 0), Action(1, ActionKind.F, 1)], run)
    assert ran == ["B"]
    assert any("overlapped pair" in note for note in getattr(info.value, "__notes__", [])), info.value


@pytest.mark.parametrize("hand_over", [False, True])
def test_a_pair_leaves_no_reference_cycle_holding_what_its_actions_returned(hand_over):
    """What the pair's ``run`` holds (the executor's GroupRun keeps each action's result) is freed when the
    pair returns and the caller drops it, without waiting for the garbage collector."""
    import gc
    import weakref

    import pipeline_ext as pe
    from pipeline_ext.runtime.overlap import run_overlapped
    from pipeline_ext.schedules import Action, ActionKind

    class Run:
        def __init__(self) -> None:
            self.done: dict = {}

        def __call__(self, a: Action) -> None:
            if hand_over:
                pe.overlap_point()
            self.done[a] = torch.ones(4)

    run = Run()
    gc.disable()
    try:
        run_overlapped([Action(0, ActionKind.B, 0), Action(1, ActionKind.F, 1)], run)
        results = [weakref.ref(t) for t in run.done.values()]
        del run
        assert [r() is None for r in results] == [True, True]
    finally:
        gc.enable()


class _RecordingPool:
    """The pair runner's thread pool, recording every half it was handed (so a test can wait for a stray one)."""

    def __init__(self, real: Any) -> None:
        self.real, self.futures = real, []

    def submit(self, fn: Any, *args: Any) -> Any:
        future = self.real.submit(fn, *args)
        self.futures.append(future)
        return future


def _pair_once(monkeypatch, first: str, hand_over: tuple, raises: tuple = ()) -> dict:
    """One run_overlapped: the halves in ``hand_over`` hand over once, ``raises`` = (half, "before"/"after" its
    handover) raises there. Returns which half ran in which thread (every start, so a half run twice shows
    twice), how many halves went to the pool, whether they had all ended when the pair returned, the error.

    Deterministic: a second copy of a half, if the runner submits one, is waited for here before counting."""
    import threading

    import pipeline_ext as pe
    from pipeline_ext.runtime import overlap
    from pipeline_ext.schedules import Action, ActionKind

    pool = _RecordingPool(overlap._pool())
    monkeypatch.setattr(overlap, "_pool", lambda: pool)
    f, b = Action(1, ActionKind.F, 1), Action(0, ActionKind.B, 0)
    lock = threading.Lock()
    ran: list[tuple[str, int]] = []

    def run(a: Action) -> None:
        kind = a.kind.value
        with lock:
            ran.append((kind, threading.get_ident()))
        if raises == (kind, "before"):
            raise ValueError(f"{kind} refused before its handover")
        if kind in hand_over:
            pe.overlap_point()
        if raises == (kind, "after"):
            raise ValueError(f"{kind} refused after its handover")

    error = None
    try:
        overlap.run_overlapped([f, b] if first == "F" else [b, f], run)
    except ValueError as exc:
        error = exc
    ended = all(fut.done() for fut in pool.futures)
    for fut in pool.futures:  # a copy of a half that nothing waits for: let it run, so that it is counted
        fut.result(timeout=60)
    return {"ran": ran, "pooled": len(pool.futures), "ended": ended, "error": error,
            "caller": threading.get_ident()}


@pytest.mark.parametrize("first", ["B", "F"])
def test_a_second_half_that_hands_over_after_a_first_that_never_did_runs_once_in_the_callers_thread(
        monkeypatch, first):
    """Red-team issue 54, item 2: a first half (DualPipeV: the B) that never reaches a handover point, then a
    second (the F) that does. The second runs after the first in the caller's thread (overlap=False's order);
    its handover must not start the pooled thread for it as well: that copy ran the F a second time, on a
    thread nothing waited for (data consumed twice, ranks disagreeing on whether the step happened, other
    dropout draws)."""
    second = "F" if first == "B" else "B"
    out = _pair_once(monkeypatch, first, hand_over=(second,))
    assert out["error"] is None
    assert [k for k, _ in out["ran"]] == [first, second], out["ran"]  # each once, in the schedule's order
    assert {t for _, t in out["ran"]} == {out["caller"]}, out  # both in the caller's thread
    assert out["pooled"] == 0  # no thread started


@pytest.mark.parametrize("raises", ["", "first before", "first after", "second before", "second after"])
@pytest.mark.parametrize("hands", ["neither", "first", "second", "both"])
@pytest.mark.parametrize("first", ["B", "F"])
def test_each_half_runs_at_most_once_and_has_ended_when_the_pair_returns(monkeypatch, first, hands, raises):
    """Whichever half hands over first (or neither, or both), whichever raises: a half starts at most once (once
    when nothing raised, the second not at all when the first raised before any handover), the second runs in
    a pooled thread exactly when the first handed over, and nothing of the pair still runs when it returns."""
    second = "F" if first == "B" else "B"
    hand_over = {"neither": (), "first": (first,), "second": (second,), "both": (first, second)}[hands]
    raise_at = ()
    if raises:
        which, where = raises.split()
        raise_at = (first if which == "first" else second, where)
    out = _pair_once(monkeypatch, first, hand_over, raise_at)
    kinds = [k for k, _ in out["ran"]]
    threads = dict(out["ran"])
    assert out["ended"], out  # nothing of the pair runs on after it returned
    assert (out["error"] is not None) == bool(raises), out
    assert sorted(set(kinds)) == sorted(kinds), out["ran"]  # no half started twice
    assert kinds[0] == first and threads[first] == out["caller"], out
    first_handed_over = first in hand_over and raise_at != (first, "before")
    assert out["pooled"] == (1 if first_handed_over else 0), out
    if raise_at == (first, "before"):
        assert kinds == [first], out  # sequentially the second would never have run
    elif not raises:
        assert sorted(kinds) == ["B", "F"], out
    if second in threads:
        assert (threads[second] == out["caller"]) == (not first_handed_over), out


class _ForwardWait(nn.Module):
    """A layer whose forward reaches a handover point and whose backward does not: a declared wait
    (``comm_region()``) or a collective (an ``all_reduce`` on this rank's own group, so it can sit on one stage
    of one rank only). In DualPipeV's pairs (B first) the B never hands over and the F does."""

    def __init__(self, how: str, groups: Any) -> None:
        super().__init__()
        self.how, self.groups = how, groups
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.how == "comm_region":
            import pipeline_ext as pe

            with pe.comm_region():  # a wait of the model's own (nothing to wait on here)
                pass
        elif self.how == "collective":
            import torch.distributed as dist

            t = x.detach().sum().reshape(1)
            dist.all_reduce(t, group=self.groups[dist.get_rank()])  # looked up at call time: a handover point
        return x.view_as(x)


def _forward_waits(rank: int, world: int, how: str, dropout: bool) -> dict:
    """Two training steps of a 4-stage MLP in DualPipeV on 2 ranks, overlap off, on, and the unsplit model
    (``ref``, in one process); the stages' forwards hand over (``how``: every stage waits in ``comm_region()``,
    or stage 2 alone calls a collective), with ``dropout`` on every stage."""
    import torch.distributed as dist

    import pipeline_ext as pe
    from pipeline_ext.runtime.overlap import handover_count

    from models import build, make_batch

    groups = [dist.new_group([0]), dist.new_group([1])]  # every rank makes every group, in order
    n = 2 * world
    mine = [rank, n - 1 - rank]
    out: dict = {}
    for mode in ("off", "on", "ref"):
        before = handover_count()
        waits = [_ForwardWait(how if how == "comm_region" or s == 2 else "", groups) for s in range(n)]
        modules = [nn.Sequential(m, *([nn.Dropout(0.3)] if dropout else []), w)
                   for m, w in zip(build("mlp", n), waits)]
        held = mine if mode != "ref" else list(range(n))
        opt = torch.optim.SGD([q for s in held for q in modules[s].parameters()], lr=0.1)
        sched = None
        if mode != "ref":
            stages = [pe.PipelineStage(modules[s], s, n, "cpu") for s in mine]
            sched = pe.ScheduleDualPipeV(stages, M, loss_fn=_loss, overlap=mode == "on", timeout=30.0)
        torch.manual_seed(1234 + rank)  # the dropout draws: the same stream for off and on
        for step in range(2):
            x, y = make_batch("mlp", 8, seed=step)
            opt.zero_grad()
            if sched is not None:
                sched.step(x if rank == 0 else None, target=y if rank == 0 else None)
            else:
                for xm, ym in zip(x.chunk(M), y.chunk(M)):
                    h = xm
                    for s in modules:
                        h = s(h)
                    (_loss(h, ym) / M).backward()
            opt.step()
        out[f"handovers {mode}"] = handover_count() - before
        out[f"forwards {mode}"] = {s: waits[s].calls for s in held}
        out[mode] = {s: [q.detach().tolist() for q in modules[s].parameters()] for s in mine}
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how,dropout", [("comm_region", False), ("collective", False), ("comm_region", True)],
                         ids=["comm_region", "collective-on-one-stage", "comm_region-dropout"])
def test_forwards_that_hand_over_and_backwards_that_do_not_train_the_same_with_and_without_overlap(how, dropout):
    """Red-team issue 54, item 2, in a user's loop: each F runs once per microbatch and step (no copy on a
    pool thread), the parameters after two steps are those of overlap=False bit for bit, and (without
    dropout, whose draws the unsplit model makes in another order) close to the unsplit model's."""
    said = rank_values(_forward_waits, 2, how, dropout, timeout=240)
    assert any(v["handovers on"] > 0 for v in said.values()), said  # the Fs in pairs did hand over
    for rank, v in said.items():
        assert v["handovers off"] == 0
        assert v["forwards on"] == v["forwards off"] == {s: 2 * M for s in v["forwards on"]}, (rank, v)
        for s in v["on"]:
            for a, b, r in zip(v["on"][s], v["off"][s], v["ref"][s]):
                assert torch.equal(torch.tensor(a), torch.tensor(b)), (rank, s)  # bit for bit
                if not dropout:
                    torch.testing.assert_close(torch.tensor(a), torch.tensor(r), **TOL)
