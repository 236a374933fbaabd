"""Every rank agrees on every step, or every rank says why (comm/agreement.py).

The loops here are the ones users write: catch the library's error, skip the
batch, go on; validate between training steps; and the accidents of a
multi-process job (a different n_microbatches, schedule or loss_fn on one
rank, a rank that never calls step(), a rank that dies). The steps that follow
a caught error are compared with the unsplit model on the batches that were
accepted: one step apart would show up as wrong gradients.
"""
from __future__ import annotations

import os
import time
from typing import Optional

import pytest
import torch

from models import ATOL, build, loss_fn, make_batch, RTOL, run_stages
from mp_utils import no_complaints, rank_values, run_ranks, device_under_test
from pipeline_ext.comm.agreement import (MAX_MICROBATCHES, MAX_SIGNATURES, StepAgreementError, StepRecord,
                                         StepRejectedError, agree, sizes_digest)

TIMEOUT = 10.0


# -- the decision, without processes ---------------------------------------------------------------
def _record(rank: int, **kw) -> StepRecord:
    base = dict(rank=rank, step=3, kind=1, schedule="1f1b", schedule_key=11, n_microbatches=4, num_stages=2,
                has_loss=True, microbatches=(99, 98, 99, 97) if rank == 0 else (), rows=8 if rank == 0 else 0,
                sizes=sizes_digest([2, 2, 2, 2]) if rank == 0 else 0, target_rows=8 if rank == 1 else -1,
                target_sizes=sizes_digest([2, 2, 2, 2]) if rank == 1 else 0)
    base.update(kw)
    return StepRecord(**base)


@pytest.mark.parametrize(
    "other, match",
    [
        (dict(step=4), r"out of step: rank 0 is at step 3, rank 1 is at step 4"),
        (dict(kind=2), r"rank 0 runs a training step, rank 1 runs a forward-only step \(eval\(\)"),
        (dict(n_microbatches=2, schedule_key=12),
         r"rank 0 runs 1f1b with 4 microbatches over 2 stages, rank 1 runs 1f1b with 2 microbatches"),
        (dict(schedule="gpipe", schedule_key=13), r"rank 1 runs gpipe with 4 microbatches"),
        (dict(has_loss=False), r"rank 0 has a loss_fn, rank 1 has no loss_fn"),
    ],
)
def test_disagreements_are_named_in_words(other, match):
    for order in ([_record(0), _record(1, **other)], [_record(1, **other), _record(0)]):  # same on every rank
        with pytest.raises(StepAgreementError, match=match):
            agree(order, first_rank=0, last_rank=1)


def test_a_rejection_names_the_rank_and_its_reason_on_every_rank():
    with pytest.raises(StepRejectedError, match=r"step 3 was rejected before any activation moved \(rank 1: ValueError: "
                                                r"no target\)"):
        agree([_record(0), _record(1, rejected="ValueError: no target")], 0, 1)
    with pytest.raises(StepRejectedError, match="the target on rank 1 has 6 rows but the batch on rank 0 has 8"):
        agree([_record(0), _record(1, target_rows=6)], 0, 1)
    with pytest.raises(StepRejectedError, match=r"the target's microbatches on rank 1 have other rows than the "
                                                r"inputs' microbatches on rank 0 \(8 rows in all on both\)"):
        agree([_record(0), _record(1, target_sizes=sizes_digest([3, 1, 2, 2]))], 0, 1)


def test_two_hand_written_schedules_are_told_apart():
    """Same name and sizes, different actions: each rank's schedule is named by its digest."""
    records = [_record(0, schedule="custom", schedule_key=0x1234), _record(1, schedule="custom", schedule_key=0x5678)]
    with pytest.raises(StepAgreementError, match=r"rank 0 runs custom .*digest 0000000000001234.*rank 1 runs custom "
                                                 r".*digest 0000000000005678.*different actions or stage placement"):
        agree(records, 0, 1)


def test_ranks_on_different_transports_are_named():
    with pytest.raises(StepAgreementError, match=r"rank 0 asked for transport='shm', rank 1 asked for "
                                                 r"transport='process_group'.*same transport="):
        agree([_record(0, transport=3), _record(1, transport=1)], 0, 1)


