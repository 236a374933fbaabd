"""Failing loudly and quickly: failures, bad input, memory bounds, determinism.

Each test here is one line of docs/robustness.md. Multi-process tests use a
10 s channel timeout and tests/mp_utils.run_ranks (hard timeout, cleanup).
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from torch import nn

import pipeline_ext as pe
from models import build, loss_fn, make_batch
from mp_utils import no_complaints, run_ranks, device_under_test

TIMEOUT = 10.0


def _failure_timeout() -> float:
    """The peer-failure test's timeout: short on CPU stages, where a stalled or stopped peer waits it out
    and nothing else comes near it; NCCL's first connection on a GPU takes seconds of its own."""
    return 4.0 if device_under_test().type == "cpu" else TIMEOUT


class FailAt(nn.Module):
    """Linear layer that misbehaves on one call: raise, exit the process, stall, or stop (SIGSTOP) the process."""

    def __init__(self, when: int, how: str = "raise") -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.when, self.how, self.calls = when, how, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.when:
            if self.how == "raise":
                raise ValueError("boom in stage module")
            if self.how == "exit":
                os._exit(3)
            if self.how == "sigstop":  # frozen, as a rank stopped by a debugger or the OS: never answers
                os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(_failure_timeout() + 3)  # stall past the peer's timeout, then fail so the process ends
            raise ValueError("stalled stage gives up")
        return self.lin(x)


# -- failures ---------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_single_process_failure_stops_every_worker_fast_and_names_where():
    # The pipe's timeout (1000 s) is far past the test's (60 s): the step can only end in time if the
    # failure woke the other workers; had they waited out their timeout, the test would fail on its own.
    model = nn.Sequential(nn.Linear(16, 16), FailAt(when=3), nn.Linear(16, 4))
    pipe = pe.Pipe(model, balance=[1, 1, 1], devices=["cpu"] * 3, chunks=4, schedule="1f1b", timeout=1000.0,
                   checkpoint="never")  # with recomputation the 3rd call would be microbatch 0's re-run
    x, y = make_batch("mlp", 8)
    with pytest.raises(ValueError, match="boom in stage module") as info:
        pipe.step(x, target=y, loss_fn=loss_fn)
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "rank 1 in F of stage 1, microbatch 2" in notes
    model[1].when = -1  # the pipe is usable again after a failure
    pipe.step(x, target=y, loss_fn=loss_fn)


def _peer_failure(rank: int, world: int, how: str) -> tuple[float, str]:
    import torch.distributed as dist

    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid())
    torch.manual_seed(0)
    module = nn.Linear(16, 16) if rank == 0 else nn.Sequential(FailAt(when=2, how=how), nn.Linear(16, 4))
    stage = pe.PipelineStage(module.to(device_under_test()), rank, world, device_under_test())
    sched = pe.Schedule1F1B(stage, 4, loss_fn=loss_fn, timeout=_failure_timeout())
    x, y = make_batch("mlp", 8)
    t0 = time.monotonic()
    try:
        sched.step(x) if rank == 0 else sched.step(target=y)
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return time.monotonic() - t0, f"{type(exc).__name__}: {exc}"
    finally:
        if how in ("sigstop", "stall") and rank == 0:
            os.kill(pids[1], signal.SIGKILL)  # the stopped rank never ends by itself; the stalled one would only later
    return time.monotonic() - t0, "no error"


@pytest.mark.isolated
@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["raise", "exit", "stall", "sigstop"])
@pytest.mark.usefixtures("rank_device")
def test_multi_process_peer_failure_makes_others_raise_within_timeout(how):
    results = run_ranks(_peer_failure, 2, how, timeout=60, expect_errors=True)
    status, value = results[0]
    assert status == "ok", value
    _, message = value  # a wait past _failure_timeout() would run into the test's own timeout
    assert "peer rank 1" in message and "microbatch" in message, message
    if how in ("stall", "sigstop"):
        assert "TimeoutError" in message or "ChannelTimeout" in message, message
    if how == "raise":
        assert "boom in stage module" in results[1][1][1]


