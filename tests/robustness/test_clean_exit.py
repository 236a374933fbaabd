"""Jobs end as they should and leave nothing behind, each a pair of processes started as torchrun starts them.

A rank that prints its result and then aborts at interpreter exit
("terminate called without an active exception", exit code -6) makes a job
scheduler mark the run failed: 20 consecutive 2-rank jobs train 2 steps of
1F1B and exit the way scripts do (half call ``destroy_process_group()``
first, half do not; half on shared memory, half on the process group); every
exit code must be 0 and no rank may print an abort. And a job that sets up
shared memory and ends without a step (normally, by an exception, by
``os._exit``) leaves nothing in /dev/shm.

Where the ranks come from: the twenty jobs' ranks are forked from one
interpreter that has imported torch and pipeline_ext (``ZYGOTE``). A forked
rank runs the job as its ``__main__`` and then leaves by falling off the end
of the script, so it goes through the whole interpreter shutdown a script
goes through (atexit handlers, module teardown, the C++ runtime's static
destructors and its threads); only the import is shared, frozen
(``gc.freeze``) as a fork server freezes it, so the exit's collections walk
what the job made and not torch's modules. Importing torch is most of a
fresh rank's start-up, and walking it most of a forked rank's exit; neither
is what these jobs test. Jobs of
each kind also run on fresh interpreters (``python -c JOB``, as torchrun
starts them): on shared memory and on the process group, with the threads
still up at exit (no ``destroy_process_group()``).
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import textwrap
import threading

import pytest

from pipeline_ext.comm.launch import free_port
from models import shm_names

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


def _env(i: int, rank: int, port: int, end: str) -> dict[str, str]:
    """Job ``i``'s rank as torchrun starts it (MASTER_ADDR/PORT, RANK, WORLD_SIZE); ``i`` picks the exit mode."""
    return dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                LOCAL_RANK=str(rank), JOB_DESTROY=str(i % 2), JOB_TRANSPORT="auto" if i % 4 < 2 else "gloo",
                JOB_END=end)


def _job(i: int, end: str = "steps") -> list[tuple[int, str]]:
    """One 2-rank job on fresh interpreters; (exit code, output) per rank."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", JOB], env=_env(i, rank, port, end), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
             for rank in range(2)]
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


#: Forks each requested rank from an interpreter that has torch and pipeline_ext imported; the rank runs the job
#: as ``__main__`` and exits by falling off the end of this script (a full interpreter shutdown). Protocol: one
#: JSON line in per job (a list of [environment, output file] per rank), two lines out (the ranks' pids, then
#: their exit codes as ``os.waitstatus_to_exitcode`` gives them).
ZYGOTE = textwrap.dedent("""
    import gc, json, os, sys
    import torch, torch.distributed, pipeline_ext
    gc.collect()
    gc.freeze()  # the imports live as long as a rank: its collections, the last one at exit included, skip them

    def serve():
        for line in sys.stdin:
            pids = []
            for env, out in json.loads(line):
                sys.stdout.flush()
                pid = os.fork()
                if pid == 0:
                    return env, out
                pids.append(pid)
            print(json.dumps(pids), flush=True)
            print(json.dumps([os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]), flush=True)
        sys.exit(0)

    env, out = serve()
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    del serve, env, out, fd, null
    exec(compile(os.environ["JOB_SOURCE"], "<job>", "exec"))
""")


class _Zygote:
    """The ``ZYGOTE`` interpreter; every read has a deadline, and ``close`` kills whatever is left."""

    def __init__(self, tmp: str):
        self.tmp = tmp
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=dict(os.environ, JOB_SOURCE=JOB))
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(x) for x in self.proc.stdout], daemon=True).start()
        self.pids: list[int] = []

    def _line(self, timeout: float):
        try:
            return json.loads(self.lines.get(timeout=timeout))
        except queue.Empty:
            raise TimeoutError(f"no answer from the job's ranks {self.pids} within {timeout:.0f} s") from None

    def job(self, i: int, end: str = "steps") -> list[tuple[int, str]]:
        port = free_port()
        outs = [os.path.join(self.tmp, f"job{i}-rank{rank}.txt") for rank in range(2)]
        req = [[{**_env(i, rank, port, end), "JOB_SOURCE": JOB}, outs[rank]] for rank in range(2)]
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        self.pids = self._line(120)
        codes = self._line(120)
        texts = []
        for path in outs:
            with open(path) as f:
                texts.append(f.read())
        return list(zip(codes, texts))

    def close(self) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        self.proc.kill()
        self.proc.wait()


def _bad(i: int, results: list[tuple[int, str]]) -> list[str]:
    return [f"job {i} rank {rank}: exit {code}: {text.strip()[-400:]}" for rank, (code, text) in enumerate(results)
            if code != 0 or "terminate called" in text or f"rank {rank} done" not in text]


@pytest.fixture(scope="module")
def zygote():
    with tempfile.TemporaryDirectory() as tmp:
        z = _Zygote(tmp)
        try:
            yield z
        finally:
            z.close()


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(900)
def test_twenty_consecutive_two_rank_jobs_exit_0(zygote):
    bad = [line for i in range(20) for line in _bad(i, zygote.job(i))]
    assert not bad, "\n".join(bad)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("i", [0, 2])
def test_a_two_rank_job_on_fresh_interpreters_exits_0_without_destroy_process_group(i):
    # job 0 on shared memory, job 2 on the process group; neither destroys it (threads still up at exit)
    bad = _bad(i, _job(i))
    assert not bad, "\n".join(bad)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("end", ["no-step", "raise", "os_exit"])
def test_no_way_of_ending_after_setup_leaves_anything_in_dev_shm(end, zygote):
    # Shared memory is set up with the schedule (transport "auto" on one host); then the job ends without a
    # step: normally, by an exception (a failed harness), or by os._exit (no destructor, no atexit).
    before = shm_names()
    results = zygote.job(0, end)  # job 0: transport auto, no destroy_process_group
    codes = [code for code, _ in results]
    assert codes == {"no-step": [0, 0], "raise": [1, 1], "os_exit": [3, 3]}[end], results
    assert shm_names() == before