def test_agreement_gives_every_rank_the_same_step():
    a = agree([_record(0), _record(1)], 0, 1)
    assert (a.step, a.microbatches, a.rediscover) == (3, (99, 98, 99, 97), False)
    # caches that differ (a step failed on one rank after the other committed its layouts): rediscover
    assert agree([_record(0, layouts=5), _record(1, layouts=6)], 0, 1).rediscover


def test_record_round_trip_and_a_foreign_record_is_named():
    r = _record(1, rejected="ValueError: " + "x" * 400, layouts=2**61 + 7)
    back = StepRecord.decode(r.encode(), 1)
    assert back.rejected.startswith("ValueError: xxx") and len(back.rejected.encode()) == 128
    assert back.layouts == 2**61 + 7 and back.schedule == "1f1b" and back.target_rows == 8
    assert back.target_sizes == sizes_digest([2, 2, 2, 2]) and back.microbatches == ()
    first = StepRecord.decode(_record(0).encode(), 0)
    assert first.microbatches == (99, 98, 99, 97) and first.sizes == sizes_digest([2, 2, 2, 2])
    # every microbatch a signature of its own, as many as a record describes; beyond that: None (not cached)
    many = tuple(range(2**60, 2**60 + MAX_SIGNATURES)) * (MAX_MICROBATCHES // MAX_SIGNATURES)
    assert StepRecord.decode(_record(0, n_microbatches=len(many), microbatches=many).encode(), 0).microbatches == many
    assert StepRecord.decode(_record(0, microbatches=None).encode(), 0).microbatches is None
    with pytest.raises(StepAgreementError, match="rank 1 sent a step record pipeline_ext cannot read"):
        StepRecord.decode([0] * len(r.encode()), 1)


# -- the loops, on 2 Gloo ranks ----------------------------------------------------------------------
def _schedule(rank: int, world: int, modules, name="1f1b", m=4, loss=loss_fn, timeout=TIMEOUT):
    import pipeline_ext as pe

    stage = pe.PipelineStage(modules[rank], rank, world, device_under_test())
    return pe.get_schedule_class(name)(stage, m, loss_fn=loss, timeout=timeout)


def _exact(modules, ref, rank: int) -> bool:
    """Whether this rank's stage has the unsplit model's gradients."""
    return all(torch.allclose(p.grad, q.grad, rtol=RTOL, atol=ATOL)
               for p, q in zip(modules[rank].parameters(), ref[rank].parameters()))


def _call(sched, rank: int, x, y, kind: str = "step"):
    if kind == "eval":
        return sched.eval(*((x,) if rank == 0 else ()))
    return sched.step(*((x,) if rank == 0 else ()), **({"target": y} if rank == 1 else {}))


def _catch_and_skip(rank: int, world: int) -> list[str]:
    """Rejections on one or both ranks, caught, and the loop goes on: the accepted steps must be exact."""
    modules, ref = build("mlp", world), build("mlp", world)
    sched = _schedule(rank, world, modules)
    said = []
    plan = [  # (batch rows, what goes wrong on which rank)
        (8, None), (0, "empty batch on both ranks"), (8, "no target on the last rank"), (12, None),
        (8, "eval between steps"), (8, None),
    ]
    for i, (n, trouble) in enumerate(plan):
        x, y = make_batch("mlp", max(n, 1), seed=i)
        x, y = x[:n], y[:n]
        try:
            if trouble == "no target on the last rank":
                sched.step(*((x,) if rank == 0 else ()))
            elif trouble == "eval between steps":
                out = _call(sched, rank, x, y, "eval")
                if rank == 1:
                    with torch.no_grad():
                        assert torch.allclose(out, run_stages(ref, x), rtol=RTOL, atol=ATOL)
                continue
            else:
                _call(sched, rank, x, y)
        except (ValueError, StepAgreementError) as exc:
            said.append(f"{i}:{type(exc).__name__}: {exc}")
            continue
        assert trouble is None, f"round {i} ({trouble}) was accepted on rank {rank}"
        loss_fn(run_stages(ref, x), y).backward()
    return said + [f"rank {rank}: gradients differ from the unsplit model on the accepted batches"] * (
        not _exact(modules, ref, rank))


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.usefixtures("rank_device")
def test_catch_and_skip_loop_stays_in_step_and_exact():
    said = rank_values(_catch_and_skip, 2, timeout=90)
    assert not [s for v in said.values() for s in v if "gradients differ" in s], said
    # round 1: both ranks reject their own empty input; round 2: rank 1 rejects, rank 0 is told why
    assert said[0][0].startswith("1:ValueError") and said[1][0].startswith("1:ValueError"), said
    assert said[0][1].startswith("2:StepRejectedError") and "rank 1: ValueError" in said[0][1], said
    assert "needs target=" in said[0][1] and said[1][1].startswith("2:ValueError"), said
    assert all(len(v) == 2 for v in said.values()), said


def _disagree(rank: int, world: int) -> list[str]:
    """Misconfigured ranks: every rank raises a named error, and both go on to the next case."""
    modules = build("mlp", world)
    x, y = make_batch("mlp", 8)
    cases = {
        "n_microbatches": dict(m=4 if rank == 0 else 2),
        "schedule": dict(name="1f1b" if rank == 0 else "gpipe"),
        "loss": dict(loss=loss_fn if rank == 1 else None),
    }
    said = []
    for case, kw in cases.items():
        sched = _schedule(rank, world, modules, **kw)
        try:
            _call(sched, rank, x, y)
            said.append(f"{case}: no error")
        except StepAgreementError as exc:
            said.append(f"{case}: {exc}")
    # Stage count: rank 0 cuts the model into 4 stages (two per rank), rank 1 into 2.
    import pipeline_ext as pe

    four = build("mlp", 2 * world)
    stages = [pe.PipelineStage(four[s], s, 2 * world, "cpu") for s in (rank, rank + world)]
    sched = (pe.ScheduleInterleaved1F1B(stages, 4, loss_fn=loss_fn, timeout=TIMEOUT) if rank == 0
             else _schedule(rank, world, modules))
    try:
        _call(sched, rank, x, y)
        said.append("stages: no error")
    except StepAgreementError as exc:
        said.append(f"stages: {exc}")
    sched = _schedule(rank, world, modules)
    try:
        _call(sched, rank, x, y, "eval" if rank == 0 else "step")
        said.append("plan: no error")
    except StepAgreementError as exc:
        said.append(f"plan: {exc}")
    _call(sched, rank, x, y)  # agreed again: the next step runs
    return said


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_disagreements_raise_named_errors_on_every_rank():
    results = run_ranks(_disagree, 2, timeout=90)
    for rank, (_, said) in results.items():
        assert "rank 0 runs 1f1b with 4 microbatches over 2 stages, rank 1 runs 1f1b with 2" in said[0], said
        assert "rank 1 runs gpipe" in said[1], said
        assert "rank 0 has no loss_fn, rank 1 has a loss_fn" in said[2], said
        assert "rank 0 runs interleaved_1f1b with 4 microbatches over 4 stages, rank 1 runs 1f1b with 4 " \
               "microbatches over 2 stages" in said[3], said
        assert "rank 0 runs a forward-only step (eval(), or step() without a loss_fn), rank 1 runs a training step" \
            in said[4], said


def _forward_only_without_loss(rank: int, world: int) -> list[str]:
    modules, ref = build("mlp", world), build("mlp", world)
    sched = _schedule(rank, world, modules, loss=None)
    x, _ = make_batch("mlp", 8)
    out = sched.step(*((x,) if rank == 0 else ()))
    bad = [f"rank {rank}: .grad was written" for p in modules[rank].parameters() if p.grad is not None]
    if rank == 1:
        with torch.no_grad():
            if not torch.allclose(out, run_stages(ref, x), rtol=RTOL, atol=ATOL):
                bad.append("output differs from the unsplit model")
    return bad


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_loss_fn_none_on_every_rank_is_a_forward_only_step():
    no_complaints(_forward_only_without_loss, 2, timeout=40)


def _absent_peer(rank: int, world: int, how: str, done: str) -> tuple[float, str]:
    import torch.distributed as dist

    dist.barrier()  # both ranks are through process-group start-up before rank 0 goes
    if rank == 0:
        if how == "exit":
            os._exit(3)
        # never calls step() within the peer's timeout: stays away until rank 1's step has ended (it marks
        # ``done``), or 11 s at most, instead of always sleeping the 11 s out
        deadline = time.monotonic() + 3 * 3 + 2
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
        return 0.0, "slept"
    sched = _schedule(rank, world, build("mlp", world), timeout=3.0)
    x, y = make_batch("mlp", 8)
    t0 = time.monotonic()
    try:
        _call(sched, rank, x, y)
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return time.monotonic() - t0, f"{type(exc).__name__}: {exc}"
    finally:
        open(done, "w").close()
    return time.monotonic() - t0, "no error"


@pytest.mark.isolated
@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["stall", "exit"])
def test_a_peer_that_never_comes_is_named_within_the_timeout(how, tmp_path):
    results = run_ranks(_absent_peer, 2, how, str(tmp_path / "rank-1-done"), timeout=60, expect_errors=True)
    status, value = results[1]
    assert status == "ok", value
    _, message = value  # a wait past timeout=3.0 would run into the test's own timeout
    assert "rank 1" in message and "step 0 with rank 0" in message, message
    if how == "stall":
        assert "ChannelTimeout" in message and "timed out after 3000 ms" in message, message


