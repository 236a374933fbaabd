"""One rank of the two-host jobs of ``test_two_hosts.py``, started by ``torchrun --nnodes 2`` on each host.

Each rank writes what it saw to ``$JOB_OUT/rank<R>.json`` (one line, written
at once) and exits non-zero where it raised; the test reads the files. The
mode (``$JOB_MODE``):

- ``exact``: every schedule's step against the unsplit model
  (``test_distributed._check_step``), on this rank's stages, with the
  transport per edge settled and the summary lines this rank said;
- ``kill``: 1F1B training; at step ``$JOB_STEP`` the second host's ranks kill
  themselves (SIGKILL) in their first forward: the first host's ranks must
  raise naming a peer on the second host;
- ``link``: the same, but the second host's first rank takes the veth link
  down in its first forward of that step (``ip link set ... down``);
- ``lost``: at that step the first rank of host ``$JOB_LOST_NODE`` writes
  ``$JOB_OUT/lost`` and stops in its forward; the test then takes the host
  down (its link, then all its processes);
- ``train``: ``$JOB_STEPS`` steps of 1F1B and SGD on stages with dropout
  (each rank its own masks), a checkpoint (``pe.training.save_checkpoint``:
  model, optimizer, each rank's random generators and the data position)
  after every step; a restarted rank loads the last one and goes on from its
  position. ``$JOB_DIE`` = "rank:step": that rank SIGKILLs itself in the
  forward of that step, in its first attempt only (``TORCHELASTIC_RESTART_COUNT``
  is 0). The parameters are written at the end, to compare bitwise.
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn

import pipeline_ext as pe
from pipeline_ext.comm.transport.setup import GroupTransport, _host_id

MODE, OUT = os.environ["JOB_MODE"], os.environ["JOB_OUT"]
TIMEOUT = float(os.environ.get("JOB_TIMEOUT", "30"))


def report(what: dict) -> None:
    path = os.path.join(OUT, f"rank{what['rank']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(what, f)
    os.replace(path + ".tmp", path)


def seen(rank: int) -> dict:
    """Where this rank runs, as the rank sees it."""
    return dict(rank=rank, host=socket.gethostname(), host_id=_host_id(),
                restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), node=int(os.environ["GROUP_RANK"]))


def exact(rank: int, world: int) -> dict:
    from test_distributed import SCHEDULES, _check_step

    import warnings

    bad, ran = [], []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for name in SCHEDULES:
            bad += _check_step(rank, world, name, "blocks", 2 * world, 8 * world + 3)
            ran.append(name)
    registry = GroupTransport.known(dist.group.WORLD)
    settled = registry.settled("cpu") if registry is not None else None
    return dict(ran=ran, bad=bad, transport=getattr(settled, "kind", None),
                edges={f"{a}<->{b}": kind for (a, b), (kind, _) in getattr(settled, "edges", {}).items()},
                said=[str(w.message) for w in said if "transport per edge" in str(w.message)])


def _die_in_forward(stage: nn.Module, how) -> None:
    """Call ``how()`` in the stage's next forward: the middle of a step, with messages in flight."""
    def hook(module, args):
        how()
    stage.register_forward_pre_hook(hook)