def _shape_change(rank: int, world: int) -> str:
    class Flip(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.wide = nn.Linear(16, 16), False

        def forward(self, x):  # output width depends on state, not on the input's shape
            out = self.lin(x)
            return torch.cat([out, out], dim=1) if self.wide else out

    module = Flip() if rank == 0 else nn.Linear(16, 4)
    stage = pe.PipelineStage(module, rank, world, "cpu")
    sched = pe.ScheduleGPipe(stage, 2, loss_fn=loss_fn, timeout=TIMEOUT)
    x, y = make_batch("mlp", 4)
    sched.step(x) if rank == 0 else sched.step(target=y)
    if rank == 0:
        module.wide = True
    try:
        sched.step(x) if rank == 0 else sched.step(target=y)
    except Exception as exc:  # noqa: BLE001
        return str(exc)
    return "no error"


@pytest.mark.isolated
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_shape_change_without_input_change_names_stages_and_shapes():
    results = run_ranks(_shape_change, 2, timeout=60, expect_errors=True)
    message = results[0][1]
    assert "stage 0" in message and "stage 1" in message, message
    assert "[2, 16]" in message and "[2, 32]" in message, message


# -- bad input, before any communication ---------------------------------------------------------
_BAD_TIMEOUTS = [float("inf"), float("nan"), 0, -1, True, "5"]


@pytest.mark.parametrize("bad", _BAD_TIMEOUTS, ids=repr)
def test_pipe_refuses_a_timeout_that_is_not_a_positive_finite_number(bad):
    with pytest.raises(ValueError, match=r"timeout must be a positive, finite number of seconds \(or None: no limit\)"):
        pe.Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), balance=[1, 1], devices=["cpu", "cpu"], timeout=bad)
    assert pe.Pipe(nn.Sequential(nn.Linear(4, 4)), devices=["cpu"], timeout=None).timeout is None


def _timeouts_checked(rank: int, world: int) -> list[str]:
    said = []
    for bad in _BAD_TIMEOUTS:
        try:
            pe.Schedule1F1B(pe.PipelineStage(nn.Linear(16, 16), rank, world, "cpu"), 2, loss_fn=loss_fn, timeout=bad)
            said.append(f"timeout={bad!r} accepted")
        except ValueError as exc:
            if "timeout must be a positive, finite number of seconds (or None: the process group's" not in str(exc):
                said.append(str(exc))
    sched = pe.Schedule1F1B(pe.PipelineStage(nn.Linear(16, 16), rank, world, "cpu"), 2, loss_fn=loss_fn, timeout=None)
    if sched.timeout != 60.0:  # mp_utils makes the group with a 60 s timeout
        said.append(f"timeout=None gave {sched.timeout}, not the group's 60 s")
    return said


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_schedules_refuse_a_bad_timeout_at_construction_and_none_is_the_groups():
    no_complaints(_timeouts_checked, 2, timeout=40)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: pe.schedules.build("1f1b", 4, 2), "1f1b needs n_microbatches >= num_ranks"),
        (lambda: pe.schedules.build("interleaved_1f1b", 3, 7, stages_per_rank=2), "interleaved_1f1b needs n_micro"),
        (lambda: pe.schedules.build("zbv", 2, 4, stages_per_rank=1), "stages_per_rank"),
        (lambda: pe.schedules.build("dualpipev", 2, 3, stages_per_rank=2), "dualpipev needs n_microbatches >= 2"),
    ],
)
def test_schedule_constraints_name_constraint_and_values(make, match):
    with pytest.raises(pe.schedules.ScheduleError, match=match):
        make()


def _batch_too_small(rank: int, world: int) -> str:
    stage = pe.PipelineStage(nn.Linear(16, 16) if rank == 0 else nn.Linear(16, 4), rank, world, "cpu")
    sched = pe.Schedule1F1B(stage, 4, loss_fn=loss_fn, timeout=TIMEOUT)
    x, y = make_batch("mlp", 3 if rank == 0 else 8)  # only rank 0's batch is too small
    try:
        sched.step(x) if rank == 0 else sched.step(target=y)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    finally:
        # Rank 0 raises at once, its record on its way; a loop goes on (here: waits for its peer) while the
        # peer takes it. A rank that ends its process first leaves its peer a "failed or is gone" error instead.
        torch.distributed.barrier()
    return "no error"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_batch_smaller_than_microbatches_fails_on_every_rank_before_communication():
    results = run_ranks(_batch_too_small, 2, timeout=40)
    assert "ValueError" in results[0][1] and "must not exceed the batch size" in results[0][1]
    said = results[1][1]
    assert "StepRejectedError" in said and "rank 0: ValueError" in said and "must not exceed the batch size" in said


def test_non_tensor_stage_output_is_a_clear_error():
    class Bad(nn.Module):
        def forward(self, x):
            return x, {"not": "a tensor"}

    pipe = pe.Pipe(nn.Sequential(Bad(), nn.Linear(16, 4)), balance=[1, 1], devices=["cpu"] * 2, chunks=2)
    with pytest.raises(TypeError, match="stage 0 returned a dict at output position 1"):
        pipe.step(torch.randn(4, 16), target=torch.randn(4, 4), loss_fn=loss_fn)


def _inputs_untouched(rank: int, world: int) -> bool:
    stage = pe.PipelineStage(nn.Linear(16, 16) if rank == 0 else nn.Linear(16, 4), rank, world, "cpu")
    sched = pe.ScheduleZBH1(stage, 3, loss_fn=loss_fn)
    x, y = make_batch("mlp", 7)
    x0, y0 = x.clone(), y.clone()
    sched.step(x) if rank == 0 else sched.step(target=y)
    return torch.equal(x, x0) and torch.equal(y, y0) and not x.requires_grad and x.grad is None


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_multi_process_inputs_and_targets_not_mutated():
    results = run_ranks(_inputs_untouched, 2, timeout=40)
    assert all(v for _, v in results.values())