class _StopInForward(torch.nn.Module):
    """A stage that freezes its own process (SIGSTOP) in its first forward, as a debugger or an
    overloaded host would: its step record may be out, its layouts and data never are."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        import signal

        os.kill(os.getpid(), signal.SIGSTOP)
        return self.inner(x)


def _stopped_peer(rank: int, world: int) -> tuple[float, str]:
    """Rank 0 stops itself in the forward of the first (discovery) step; rank 1 must name it in time."""
    import signal

    import torch.distributed as dist

    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    modules = build("mlp", world)
    if rank == 0:
        modules[0] = _StopInForward(modules[0])
    sched = _schedule(rank, world, modules, timeout=3.0)
    x, y = make_batch("mlp", 8)
    t0 = time.monotonic()
    try:
        _call(sched, rank, x, y)
        said = "no error"
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        said = f"{type(exc).__name__}: {exc}"
    finally:
        if rank == 1:
            os.kill(pids[0], signal.SIGTERM)  # the frozen peer never wakes up by itself: end it
            os.kill(pids[0], signal.SIGCONT)
    return time.monotonic() - t0, said


@pytest.mark.isolated
@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.usefixtures("transport")
def test_a_stopped_peer_during_the_discovery_step_is_named_within_the_timeout():
    results = run_ranks(_stopped_peer, 2, timeout=60, expect_errors=True)
    status, value = results[1]
    assert status == "ok", value
    _, message = value  # a wait past timeout=3.0 would run into the test's own timeout
    # Frozen after posting its record: whether the record left before the freeze depends on Gloo's IO thread,
    # so rank 1 names either the record or the first activation it waits for; both name the peer and step.
    assert "ChannelTimeout" in message, message
    assert ("rank 1 waiting on RECV_F of stage 1 microbatch 0 with peer rank 0 in step 0" in message
            or "rank 1 receiving the step record of step 0 with rank 0" in message), message
    assert results[0][0] == "died", results[0]


class _FailBackward(torch.nn.Module):
    """Linear layer whose backward raises once in an armed step: in the output of forward call
    ``at_forward`` of that step, or (None) in whichever of its outputs' backward runs first."""

    def __init__(self, at_forward: Optional[int] = None) -> None:
        super().__init__()
        self.lin, self.at_forward, self.armed, self.calls = torch.nn.Linear(16, 16), at_forward, False, 0

    def arm(self, on: bool = True) -> None:
        self.armed, self.calls = on, 0

    def forward(self, x):
        out = self.lin(x)
        self.calls += 1
        if self.armed and self.at_forward in (None, self.calls):
            def boom(grad):
                if self.armed:
                    self.armed = False
                    raise ValueError("boom in backward")
            out.register_hook(boom)
        return out


