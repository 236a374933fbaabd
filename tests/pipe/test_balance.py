"""Stages balanced by measured cost: the search (on known costs, no timing), the profiler, and a split run across processes.

The partitioner's promise is a simulated step no longer than the equal-count
split's, and the best one where all splits can be tried (checked here by
brute force); the profiler's, one entry per layer with positive times and
``pe.activation_bytes``' count; the split's, that cutting elsewhere never
changes the math (2 ranks over Gloo against the unsplit model). No assertion
reads a wall clock.
"""
from __future__ import annotations

import copy
import random
from itertools import combinations

import pytest
import torch
from torch import nn

import pipeline_ext as pe
from pipeline_ext import schedules as S
from pipeline_ext.demo.model import GPTConfig, gpt_layers, lm_loss, synthetic_batch

from mp_utils import run_ranks
from models import ATOL, RTOL



def _synthetic(k: int, seed: int) -> list[S.LayerCost]:
    """An embedding (cheap), blocks of uneven cost, a head with its loss (heavy)."""
    rnd = random.Random(seed)
    blocks = [S.LayerCost(rnd.uniform(0.5, 1.5), rnd.uniform(0.5, 1.5), rnd.uniform(0.2, 1.0),
                          activation_bytes=rnd.uniform(1, 3), input_bytes=0.5) for _ in range(k - 2)]
    return [S.LayerCost(0.2, 0.0, 0.3, 0.5), *blocks, S.LayerCost(3.0, 2.5, 1.5, 4.0, 0.5)]


def _brute_force(schedule: S.Schedule, layers, budget=None) -> float:
    k, n, best = len(layers), schedule.num_stages, float("inf")
    for cuts in combinations(range(1, k), n - 1):
        b = (0, *cuts, k)
        bal = S.evaluate_split(schedule, layers, [b[i + 1] - b[i] for i in range(n)])
        if budget is None or max(bal.peak_bytes) <= budget:
            best = min(best, bal.makespan)
    return best


CASES = [("1f1b", 2, 1), ("1f1b", 3, 1), ("zb_h1", 3, 1), ("interleaved_1f1b", 2, 2), ("zbv", 2, 2)]


@pytest.mark.parametrize("name,p,v", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_balanced_split_is_optimal_on_small_cases_and_no_worse_than_equal(name, p, v, seed):
    layers = _synthetic(9, seed)
    sched = S.build(name, p, 4, stages_per_rank=v)
    bal = S.balance_stages(layers, sched)
    equal = S.evaluate_split(sched, layers, S.equal_sizes(len(layers), sched.num_stages))
    assert sum(bal.sizes) == len(layers) and min(bal.sizes) >= 1 and len(bal.sizes) == sched.num_stages
    assert bal.makespan <= equal.makespan
    assert bal.makespan == pytest.approx(_brute_force(sched, layers), rel=1e-12)
    assert bal.makespan == pytest.approx(S.simulate(sched, S.stage_costs(layers, bal.sizes)).makespan)


@pytest.mark.parametrize("name,p,v", [("1f1b", 4, 1), ("zb_h1", 4, 1), ("zbv", 4, 2)])
def test_local_search_on_many_layers_beats_equal_and_min_max(name, p, v):
    layers = _synthetic(34, 3)
    sched = S.build(name, p, 8, stages_per_rank=v)
    bal = S.balance_stages(layers, sched)  # 33 choose 3 (or 7) splits: above the exhaustive limit
    n = sched.num_stages
    equal = S.evaluate_split(sched, layers, S.equal_sizes(len(layers), n))
    min_max = S.evaluate_split(sched, layers, S.split_min_max([x.total for x in layers], n))
    assert bal.makespan <= min(equal.makespan, min_max.makespan)
    assert bal.makespan < equal.makespan  # the heavy head makes the equal split visibly worse


def test_local_search_alone_reaches_the_optimum_on_a_small_case():
    layers = _synthetic(9, 0)
    sched = S.build("1f1b", 3, 4)
    assert S.balance_stages(layers, sched, exhaustive_limit=0).makespan == pytest.approx(_brute_force(sched, layers))


def test_memory_budget_is_kept_or_refused():
    layers = _synthetic(9, 1)
    sched = S.build("1f1b", 2, 4)
    free = S.balance_stages(layers, sched)
    lowest = min(max(S.evaluate_split(sched, layers, [i, 9 - i]).peak_bytes) for i in range(1, 9))
    budget = (lowest + max(free.peak_bytes)) / 2
    if max(free.peak_bytes) > lowest:  # the fastest split is not the leanest: a budget between them changes it
        bal = S.balance_stages(layers, sched, budget_bytes=budget)
        assert max(bal.peak_bytes) <= budget
        assert bal.makespan == pytest.approx(_brute_force(sched, layers, budget))
    with pytest.raises(S.ScheduleError, match="budget_bytes"):
        S.balance_stages(layers, sched, budget_bytes=lowest * 0.99)


def test_stage_bytes_count_a_shared_boundary_once():
    layers = [S.LayerCost(1, 1, 0, activation_bytes=10, input_bytes=4, param_bytes=100)] * 2
    one = S.evaluate_split(S.build("gpipe", 1, 1), layers, [2])
    assert one.peak_bytes == [10 + 10 - 4 + 200]


def test_profiler_gives_one_positive_entry_per_layer_and_exact_bytes():
    torch.manual_seed(0)
    lin = nn.Linear(4, 8)
    x = torch.randn(2, 4)
    layers = [lin, nn.ReLU(), nn.Linear(8, 3)]
    before = [p.detach().clone() for p in nn.ModuleList(layers).parameters()]
    y = torch.randn(2, 3)
    costs = pe.profile_layers(layers, (x,), loss_fn=nn.functional.mse_loss, target=y, repeats=2)
    assert len(costs) == 3
    assert all(c.f > 0 and c.b + c.w > 0 for c in costs)
    # Linear(4, 8) on 2x4 floats: its input (32 bytes, also what it saves) and its output (64 bytes)
    assert costs[0].activation_bytes == pe.activation_bytes(lin, x) == 96
    assert costs[0].input_bytes == 32 and costs[0].param_bytes == (32 + 8) * 4
    assert costs[1].w == 0.0 and costs[1].param_bytes == 0  # no parameters: all of its backward is input-grad
    # the loss is the last layer's: its saved tensors count there
    without = pe.profile_layers(layers, (x,), repeats=1)
    assert costs[2].activation_bytes > without[2].activation_bytes
    # the model is untouched
    assert all(p.grad is None for p in nn.ModuleList(layers).parameters())
    assert all(torch.equal(p, q) for p, q in zip(nn.ModuleList(layers).parameters(), before))


def test_profiler_and_chain_take_tuple_outputs_as_next_arguments():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, scale=None):
            return self.lin(x), (scale if scale is not None else torch.ones(()))

    class Use(nn.Module):
        def forward(self, x, s):
            return x * s

    layers = [Pair(), Use()]
    x, scale = torch.randn(3, 4), torch.tensor(2.0)
    costs = pe.profile_layers(layers, (x,), {"scale": scale}, repeats=1)
    assert len(costs) == 2
    chain = pe.LayerChain(*layers)
    assert torch.equal(chain(x, scale=scale), layers[0].lin(x) * 2)


