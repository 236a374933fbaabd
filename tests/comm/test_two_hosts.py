"""One job on two hosts, as ``torchrun --nnodes 2`` starts it: every schedule exact, a lost host named, a restart.

The two hosts are simulated on this machine and made by the test itself: two
network namespaces joined by a veth pair (``10.213.47.1/30`` and ``.2``, the
only addresses they hold: no traffic leaves them), and each host's
``torchrun`` in its own UTS (hostname ``hostA`` / ``hostB``), mount (its own
/dev/shm: a directory of the test bound over it; its own /etc/hosts naming
the two) and PID namespace (``unshare --pid --fork --kill-child``: killing
the ``unshare`` kills the whole host, agent and ranks). Gloo runs over the
veth (``GLOO_SOCKET_IFNAME``).

What the library's same-host detection (``comm/transport/setup._host_id``) sees:
the hostnames differ, the boot id is the same (one kernel), the /dev/shm
directories differ and so do the PID namespaces. Two ranks are on one host
only when all four agree, so these are two hosts: every edge between them
goes through the process group, and the edges inside each host through shared
memory (``exact`` checks what was chosen, and the line that says it).

Each rank writes what it saw to a JSON file (``two_hosts_job.py``); the test
reads them. Where namespaces cannot be made (not root, no ``ip`` or
``unshare``), the tests skip saying why.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

from test_distributed import SCHEDULES

pytestmark = [pytest.mark.slow, pytest.mark.isolated, pytest.mark.hosts]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
JOB = HERE / "two_hosts_job.py"
#: the job's imports: the package, the suite's shared modules and test_distributed (tests/stages), the job's folder
JOB_PATH = [ROOT, ROOT / "tests", ROOT / "tests" / "stages", HERE]
ADDRS = ("10.213.47.1", "10.213.47.2")  # a private /30 held only by the test's two namespaces
HOSTS = ("hostA", "hostB")
PORT = 29547  # inside the test's namespaces: nothing else listens there
#: torchrun arguments every job gets: static rendezvous on the first host's veth address. ``--monitor-interval``: how
#: often the agent looks at its ranks (what it adds to a failure's end)
TORCHRUN = ["--nnodes", "2", "--nproc-per-node", "2", "--master-addr", ADDRS[0], "--master-port", str(PORT),
            "--monitor-interval", "0.5"]
JOB_TIMEOUT = 240  # seconds a whole job may take: two torchruns, four ranks, on a loaded machine


def _why_no_namespaces() -> Optional[str]:
    if os.geteuid() != 0:
        return "two simulated hosts need root (network namespaces)"
    for tool in ("ip", "unshare", "mount", "torchrun"):
        if shutil.which(tool) is None:
            return f"two simulated hosts need {tool!r} on PATH"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


class TwoHosts:
    """Two namespaces, a veth pair between them, and the torchruns started on them (killed in ``close``)."""

    def __init__(self, tmp: Path) -> None:
        tag = f"{os.getpid() % 100000}"
        self.ns = (f"pe-{tag}-a", f"pe-{tag}-b")
        self.ifs = (f"pe{tag}a", f"pe{tag}b")
        self.tmp = tmp
        self.shm = (tmp / "shm-a", tmp / "shm-b")
        self.out = tmp / "out"
        self.hosts_file = tmp / "hosts"
        self.procs: list[subprocess.Popen] = []
        for d in (*self.shm, self.out):
            d.mkdir()
        self.hosts_file.write_text("127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for a, h in zip(ADDRS, HOSTS)))
        self.made: list[str] = []

    def make(self) -> None:
        for ns in self.ns:
            made = _ip("netns", "add", ns, check=False)
            if made.returncode != 0:
                pytest.skip(f"cannot make a network namespace: {made.stderr.strip()}")
            self.made.append(ns)
        _ip("link", "add", self.ifs[0], "netns", self.ns[0], "type", "veth", "peer", "name", self.ifs[1],
            "netns", self.ns[1])
        for ns, ifname, addr in zip(self.ns, self.ifs, ADDRS):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", ifname)
            _ip("-n", ns, "link", "set", "lo", "up")
        self.link(True)

    def link(self, up: bool, node: Optional[int] = None) -> None:
        for n in (0, 1) if node is None else (node,):
            _ip("-n", self.ns[n], "link", "set", self.ifs[n], "up" if up else "down")

    def start(self, node: int, mode: str, *torchrun: str, **env: str) -> subprocess.Popen:
        """Host ``node``'s torchrun running ``two_hosts_job.py`` in ``mode``; its output goes to a file."""
        inner = (f"mount --bind {self.shm[node]} /dev/shm && mount --bind {self.hosts_file} /etc/hosts && "
                 f"hostname {HOSTS[node]} && exec torchrun --node-rank {node} {' '.join(torchrun)} {JOB}")
        full_env = dict(os.environ, GLOO_SOCKET_IFNAME=self.ifs[node], JOB_MODE=mode, JOB_OUT=str(self.out),
                        PYTHONPATH=os.pathsep.join(map(str, JOB_PATH)), OMP_NUM_THREADS="1", **env)
        log = open(self.tmp / f"host{node}.log", "w")
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns[node], "unshare", "--uts", "--mount", "--pid",
                                 "--fork", "--kill-child", "--mount-proc", "sh", "-c", inner],
                                env=full_env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        log.close()
        self.procs.append(proc)
        return proc

    def run(self, mode: str, *torchrun: str, **env: str) -> tuple[list[int], dict[int, dict]]:
        """Both hosts' torchruns to their end: (exit codes, each rank's report)."""
        procs = [self.start(n, mode, *TORCHRUN, *torchrun, **env) for n in (0, 1)]
        return [self.wait(p) for p in procs], self.reports()

    def wait(self, proc: subprocess.Popen, timeout: float = JOB_TIMEOUT) -> int:
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"a host's torchrun did not end within {timeout} s:\n{self.logs()}") from None

    def kill(self, node: int) -> None:
        """The whole host at once: SIGKILL to its ``unshare`` takes its PID namespace down (agent and ranks)."""
        proc = self.procs[node]
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)

    def reports(self) -> dict[int, dict]:
        out = {}
        for f in self.out.glob("rank*.json"):
            r = json.loads(f.read_text())
            out[r["rank"]] = r
        return out

    def logs(self) -> str:
        return "\n".join(f"--- host{n}.log (tail)\n" + (self.tmp / f"host{n}.log").read_text()[-3000:]
                         for n in (0, 1) if (self.tmp / f"host{n}.log").exists())

    def close(self) -> list[str]:
        """Kill what the test started, remove the namespaces; what was left behind (must be nothing)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()  # --kill-child: the host's PID namespace goes with it
            proc.wait(timeout=60)
        left = [f"{d.name}/{n}" for d in self.shm for n in os.listdir(d)]
        for ns in self.made:
            deadline = time.monotonic() + 60  # a killed PID namespace empties as its processes are reaped
            while (pids := _ip("netns", "pids", ns, check=False).stdout.split()) and time.monotonic() < deadline:
                time.sleep(0.2)
            if pids:
                left.append(f"processes in {ns}: {pids}")
            _ip("netns", "del", ns, check=False)
        listed = _ip("netns", "list", check=False).stdout
        left += [f"namespace {ns} still listed" for ns in self.made if ns in listed.split()]
        return left


@pytest.fixture
def hosts(tmp_path):
    why = _why_no_namespaces()
    if why:
        pytest.skip(why)
    h = TwoHosts(tmp_path)
    try:
        h.make()
        yield h
    finally:
        left = h.close()
    assert not left, f"left behind: {left}"


def _peer_error(reports: dict[int, dict], ranks: tuple[int, ...], hosts: TwoHosts) -> None:
    """Every rank in ``ranks`` raised; the rank next to the other host names its peer there, and the hosts."""
    assert set(ranks) <= set(reports), f"ranks {sorted(set(ranks) - set(reports))} wrote nothing:\n{hosts.logs()}"
    for r in ranks:
        assert "error" in reports[r], f"rank {r} did not raise: {reports[r]}"
        assert "ranks 0, 1 on host hostA; ranks 2, 3 on host hostB" in reports[r]["error"], reports[r]["error"]
    edge = {1: 2, 2: 1}  # the pipeline's edge between the hosts: stage 1 (hostA) -> stage 2 (hostB)
    for r in ranks:
        if r in edge:
            assert f"with peer rank {edge[r]}" in reports[r]["error"], reports[r]["error"]


def test_every_schedule_exact_across_two_hosts(hosts):
    """Every schedule's step on 2 hosts x 2 ranks equals the unsplit model's (loss, outputs, gradients)."""
    codes, reports = hosts.run("exact")
    assert codes == [0, 0], hosts.logs()
    assert sorted(reports) == [0, 1, 2, 3]
    assert {r: reports[r]["host"] for r in reports} == {0: "hostA", 1: "hostA", 2: "hostB", 3: "hostB"}
    ids = {r: reports[r]["host_id"].split("|") for r in reports}
    assert ids[0] == ids[1] and ids[2] == ids[3]
    name, boot, shm, pidns = zip(ids[0], ids[2])  # what the same-host detection compares
    assert boot[0] == boot[1] and shm[0] != shm[1] and pidns[0] != pidns[1], ids
    for r, rep in reports.items():
        assert rep["ran"] == SCHEDULES, rep
        assert not rep["bad"], "\n".join(rep["bad"][:20])
        # shared memory inside each host, the process group between them; every rank took the same table
        assert rep["transport"] == "per_edge", rep
        assert rep["edges"] == {"0<->1": "shm", "0<->2": "process_group", "0<->3": "process_group",
                                "1<->2": "process_group", "1<->3": "process_group", "2<->3": "shm"}, rep
    # said once per distinct set of pipeline edges, by rank 0 alone: with the interleaved schedules' 3<->0 edge, and
    # without it
    assert sorted(reports[0]["said"]) == [
        "pipeline_ext: transport per edge: 0<->1 shm, 0<->3 process_group (hosts hostA|hostB), "
        "1<->2 process_group (hosts hostA|hostB), 2<->3 shm",
        "pipeline_ext: transport per edge: 0<->1 shm, 1<->2 process_group (hosts hostA|hostB), 2<->3 shm",
    ], reports[0]["said"]
    assert not any(reports[r]["said"] for r in (1, 2, 3)), reports


def test_ranks_killed_on_one_host(hosts):
    """The second host's ranks are SIGKILLed mid-step: the first host's ranks raise naming the peer and hosts."""
    codes, reports = hosts.run("kill", JOB_STEPS="4", JOB_STEP="2")
    assert codes[0] != 0 and codes[1] != 0, hosts.logs()
    _peer_error(reports, (0, 1), hosts)
    assert 2 not in reports  # killed, it wrote nothing


def test_link_down_mid_step(hosts):
    """The veth link goes down mid-step: every rank raises at its timeout, naming its peer; both torchruns end."""
    codes, reports = hosts.run("link", JOB_STEPS="4", JOB_STEP="2", JOB_TIMEOUT="10")
    assert codes[0] != 0 and codes[1] != 0, hosts.logs()
    _peer_error(reports, (0, 1, 2, 3), hosts)
    assert all("timed out" in reports[r]["error"] or "Connection" in reports[r]["error"] for r in reports), reports


def test_lost_host_ends_the_other_hosts_torchrun(hosts):
    """The first host (the rendezvous store's) is lost without a word: its link down, then all its processes
    killed. The second host's ranks raise at their timeout naming the peer; its torchrun ends on its own
    (static rendezvous: the agent does not wait on the lost store; JOB_TIMEOUT bounds the wait, no timing)."""
    env = dict(JOB_STEPS="4", JOB_STEP="2", JOB_TIMEOUT="10", JOB_LOST_NODE="0")
    first, second = (hosts.start(n, "lost", *TORCHRUN, **env) for n in (0, 1))
    marker = hosts.out / "lost"
    deadline = time.monotonic() + JOB_TIMEOUT
    while not marker.exists():  # the first host's rank 0 stopped in its forward of step 2
        assert time.monotonic() < deadline and first.poll() is None, f"host A never reached step 2:\n{hosts.logs()}"
        time.sleep(0.2)
    hosts.link(False, node=0)  # no FIN, no RST: the other host hears nothing more
    hosts.kill(0)
    code = hosts.wait(second)
    assert code != 0, hosts.logs()
    reports = hosts.reports()
    _peer_error(reports, (2, 3), hosts)


def _train(hosts: TwoHosts, die: str, ckpt: Path) -> dict[int, dict]:
    ckpt.mkdir()
    for f in hosts.out.glob("rank*.json"):
        f.unlink()
    procs = [hosts.start(n, "train", *TORCHRUN, "--max-restarts", "1", JOB_STEPS="5", JOB_DIE=die, JOB_CKPT=str(ckpt)) for n in (0, 1)]
    codes, reports = [hosts.wait(p) for p in procs], hosts.reports()
    assert codes == [0, 0], hosts.logs()
    assert sorted(reports) == [0, 1, 2, 3], reports
    return reports


def test_restart_after_a_lost_rank_loses_nothing(hosts):
    """``--max-restarts 1``, rank 2 (second host) killed in step 3: every rank restarts from the checkpoint of
    step 3 (model, optimizer, data position) and ends with the parameters, bitwise, of a run never interrupted."""
    whole = _train(hosts, "", hosts.tmp / "ckpt-whole")
    cut = _train(hosts, "2:3", hosts.tmp / "ckpt-cut")
    assert all(whole[r]["restart"] == 0 and whole[r]["start"] == 0 for r in whole), whole
    assert all(cut[r]["restart"] == 1 and cut[r]["start"] == 3 for r in cut), {r: (v["restart"], v["start"]) for r, v in cut.items()}
    for r in range(4):
        assert cut[r]["params"] == whole[r]["params"], f"rank {r}: parameters differ after the restart"


def _train_one_host(tmp: Path, die: str, name: str) -> dict[int, dict]:
    """``torchrun --max-restarts 1`` of two ranks on 127.0.0.1 (shared memory between them), to its end."""
    from pipeline_ext.comm.launch import free_port

    out, ckpt = tmp / f"out-{name}", tmp / f"ckpt-{name}"
    out.mkdir()
    ckpt.mkdir()
    env = dict(os.environ, JOB_MODE="train", JOB_OUT=str(out), JOB_STEPS="5", JOB_DIE=die, JOB_CKPT=str(ckpt),
               GLOO_SOCKET_IFNAME="lo", PYTHONPATH=os.pathsep.join(map(str, JOB_PATH)), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2", "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "1", "--monitor-interval", "0.5", str(JOB)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun's own group; its ranks are killed by its death
        text = proc.communicate()[0]
        raise AssertionError(f"torchrun did not end within {JOB_TIMEOUT} s:\n{text[-3000:]}") from None
    assert proc.returncode == 0, text[-3000:]
    return {r["rank"]: r for r in (json.loads(f.read_text()) for f in out.glob("rank*.json"))}


def test_restart_on_one_host_loses_nothing(tmp_path):
    """The same on one host (two ranks over shared memory): rank 1 killed in step 3, the restart resumes from
    the checkpoint of step 3 and ends bitwise where a run never interrupted ends."""
    whole = _train_one_host(tmp_path, "", "whole")
    cut = _train_one_host(tmp_path, "1:3", "cut")
    assert sorted(whole) == sorted(cut) == [0, 1]
    assert all(cut[r]["restart"] == 1 and cut[r]["start"] == 3 for r in cut), cut
    for r in range(2):
        assert cut[r]["params"] == whole[r]["params"], f"rank {r}: parameters differ after the restart"