def _install(modules, failing: _FailBackward) -> _FailBackward:
    """Put ``failing`` in place of stage 0's first layer, with the same weights."""
    failing.lin.load_state_dict(modules[0][0].state_dict())
    modules[0][0] = failing
    return failing


def _failure_after_the_last_message(rank: int, world: int) -> list[str]:
    """Rank 0 fails in its last backward of a discovery step, after every message of the step arrived:
    rank 1 commits the step's layouts, rank 0 does not. The next step of that shape must still be exact."""
    m = 4
    modules, ref = build("mlp", world), build("mlp", world)
    failing = _install(modules, _FailBackward(at_forward=m)) if rank == 0 else None
    sched = _schedule(rank, world, modules, m=m)
    x, y = make_batch("mlp", 8)
    said = []
    if failing is not None:
        failing.arm()
    try:
        _call(sched, rank, x, y)
        said.append("no error")
    except ValueError as exc:
        said.append(str(exc))
    for mod in modules:
        mod.zero_grad(set_to_none=True)
    _call(sched, rank, x, y)  # same shape: a known step on rank 1, an unknown one on rank 0
    loss_fn(run_stages(ref, x), y).backward()
    if not _exact(modules, ref, rank):
        said.append(f"rank {rank}: gradients differ after the failed step")
    return said


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_failure_after_the_last_message_of_a_discovery_step():
    said = rank_values(_failure_after_the_last_message, 2)
    assert said[0] == ["boom in backward"] and said[1] == ["no error"], said