def _split_run(rank: int, world: int) -> list[str]:
    """Balance a small GPT (profiled on rank 0, broadcast), run 1F1B on 2 ranks, compare with the unsplit model."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    cfg = GPTConfig(vocab=256, seq_len=16, d_model=32, heads=2, layers=4)
    layers = gpt_layers(cfg)
    x, y = synthetic_batch(cfg, 8, 0)
    m = 4
    bal = pe.balance_layers(layers, (x[:2],), "1f1b", num_ranks=world, microbatches=m, loss_fn=lm_loss,
                            target=y[:2], repeats=2)
    sizes = [None]
    if rank == 0:
        sizes = [bal.sizes]
    dist.broadcast_object_list(sizes, src=0)
    bad = [] if sizes[0] == bal.sizes else [f"rank {rank} split {bal.sizes}, rank 0's {sizes[0]}"]
    reference = [copy.deepcopy(layer) for layer in layers]  # the same weights, unsplit
    ref_loss = lm_loss(pe.LayerChain(*reference)(x), y)
    ref_loss.backward()
    stages = pe.stage_modules(layers, bal.sizes)
    ref_stages = pe.stage_modules(reference, bal.sizes)
    stage = pe.PipelineStage(stages[rank], rank, world, "cpu")
    sched = pe.Schedule1F1B(stage, m, loss_fn=lm_loss)
    losses: list[torch.Tensor] = []
    sched.step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None, losses=losses)
    if rank == world - 1:
        loss = sum(losses) / m
        if not torch.allclose(loss, ref_loss, rtol=RTOL, atol=ATOL):
            bad.append(f"loss {float(loss)} vs unsplit {float(ref_loss)}")
    for (name, p), q in zip(stages[rank].named_parameters(), ref_stages[rank].parameters()):
        if p.grad is None or not torch.allclose(p.grad, q.grad, rtol=RTOL, atol=ATOL):
            bad.append(f"rank {rank} {name}: grad differs from the unsplit model's")
    return bad


@pytest.mark.timeout(120)
def test_model_split_by_the_balancer_matches_unsplit_on_two_ranks():
    results = run_ranks(_split_run, 2, timeout=100)
    bad = [b for _, (_, errs) in sorted(results.items()) for b in errs]
    assert not bad, bad


def test_block_ranges_put_the_ends_on_the_first_and_last_stages():
    assert pe.block_ranges([2, 3, 3, 2]) == [(0, 1), (1, 4), (4, 7), (7, 8)]
    assert pe.block_ranges([1, 4, 4, 1]) == [(0, 0), (0, 4), (4, 8), (8, 8)]  # embedding alone, head alone
    assert pe.block_ranges([10]) == [(0, 8)]
    assert pe.block_ranges([3, 1], first=2, last=0) == [(0, 1), (1, 2)]
    for blocks in ([1, 3, 3, 1], [0, 4, 4, 0], [8], [8, 0]):
        ranges = pe.block_ranges(pe.sizes_with_ends(blocks))
        assert [hi - lo for lo, hi in ranges] == blocks and ranges[0][0] == 0 and ranges[-1][1] == 8
    with pytest.raises(ValueError, match="non-empty"):
        pe.block_ranges([2, 0, 2])
    with pytest.raises(ValueError, match="middle stage empty"):
        pe.sizes_with_ends([2, 0, 2])
