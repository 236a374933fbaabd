"""FSDP2 stages under a parameter budget: UNSHARD / RESHARD / REDUCE_GRAD placed by the planner, exact.

The user's loop: pp=2 x dp=2 on 4 Gloo CPU ranks, every block and every
stage ``fully_shard``ed over dp with ``reshard_after_forward=False`` (as
torchtitan does under a pipeline), a multi-stage schedule given
``max_active_stages=N``. Per step and rank the test counts FSDP's
all-gathers per parameter group (wrapping the all-gather FSDP calls), the
reduce-scatters per stage and after which action each was issued (an action
hook), and samples after every action the bytes held in unsharded
parameters (their storage; FSDP frees it by resizing to 0) plus unsharded
gradients, against P, the rank's stages' unsharded parameter bytes. Every
run is compared with the unsplit model: loss, gradients, and parameters
after SGD steps.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from models import D, TOL, BlockStage, loss_fn, run_stages, unsharded_bytes
from mp_utils import rank_values

PP, DP, M, ROWS, STEPS = 2, 2, 8, 16, 2


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


class _Counts:
    """All-gathers per FSDP parameter group, reduce-scatters per stage, and the held bytes, on this rank."""

    def __init__(self, groups_of: dict[int, list]) -> None:
        self.groups_of = groups_of  # stage -> its FSDPParamGroups
        self.stage_of = {id(g): s for s, gs in groups_of.items() for g in gs}
        self.gathers: dict[int, int] = {id(g): 0 for gs in groups_of.values() for g in gs}
        self.scatters: dict[int, int] = {s: 0 for s in groups_of}
        self.peak = 0
        self.after: list[tuple[str, dict[int, int]]] = []  # (action, reduce-scatters per stage so far)

    def held(self) -> int:
        return unsharded_bytes([g for gs in self.groups_of.values() for g in gs])

    def sample(self, sample) -> None:
        self.peak = max(self.peak, self.held())
        self.after.append((str(sample.action), dict(self.scatters)))


def _count_collectives(counts: _Counts):
    """Wrap FSDP's all-gather and reduce-scatter entry points for this rank; returns the undo."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

    gather, scatter = pg.foreach_all_gather, pg.foreach_reduce

    def counting_gather(fsdp_params, *args, **kwargs):
        for g in (g for gs in counts.groups_of.values() for g in gs):
            if g.fsdp_params is fsdp_params or list(g.fsdp_params) == list(fsdp_params):
                counts.gathers[id(g)] += 1
                break
        return gather(fsdp_params, *args, **kwargs)

    def counting_scatter(fsdp_params, *args, **kwargs):
        for s, gs in counts.groups_of.items():
            if any(list(g.fsdp_params) == list(fsdp_params) for g in gs):
                counts.scatters[s] += 1
                break
        return scatter(fsdp_params, *args, **kwargs)

    pg.foreach_all_gather, pg.foreach_reduce = counting_gather, counting_scatter

    def undo() -> None:
        pg.foreach_all_gather, pg.foreach_reduce = gather, scatter

    return undo


def _equal_stages(n: int) -> list[torch.nn.Module]:
    """Stages of equal size (transformer blocks, no head): the budget's promise is stated for equal stages."""
    torch.manual_seed(0)
    return [BlockStage() for _ in range(n)]