def _messages_left_behind(rank: int, world: int) -> list[str]:
    """GPipe: rank 1 sends its 8 gradients; rank 0 fails on the first one it uses, leaving the rest
    unreceived. Whatever the transport does with them, no later step may take them for its own:
    each later step is either exact on both ranks or raises on both (within the timeout)."""
    m = 8
    modules, ref = build("mlp", world), build("mlp", world)
    failing = _install(modules, _FailBackward()) if rank == 0 else None
    sched = _schedule(rank, world, modules, name="gpipe", m=m, timeout=3.0)
    said = []
    for i in range(3):
        x, y = make_batch("mlp", 16, seed=i)
        for mod in modules + ref:
            mod.zero_grad(set_to_none=True)
        if failing is not None:
            failing.arm(i == 1)
        try:
            _call(sched, rank, x, y)
        except Exception as exc:  # noqa: BLE001 - which error, and where, is what the test checks
            said.append(f"{i}: error: {type(exc).__name__}: {exc}")
            continue
        loss_fn(run_stages(ref, x), y).backward()
        said.append(f"{i}: {'exact' if _exact(modules, ref, rank) else 'WRONG gradients'}")
    return said


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_messages_a_failed_step_left_behind_are_never_taken_for_a_later_steps(transport):
    said = rank_values(_messages_left_behind, 2)
    assert said[0][0] == said[1][0] == "0: exact", said
    assert said[0][1].startswith("1: error: ValueError: boom in backward"), said
    # Gloo completes a send only once the receiver took it, so rank 1 fails waiting for its gradients to
    # leave; shared memory buffers them in rank 0's inbox, so rank 1's step completes, exact (its side of
    # the step did all its work), as when rank 0 fails after the last message (the test above)
    assert said[1][1].startswith("1: error") if transport == "gloo" else said[1][1] == "1: exact", said
    # the step after: exact on both ranks, or an error on both; never accepted on one side only
    later = [said[0][2].split(":")[1].strip(), said[1][2].split(":")[1].strip()]
    assert later in (["exact", "exact"], ["error", "error"]), said
    assert not [s for v in said.values() for s in v if "WRONG" in s], said


