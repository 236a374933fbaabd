"""Jobs end as they should and leave nothing behind, each a pair of processes started as torchrun starts them.

A rank that prints its result and then aborts at interpreter exit
("terminate called without an active exception", exit code -6) makes a job
scheduler mark the run failed: 20 consecutive 2-rank jobs train 2 steps of
1F1B and exit the way scripts do (half call ``destroy_process_group()``
first, half do not; half on shared memory, half on the process group); every
exit code must be 0 and no rank may print an abort. And a job that sets up
shared memory and ends without a step (normally, by an exception, by
``os._exit``) leaves nothing in /dev/shm.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from pipeline_ext.comm.launch import free_port

JOB = textwrap.dedent("""
    import os
    import torch
    import torch.distributed as dist
    from torch import nn
    import pipeline_ext as pe

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(2 * world)])
    stage = pe.PipelineStage(model[2 * rank:2 * rank + 2], rank, world, "cpu")
    sched = pe.Schedule1F1B(stage, 2, loss_fn=nn.functional.mse_loss, timeout=60,
                            transport=os.environ["JOB_TRANSPORT"])
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    end = os.environ.get("JOB_END", "steps")
    if end == "os_exit":  # after setup, before any step: no destructor runs
        os._exit(3)
    if end == "raise":
        raise RuntimeError("the harness failed after setup")
    for _ in range(2 if end == "steps" else 0):
        sched.step(x) if rank == 0 else sched.step(target=y)
    print(f"rank {rank} done", flush=True)
    if os.environ["JOB_DESTROY"] == "1":
        dist.destroy_process_group()
""")


def _shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("pipeline_ext")} if os.path.isdir("/dev/shm") else set()


def _job(i: int, end: str = "steps") -> list[tuple[int, str]]:
    """One 2-rank job (torchrun's environment: MASTER_ADDR/PORT, RANK, WORLD_SIZE); (exit code, output) per rank."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_RANK=str(rank), JOB_DESTROY=str(i % 2), JOB_TRANSPORT="auto" if i % 4 < 2 else "gloo",
                   JOB_END=end)
        procs.append(subprocess.Popen([sys.executable, "-c", JOB], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True))
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            text = "(killed after 120 s)"
            p.wait()
        out.append((p.returncode, text))
    return out


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_twenty_consecutive_two_rank_jobs_exit_0():
    bad = []
    for i in range(20):
        for rank, (code, text) in enumerate(_job(i)):
            if code != 0 or "terminate called" in text or f"rank {rank} done" not in text:
                bad.append(f"job {i} rank {rank}: exit {code}: {text.strip()[-400:]}")
    assert not bad, "\n".join(bad)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("end", ["no-step", "raise", "os_exit"])
def test_no_way_of_ending_after_setup_leaves_anything_in_dev_shm(end):
    # Shared memory is set up with the schedule (transport "auto" on one host); then the job ends without a
    # step: normally, by an exception (a failed harness), or by os._exit (no destructor, no atexit).
    before = _shm_names()
    results = _job(0, end)  # job 0: transport auto, no destroy_process_group
    codes = [code for code, _ in results]
    assert codes == {"no-step": [0, 0], "raise": [1, 1], "os_exit": [3, 3]}[end], results
    assert _shm_names() == before