# -- memory -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, bound", [("1f1b", lambda p, m: p), ("gpipe", lambda p, m: m)])
def test_rank0_holds_at_most_its_schedules_activations(name, bound):
    p, m = 4, 8
    pipe = pe.Pipe(nn.Sequential(*build("mlp", p)), balance=[1] * p, devices=["cpu"] * p, chunks=m, schedule=name)
    x, y = make_batch("mlp", 16)
    pipe.step(x, target=y, loss_fn=loss_fn)
    assert pipe.peak_live_microbatches[0] == bound(p, m), pipe.peak_live_microbatches


def test_a_rank_holding_more_microbatches_than_its_schedule_promises_raises(monkeypatch):
    """The executor holds every rank to the simulator's peak (what choosing a schedule by memory relies on)."""
    from pipeline_ext.runtime.stage import StageError, StageRunner

    # stage 0's runner kept one microbatch too many (as a leak past its backward would); only that one, so the
    # error cannot come from another rank first, whichever worker thread runs first
    monkeypatch.setattr(StageRunner, "live_microbatches",
                        property(lambda self: len(self._states) + (self.stage_index == 0)))
    pipe = pe.Pipe(nn.Sequential(*build("mlp", 2)), balance=[1, 1], devices=["cpu"] * 2, chunks=4, schedule="1f1b")
    x, y = make_batch("mlp", 8)
    with pytest.raises(StageError, match=r"rank 0 holds the activations of 3 microbatches after the F of stage 0, "
                                         r"microbatch 1, more than the 2 schedule '1f1b' promises"):
        pipe.step(x, target=y, loss_fn=loss_fn)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _steps_rss(rank: int, world: int, steps: int) -> tuple[int, int, dict]:
    modules = build("mlp", world)
    stage = pe.PipelineStage(modules[rank], rank, world, "cpu")
    sched = pe.Schedule1F1B(stage, 4, loss_fn=loss_fn)
    x, y = make_batch("mlp", 32)
    rss = []
    for i in range(steps):
        sched.step(x) if rank == 0 else sched.step(target=y)
        if i in (19, steps - 1):
            rss.append(_rss_bytes())
    return rss[0], rss[1], sched.peak_live_microbatches


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_multi_process_200_steps_no_memory_growth_and_1f1b_bound():
    results = run_ranks(_steps_rss, 2, 200, timeout=100)
    for rank, (_, (warm, end, peaks)) in results.items():
        assert end <= warm * 1.05, f"rank {rank}: RSS {warm} -> {end}"
        assert max(peaks.values()) <= 2, peaks  # 1F1B: at most p microbatches live


@pytest.mark.timeout(120)
def test_single_process_200_steps_no_memory_growth():
    pipe = pe.Pipe(nn.Sequential(*build("blocks", 2)), balance=[1, 1], devices=["cpu"] * 2, chunks=4, schedule="zb_h1")
    x, y = make_batch("blocks", 16)
    for i in range(200):
        pipe.zero_grad()
        pipe.step(x, target=y, loss_fn=loss_fn)
        if i == 19:
            warm = _rss_bytes()
    assert _rss_bytes() <= warm * 1.05


# -- determinism ------------------------------------------------------------------------------------
def _train_once(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.2), nn.GELU()) for _ in range(4)], nn.Linear(16, 4))
    pipe = pe.Pipe(model, balance=[2, 3], devices=["cpu"] * 2, chunks=4, schedule="zb_h1", checkpoint="except_last")
    x, y = make_batch("mlp", 10, seed=seed)
    losses = [pipe.step(x, target=y, loss_fn=loss_fn) for _ in range(2)]
    return losses, [p.grad.clone() for p in model.parameters()]


def test_same_seed_gives_bitwise_identical_losses_and_gradients():
    (l1, g1), (l2, g2) = _train_once(5), _train_once(5)
    assert all(torch.equal(a, b) for a, b in zip(l1, l2))
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    (l3, _) = _train_once(6)
    assert not torch.equal(l1[0], l3[0])


def _two_runs(rank: int, world: int) -> bool:
    out = []
    for _ in range(2):
        modules = build("blocks", world, seed=1)
        stage = pe.PipelineStage(modules[rank], rank, world, "cpu")
        sched = pe.ScheduleZBH1(stage, 4, loss_fn=loss_fn)
        x, y = make_batch("blocks", 9, seed=2)
        losses: list = []
        sched.step(x) if rank == 0 else sched.step(target=y, losses=losses)
        out.append((losses, [p.grad for p in modules[rank].parameters()]))
    (l1, g1), (l2, g2) = out
    return all(torch.equal(a, b) for a, b in zip(l1, l2)) and all(torch.equal(a, b) for a, b in zip(g1, g2))


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("transport")
def test_multi_process_runs_are_bitwise_identical():
    results = run_ranks(_two_runs, 2, timeout=40)
    assert all(v for _, v in results.values())