def _record_groups(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    import pipeline_ext as pe

    bad = []
    cpu = pe.Schedule1F1B(pe.PipelineStage(build("mlp", world)[rank], rank, world, "cpu"), 4, loss_fn=loss_fn)
    if cpu._session.agreement.group is not None and cpu._session.agreement.group is not dist.group.WORLD:
        bad.append("a CPU pipeline's step records should travel on its own group")
    # GPU stages (constructed only: nothing runs): the records get a Gloo twin group, so the host never reads GPU memory
    gpu = pe.Schedule1F1B(pe.PipelineStage(build("mlp", world)[rank], rank, world, "cuda:0"), 4, loss_fn=loss_fn)
    twin = gpu._session.agreement.group
    if twin is None or twin is dist.group.WORLD or dist.get_backend(twin) != "gloo":
        bad.append(f"a GPU pipeline's step records travel on {twin}, not a Gloo twin group")
    if dist.get_process_group_ranks(twin) != list(range(world)) or gpu._session.agreement.device.type != "cpu":
        bad.append("the twin group must hold the pipeline's ranks, its records host memory")
    return bad


@pytest.mark.timeout(60)
def test_gpu_pipelines_exchange_step_records_in_host_memory():
    no_complaints(_record_groups, 2, timeout=40)


def _twin_after_one_more_group(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    import pipeline_ext as pe

    if rank == 1:  # this rank made a group of its own earlier (any script may)
        dist.new_group([1], use_local_synchronization=True)
    gpu = pe.Schedule1F1B(pe.PipelineStage(build("mlp", world)[rank], rank, world, "cuda:0"), 4, loss_fn=loss_fn)
    twin = gpu._session.agreement.group
    return [] if dist.get_process_group_ranks(twin) == list(range(world)) else [f"twin group {twin}"]


@pytest.mark.isolated  # about the groups a process made before: on a pool worker, earlier tests' count too
@pytest.mark.timeout(60)
def test_the_gloo_twin_is_made_whatever_groups_a_rank_made_before():
    """The twin was made by its members alone (use_local_synchronization), which torch names after how
    many groups the process already has: with one more group on rank 1 both ranks waited forever."""
    no_complaints(_twin_after_one_more_group, 2, timeout=40)


def _transport_per_rank(rank: int, world: int) -> str:
    """One rank asks for Gloo, the other for shared memory (by argument, as a config slip would)."""
    modules = build("mlp", world)
    import pipeline_ext as pe

    stage = pe.PipelineStage(modules[rank], rank, world, "cpu")
    sched = pe.Schedule1F1B(stage, 2, loss_fn=loss_fn, timeout=TIMEOUT, transport="gloo" if rank == 0 else "shm")
    x, y = make_batch("mlp", 4)
    try:
        _call(sched, rank, x, y)
    except StepAgreementError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_ranks_on_different_transports_fail_at_the_first_step_naming_both():
    said = rank_values(_transport_per_rank, 2, timeout=40)
    for message in said.values():
        assert "rank 0 asked for transport='process_group', rank 1 asked for transport='shm'" in message, said


class _Widen(torch.nn.Module):
    """Stage 0 whose output width follows an int argument: ``width`` copies of its features."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, width: int = 1):
        return torch.cat([self.inner(x)] * width, dim=1)


class _Narrow(torch.nn.Module):
    """Stage 1: averages the copies back, whatever their number."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, h):
        return self.inner(h.view(h.shape[0], -1, 16).mean(dim=1))


def _int_argument_changes_shapes(rank: int, world: int) -> list[str]:
    import pipeline_ext as pe

    modules, ref = build("mlp", world), build("mlp", world)
    module = _Widen(modules[0]) if rank == 0 else _Narrow(modules[1])
    sched = pe.Schedule1F1B(pe.PipelineStage(module, rank, world, "cpu"), 2, loss_fn=loss_fn, timeout=TIMEOUT)
    said = []
    for i, width in enumerate([1, 2, 1, 3]):
        x, y = make_batch("mlp", 4, seed=i)
        for mod in modules + ref:
            mod.zero_grad(set_to_none=True)
        sched.step(*((x,) if rank == 0 else ()), **({"width": width} if rank == 0 else {"target": y}))
        loss_fn(_Narrow(ref[1])(_Widen(ref[0])(x, width)), y).backward()
        if not _exact(modules, ref, rank):
            said.append(f"width {width}: WRONG gradients")
    return said


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_an_int_argument_that_changes_output_shapes_starts_a_new_signature():
    """Plain non-tensor arguments count by value in the step signature: a new width is a new plan."""
    no_complaints(_int_argument_changes_shapes, 2, timeout=40)


def _losses_cleared(rank: int, world: int) -> list[str]:
    modules = build("mlp", world)
    sched = _schedule(rank, world, modules, m=2)
    x, y = make_batch("mlp", 4)
    losses = ["stale"]
    _call(sched, rank, x, y) if rank == 0 else sched.step(target=y, losses=losses)
    said = [] if rank == 0 or len(losses) == 2 else [f"after a step: {losses}"]
    sched.eval(*((x,) if rank == 0 else ()), **({} if rank == 0 else {"losses": losses}))  # no target: no loss
    if rank == 1 and losses:
        said.append(f"after eval() without target: {losses}")
    losses[:] = ["stale"]
    try:  # rejected: the batch is smaller than the microbatch count
        sched.step(*((x[:1],) if rank == 0 else ()), **({} if rank == 0 else {"target": y[:1], "losses": losses}))
    except (ValueError, StepAgreementError):
        pass
    if rank == 1 and losses:
        said.append(f"after a rejected step: {losses}")
    return said


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_losses_hold_only_this_calls_losses():
    no_complaints(_losses_cleared, 2, timeout=40)


def _module_error_mid_step(rank: int, world: int) -> list[str]:
    """Rank 1's module raises in the middle of a step (its third forward of step 1) and both ranks catch it and go
    on: rank 0, waiting for a gradient that will not come, must hear why at once (not at its 60 s timeout), and
    the steps after must be exact."""
    modules, ref = build("mlp", world), build("mlp", world)
    sched = _schedule(rank, world, modules, timeout=60.0)
    forwards = [0]

    def flaky(module, args):
        forwards[0] += 1
        if forwards[0] == 4 + 3:  # step 0 ran 4 forwards; microbatch 2 of step 1
            raise ValueError("boom in the user's module")

    if rank == 1:
        modules[1].register_forward_pre_hook(flaky)
    said = []
    for i in range(4):
        for m in (*modules, *ref):  # a training loop's zero_grad: the failed step's partial gradients go with it
            m.zero_grad(set_to_none=True)
        x, y = make_batch("mlp", 8, seed=i)
        try:
            _call(sched, rank, x, y)
        except Exception as exc:  # what a training loop that skips a bad batch catches
            said.append(f"{i}:{type(exc).__name__}: {exc}")
            continue
        loss_fn(run_stages(ref, x), y).backward()
        if not _exact(modules, ref, rank):
            said.append(f"rank {rank}: gradients of step {i} differ from the unsplit model's")
    return said


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_module_error_mid_step_ends_the_peers_wait_naming_it_and_the_loop_goes_on():
    said = rank_values(_module_error_mid_step, 2, timeout=100)
    assert said[1] == ["1:ValueError: boom in the user's module"], said
    assert len(said[0]) == 1 and said[0][0].startswith("1:"), said
    assert "failed on rank 1 in F of stage 1, microbatch 2: ValueError: boom in the user's module" in said[0][0], said
    assert "timed out" not in said[0][0], said


# -- a rank that refuses its own step while its peer has already left (torch's test_shape_prop_mismatch) ----

def _validated_after_the_peer_left(rank: int, world: int) -> list:
    """torch's loop: every rank runs one step, then the peer leaves; rank 0 alone calls steps that must fail.

    With ``stage._runtime_validate`` (torch's switch) the first step's shapes hold: a batch of other rows or
    dtype is refused before anything is posted, an output of other shape or dtype after the forward. Each
    error is rank 0's own, raised at once: the peer is gone and its record will never come (the schedule's
    timeout is far longer than the test's, so a wait for it fails the test).
    """
    from torch import nn
    from torch.utils._pytree import tree_map_only

    import pipeline_ext as pe

    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(world)]
    ref = [nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(world)]
    for a, b in zip(ref, layers):
        b.load_state_dict(a.state_dict())
    stage = pe.PipelineStage(layers[rank], rank, world, "cpu")
    stage._runtime_validate = True
    sched = pe.ScheduleGPipe(stage, 4, timeout=600.0)
    x = torch.randn(8, 16)
    out = sched.step(x) if rank == 0 else sched.step()
    said = []
    if rank == world - 1 and not torch.allclose(out, ref[1](ref[0](x)), rtol=RTOL, atol=ATOL):
        said.append("the first step's output differs from the unsplit model's")
    if rank != 0:  # leaves the loop, as torch's test does (its process goes on to the next test)
        torch.distributed.barrier()  # (on the group's collective slot, apart from the step's messages)
        return said

    def hook(fn):
        return lambda module, args, output: tree_map_only(torch.Tensor, fn, output)

    cases = [("shape mismatch", torch.randn(9, 16), None), ("dtype mismatch", x.to(torch.float64), None),
             ("shape mismatch", x, hook(lambda t: t.flatten())),
             ("dtype mismatch", x, hook(lambda t: t.to(torch.bfloat16)))]
    for words, batch, fn in cases:
        handle = layers[0].register_forward_hook(fn) if fn is not None else None
        try:
            sched.step(batch)
            said.append(f"{words}: accepted")
        except pe.PipeliningMetadataError as exc:
            if words not in str(exc):
                said.append(f"{words}: {exc}")
        finally:
            if handle is not None:
                handle.remove()
    torch.distributed.barrier()
    return said


def test_a_step_refused_on_the_first_rank_raises_at_once_when_the_peer_has_left():
    assert rank_values(_validated_after_the_peer_left, 2, timeout=120) == {0: [], 1: []}