def failing(rank: int, world: int) -> dict:
    """1F1B steps; at step ``$JOB_STEP`` the second host leaves mid-step (ranks killed, or its link down)."""
    from models import build, loss_fn, make_batch

    modules = build("mlp", world)
    stage = pe.PipelineStage(modules[rank], rank, world, "cpu")
    sched = pe.Schedule1F1B(stage, 4, loss_fn=loss_fn, timeout=TIMEOUT)
    on_second_host = int(os.environ["GROUP_RANK"]) == int(os.environ.get("JOB_LOST_NODE", "1"))
    done = 0
    for step in range(int(os.environ["JOB_STEPS"])):
        if step == int(os.environ["JOB_STEP"]) and on_second_host:
            if MODE == "kill":
                _die_in_forward(modules[rank], lambda: os.kill(os.getpid(), signal.SIGKILL))
            elif MODE == "lost":  # stops mid-step and says so: the test then kills the whole host
                _die_in_forward(modules[rank], lambda: (open(os.path.join(OUT, "lost"), "w").close(),
                                                        signal.pause()))
            elif int(os.environ["LOCAL_RANK"]) == 0:
                ifname = os.environ["GLOO_SOCKET_IFNAME"]
                _die_in_forward(modules[rank], lambda: subprocess.run(["ip", "link", "set", ifname, "down"], check=True))
        x, y = make_batch("mlp", 16, seed=step)
        sched.step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None)
        done += 1
    return dict(steps=done)


def train(rank: int, world: int) -> dict:
    """Training that resumes from its last checkpoint (model, optimizer, data position) after a restart."""
    from models import build, loss_fn, make_batch

    ckpts = os.environ["JOB_CKPT"]  # one directory per step: a rank killed while saving leaves the last whole one
    # dropout on every stage: a restarted process's generators are not the ones the checkpoint saved
    modules = [nn.Sequential(nn.Dropout(0.2), m) for m in build("mlp", world)]
    torch.manual_seed(100 + rank)
    stage = pe.PipelineStage(modules[rank], rank, world, "cpu")
    sched = pe.Schedule1F1B(stage, 4, loss_fn=loss_fn, timeout=TIMEOUT)
    opt = torch.optim.SGD(modules[rank].parameters(), lr=0.05, momentum=0.9)
    fqn = {rank: f"{rank}."}  # the unsplit model is nn.Sequential(*modules)
    extra = {"step": 0}
    # DCP writes .metadata last, once every rank's part is written: a directory with it is a whole checkpoint
    whole = [int(d) for d in os.listdir(ckpts) if os.path.exists(os.path.join(ckpts, d, ".metadata"))]
    if whole:
        pe.training.load_checkpoint(os.path.join(ckpts, str(max(whole))), sched, opt, fqn_maps=fqn, extra=extra)
    start = int(extra["step"])
    die = os.environ.get("JOB_DIE", "")
    if die and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        who, when = map(int, die.split(":"))
    else:
        who = when = -1
    for step in range(start, int(os.environ["JOB_STEPS"])):
        if rank == who and step == when:
            _die_in_forward(modules[rank], lambda: os.kill(os.getpid(), signal.SIGKILL))
        x, y = make_batch("mlp", 16, seed=step)  # the data position is the step number
        opt.zero_grad()
        sched.step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None)
        opt.step()
        pe.training.save_checkpoint(os.path.join(ckpts, str(step + 1)), sched, opt, fqn_maps=fqn,
                                    extra={"step": step + 1})
    return dict(start=start, params={n: p.detach().tolist() for n, p in modules[rank].named_parameters()})


def init_process_group(timeout: datetime.timedelta) -> None:
    """Gloo over torchrun's store, its keys under this attempt's own prefix.

    torchrun keeps one store for every attempt of a job (static rendezvous),
    and its ranks meet there under fixed keys: after a restart, the ranks of
    the host that restarted first would read the addresses of the other
    host's ranks of the attempt before, now dead, and fail to connect.
    Every agent of a job that failed counts the restart, so
    ``TORCHELASTIC_RESTART_COUNT`` names the attempt alike on every host.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)


def main() -> int:
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    init_process_group(datetime.timedelta(seconds=TIMEOUT * 2))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        result = {"exact": exact, "kill": failing, "link": failing, "lost": failing, "train": train}[MODE](rank, world)
    except Exception as exc:  # noqa: BLE001 - reported to the test, then raised
        report(dict(seen(rank), error="".join(traceback.format_exception_only(exc)), traceback=traceback.format_exc()))
        raise
    report(dict(seen(rank), **result))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