def _sharded(mesh: Any, modules: list[torch.nn.Module], mine: list[int], reshard_after_forward: bool = False
             ) -> tuple[_Counts, int]:
    """This rank's stages ``fully_shard``ed over dp (each block, then the stage); their counter, and P: the rank's
    stages' unsharded parameter bytes."""
    from torch.distributed.fsdp import fully_shard

    for s in mine:
        fully_shard(modules[s].block, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
        fully_shard(modules[s], mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
    counts = _Counts({s: [g for m in (modules[s].block, modules[s]) for g in m._get_fsdp_state()._fsdp_param_groups]
                      for s in mine})
    P = sum(sum(fp._orig_size.numel() * 4 for fp in g.fsdp_params) for gs in counts.groups_of.values() for g in gs)
    return counts, P


def _grads_differ(modules: list[torch.nn.Module], ref: list[torch.nn.Module], mine: list[int]) -> list[str]:
    """"stage s name" of each gradient of this rank's stages that is not the unsplit model's (a DTensor's in full)."""
    return [f"stage {s} {n}" for s in mine for (n, p), q in zip(modules[s].named_parameters(), ref[s].parameters())
            if p.grad is None or not torch.allclose(_full(p.grad), q.grad, **TOL)]


def _run(rank: int, world: int, cases: list[tuple[str, int, object]], reshard_after_forward: bool = False) -> list:
    """Per case (schedule, stages per rank, budget): exact against the unsplit model, and what was counted."""
    import pipeline_ext as pe

    mesh = pe.pipeline_mesh(pp=PP, dp=DP, device_type="cpu")
    out = []
    for name, v, budget in cases:
        layout = pe.pipeline_layout(mesh, name, stages_per_rank=v)
        ns, mine = layout.num_stages, layout.stages
        modules, ref = _equal_stages(ns), _equal_stages(ns)
        counts, P = _sharded(mesh, modules, mine, reshard_after_forward)
        stages = [pe.PipelineStage(modules[s], s, ns, "cpu", group=mesh["pp"]) for s in mine]
        kw = {} if budget is None else {"max_active_stages": budget}
        sched = pe.get_schedule_class(name)(stages if len(stages) > 1 else stages[0], M, loss_fn=loss_fn, **kw)
        sched.register_action_hook(counts.sample)
        opt = torch.optim.SGD([p for s in mine for p in modules[s].parameters()], lr=0.1)
        ref_opt = torch.optim.SGD([p for m in ref for p in m.parameters()], lr=0.1)
        rows = slice(layout.dp_rank * ROWS // DP, (layout.dp_rank + 1) * ROWS // DP)
        where = f"{name} v={v} budget={budget} rank {rank}"
        bad: list[str] = []
        undo = _count_collectives(counts)
        try:
            for step in range(STEPS):
                g = torch.Generator().manual_seed(step)
                x, y = torch.randn(ROWS, 3, D, generator=g), torch.randn(ROWS, 3, D, generator=g)
                opt.zero_grad()
                counts.after.clear()
                sched.step(*((x[rows],) if 0 in mine else ()), target=y[rows] if ns - 1 in mine else None)
                ref_opt.zero_grad()
                loss_fn(run_stages(ref, x), y).backward()
                bad += [f"{where} step {step}: {g} grad differs" for g in _grads_differ(modules, ref, mine)]
                opt.step()
                ref_opt.step()
        finally:
            undo()
        for s in mine:
            for (pn, p), q in zip(modules[s].named_parameters(), ref[s].parameters()):
                if not torch.allclose(_full(p), q.detach(), **TOL):
                    bad.append(f"{where}: stage {s} {pn} differs from the unsplit model after {STEPS} steps")
        actions = [str(a) for a in sched.schedule.actions[layout.pp_rank]]
        unshards = {s: sum(a == f"{s}UNSHARD" for a in actions) for s in mine}
        gathers = {s: [counts.gathers[id(g)] for g in counts.groups_of[s]] for s in mine}
        out.append(dict(where=where, bad=bad, peak=counts.peak / P, unshards=unshards, gathers=gathers,
                        scatters=dict(counts.scatters), after=counts.after, actions=actions, steps=STEPS))
    return out


def _last_grad_write(actions: list[str], stage: int) -> int:
    """Position of the stage's last B or W in a rank's lowered actions (their text: ``3B7``, ``3W7``)."""
    return max(i for i, a in enumerate(actions) if a.startswith(f"{stage}B") or a.startswith(f"{stage}W"))


@pytest.mark.timeout(300)
def test_interleaved_budgets_are_exact_gather_as_planned_and_hold_at_most_the_promised_peak():
    cases = [("interleaved_1f1b", 4, None), ("interleaved_1f1b", 4, 3), ("interleaved_1f1b", 4, 2)]
    per_rank = rank_values(_run, 4, cases, timeout=240)
    for rank, results in per_rank.items():
        for (name, v, budget), r in zip(cases, results):
            assert not r["bad"], "\n".join(r["bad"][:10])
            for s, counts in r["gathers"].items():  # every group gathers once per UNSHARD of its stage (no plan: once)
                per_step = r["unshards"][s] if budget is not None else 1
                assert counts == [per_step * r["steps"]] * len(counts), (r["where"], s, counts, r["unshards"])
            total = sum(r["unshards"].values())
            if budget is None:
                assert r["peak"] <= 2.0 + 1e-6, (r["where"], r["peak"])
            if budget == 3:
                assert r["peak"] <= 1.75 + 1e-6, (r["where"], r["peak"])
                # torch 2.13 at its budget of 3 stages: 112 all-gathers over 32 groups (2 ranks x 4 stages x 2 dp
                # x 2 groups), i.e. 14 per stage on a rank's 4 stages
                assert total < 14, (r["where"], total)
            if budget == 2:
                assert r["peak"] <= 1.5 + 1e-6, (r["where"], r["peak"])
            # each stage's reduce-scatters were issued at its REDUCE_GRAD (no plan: within its last B or W), with
            # nothing but messages and parameter actions between its last B or W and it
            acts = r["actions"]
            for s in r["unshards"]:
                issued = next(a for a, sc in r["after"] if sc[s] == r["scatters"][s])
                want = f"{s}REDUCE_GRAD" if budget is not None else acts[_last_grad_write(acts, s)]
                assert issued == want, (r["where"], s, issued)
                if budget is None:
                    continue
                between = acts[_last_grad_write(acts, s) + 1:acts.index(issued)]
                assert all(any(k in a for k in ("SEND", "RECV", "SHARD", "REDUCE")) for a in between), \
                    (r["where"], s, between)


@pytest.mark.long
@pytest.mark.timeout(600)
def test_every_multi_stage_schedule_under_every_budget_it_accepts_is_exact():
    """The zero-bubble split included: a W after its stage was resharded finds it gathered again (W is a use)."""
    cases = [("interleaved_1f1b", 2, 1), ("interleaved_1f1b", 4, 1), ("looped_bfs", 2, 1), ("interleaved_zb", 2, 1),
             ("zbv", 2, 1), ("zbv", 2, 2), ("v_half", 2, 1), ("v_min", 2, 1), ("dualpipev", 2, 2)]
    per_rank = rank_values(_run, 4, cases, timeout=540)
    for rank, results in per_rank.items():
        for r in results:
            assert not r["bad"], "\n".join(r["bad"][:10])
            for s, counts in r["gathers"].items():
                assert counts == [r["unshards"][s] * r["steps"]] * len(counts), (r["where"], s, counts)


def _refusals_and_hooks(rank: int, world: int) -> dict[str, str]:
    """What a user is told: FSDP's default without a budget, a budget DualPipeV cannot run under, a budget on
    stages that are not sharded; and a custom function registered for UNSHARD / RESHARD / REDUCE_GRAD runs."""
    import warnings

    from torch.distributed.fsdp import fully_shard

    import pipeline_ext as pe

    mesh = pe.pipeline_mesh(pp=PP, dp=DP, device_type="cpu")
    said: dict[str, str] = {}

    def stages(name: str, shard: bool, reshard_after_forward: bool = False):
        layout = pe.pipeline_layout(mesh, name, stages_per_rank=2)
        mods = _equal_stages(layout.num_stages)
        for s in layout.stages:
            if shard:
                fully_shard(mods[s].block, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
                fully_shard(mods[s], mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
        return layout, mods, [pe.PipelineStage(mods[s], s, layout.num_stages, "cpu", group=mesh["pp"])
                              for s in layout.stages]

    _, _, st = stages("interleaved_1f1b", True, reshard_after_forward=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pe.ScheduleInterleaved1F1B(st, M, loss_fn=loss_fn)
    said["default"] = " | ".join(str(w.message) for w in caught if "reshard_after_forward" in str(w.message))
    for key, name, shard, budget in (("pair", "dualpipev", True, 1), ("plain", "interleaved_1f1b", False, 2)):
        _, _, st = stages(name, shard)
        try:
            pe.get_schedule_class(name)(st, M, loss_fn=loss_fn, max_active_stages=budget)
            said[key] = "no error"
        except Exception as exc:  # noqa: BLE001 - the message is what the test checks
            said[key] = f"{type(exc).__name__}: {exc}"
    layout, mods, st = stages("interleaved_1f1b", True)
    sched = pe.ScheduleInterleaved1F1B(st, M, loss_fn=loss_fn, max_active_stages=1)
    seen: list[str] = []

    def replace_unshard(action, ctx):  # torch's signature; it does the gather itself, as torch's own would
        seen.append(str(action))
        for m in (mods[action.stage_index].block, mods[action.stage_index]):
            m.unshard()

    def log_only(action, ctx):
        seen.append(str(action))

    sched.register_custom_function("UNSHARD", replace_unshard)
    sched.register_custom_function("RESHARD", log_only)  # never frees: parameters simply stay gathered
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(ROWS, 3, D, generator=g), torch.randn(ROWS, 3, D, generator=g)
    rows = slice(layout.dp_rank * ROWS // DP, (layout.dp_rank + 1) * ROWS // DP)
    sched.step(*((x[rows],) if 0 in layout.stages else ()), target=y[rows] if 3 in layout.stages else None)
    planned = [str(a) for a in sched.schedule.actions[layout.pp_rank] if "SHARD" in str(a)]
    said["custom"] = "same" if seen == planned else f"ran {seen}, planned {planned}"
    return said


@pytest.mark.timeout(300)
def test_fsdp_default_warns_bad_budgets_are_refused_by_name_and_custom_functions_run_in_their_place():
    for rank, said in rank_values(_refusals_and_hooks, 4, timeout=240).items():
        assert "max_active_stages" in said["default"] and "all-gathers" in said["default"], said["default"]
        assert "overlapped pair" in said["pair"] and "max_active_stages=1" in said["pair"], said["pair"]
        assert "not fully_shard'ed" in said["plain"], said["plain"]
        assert said["custom"] == "same", said["custom"]
