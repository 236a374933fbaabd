"""ShmChannel: point-to-point messages between processes on one host through shared memory.

Why not Gloo on one host: a Gloo message is a TCP write, an epoll wake-up of
the receiver's IO thread, a read, then a condition-variable wake-up of the
waiting thread (and a posted receive first wakes the *sender's* IO thread with
a "ready" note). Each wake-up is a trip through the scheduler; on a busy CPU
box one costs milliseconds, and 1F1B puts two messages per microbatch on its
critical path. Here a message is one ``ops.pack`` into a shared slot and one
counter store; the waiting rank polls the counter, yielding its core between
polls, so no other thread has to be scheduled to deliver anything.

Layout, per ordered pair (src -> dst): a control file (created by dst) with the
write counter (src only writes it), the read counter (dst only writes it), the
pids of both ends, and ``SLOTS`` slot headers (tag, data generation, layout);
and one data file per slot (created by src, replaced by a bigger one of the
next generation when a message does not fit). Files live in /dev/shm; the
reader unlinks each as soon as it has mapped it (the sender may be gone by
then: a send completes when the bytes are in the file, so a sender's process
can finish its step and drop its channel before the reader looks), so only a
file whose message is never read can outlive the run. Messages from one peer are read in the order sent; a receive waiting for
another tag sets earlier messages aside (any order of receives works), and a
sender waiting for a free slot drains its own inbound rings meanwhile (no
cycle of full rings can deadlock).

Ordering relies on x86-64 stores being seen in program order (TSO): the data
and header are written before the counter. ``supported`` says no elsewhere and
the front door then uses the process-group channel.
"""
from __future__ import annotations

import mmap
import os
import platform
import time
import uuid
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from pipeline_ext import ops
from pipeline_ext._ext import _C

__all__ = ["ShmChannel", "supported"]

SLOTS = 8
LAYOUT_WORDS = 512
_HDR = 4 + LAYOUT_WORDS  # tag, generation, capacity, n words, layout words
_CTRL = 16  # W at 0, R at 8 (separate cache lines); pids at 2 (dst) and 10 (src)
_W, _R, _DST_PID, _SRC_PID = 0, 8, 2, 10
_SPIN_S = 0.0002  # poll with sched_yield this long, then sleep between polls (frees the core)
_LIVENESS_S = 0.2  # how often a long wait checks that the peer process is alive
_SHM_DIR = "/dev/shm"


def supported(device: torch.device) -> bool:
    """Shared memory works for CPU tensors on x86-64 Linux (TSO store order, /dev/shm)."""
    return device.type == "cpu" and platform.machine() in ("x86_64", "AMD64") and os.path.isdir(_SHM_DIR)


def _map(path: str, nbytes: int, create: bool) -> torch.Tensor:
    """``nbytes`` of the file at ``path``, shared; attaching to a missing file raises (never creates one)."""
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        mapped = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    return torch.frombuffer(mapped, dtype=torch.uint8)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (an exited rank stays one until its parent reaps it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


class _Ring:
    """One direction of one pair: the control block and (on the sender) the data files."""

    def __init__(self, prefix: str, src: int, dst: int, ctrl: torch.Tensor) -> None:
        self.prefix, self.src, self.dst = prefix, src, dst
        self.ctrl = ctrl.view(torch.int64)
        self.data: list[Optional[torch.Tensor]] = [None] * SLOTS
        self.gen = [0] * SLOTS

    def header(self, slot: int) -> torch.Tensor:
        base = _CTRL + slot * _HDR
        return self.ctrl[base:base + _HDR]

    def data_path(self, slot: int, gen: int) -> str:
        return f"{self.prefix}_d{self.src}_{self.dst}_{slot}_{gen}"


class _Done:
    """A send: complete when ``send`` returns (the bytes are in shared memory)."""

    __slots__ = ()

    def wait(self, timeout: Optional[float], what: str) -> list[torch.Tensor]:
        return []

    def is_completed(self) -> bool:
        return True


_DONE = _Done()


class _Recv:
    __slots__ = ("channel", "peer", "tag")

    def __init__(self, channel: "ShmChannel", peer: int, tag: int) -> None:
        self.channel, self.peer, self.tag = channel, peer, tag

    def wait(self, timeout: Optional[float], what: str) -> list[torch.Tensor]:
        return self.channel._wait_message(self.peer, self.tag, timeout, what)

    def is_completed(self) -> bool:
        return (self.peer, self.tag) in self.channel._stash


class ShmChannel:
    """The executor's ``Channel`` over shared memory; build it with :meth:`create` (a collective).

    ``send``/``recv`` also work outside a step (``stepless``), which the step
    header uses.
    """

    stepless = True

    def __init__(self, rank: int, world: int, prefix: str, inbound: dict[int, _Ring], outbound: dict[int, _Ring],
                 num_stages: Optional[int] = None) -> None:
        self.rank, self.world, self.prefix, self.num_stages = rank, world, prefix, num_stages
        self._in, self._out = inbound, outbound
        self._stash: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._peer_pids = {p: int(r.ctrl[_SRC_PID]) for p, r in inbound.items()}

    @classmethod
    def create(cls, group: Optional[dist.ProcessGroup] = None, device: torch.device = torch.device("cpu"),
               num_stages: Optional[int] = None) -> Optional["ShmChannel"]:
        """Set up rings between every pair of ranks of ``group``; None where shared memory is not shared.

        A collective: every rank calls it and all get a channel or all get None
        (a rank that is not ``supported``, different hosts, or a /dev/shm that
        is not the same file system).
        """
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if not _all_ok(supported(torch.device(device)), group):
            return None
        names: list = [uuid.uuid4().hex if rank == 0 else None]
        src0 = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(names, src=src0, group=group)
        prefix = os.path.join(_SHM_DIR, f"pipeline_ext_{names[0]}")
        ctrl_bytes = (_CTRL + SLOTS * _HDR) * 8
        ctrl_path = lambda s, d: f"{prefix}_c{s}_{d}"  # noqa: E731
        inbound, outbound, ok = {}, {}, True
        try:
            for src in range(world):
                if src != rank:
                    inbound[src] = _Ring(prefix, src, rank, _map(ctrl_path(src, rank), ctrl_bytes, create=True))
                    inbound[src].ctrl[_DST_PID] = os.getpid()
        except OSError:
            ok = False
        ok = _all_ok(ok, group)
        if ok:
            try:
                for dst in range(world):
                    if dst != rank:
                        outbound[dst] = _Ring(prefix, rank, dst, _map(ctrl_path(rank, dst), ctrl_bytes, create=False))
                        outbound[dst].ctrl[_SRC_PID] = os.getpid()
            except (OSError, RuntimeError):
                ok = False
            ok = _all_ok(ok, group)
        if ok:  # every end sees its peers' pids: the files really are shared
            ok = all(int(r.ctrl[_SRC_PID]) > 0 for r in inbound.values()) and \
                 all(int(r.ctrl[_DST_PID]) > 0 for r in outbound.values())
            ok = _all_ok(ok, group)
        for src in inbound:
            _unlink(ctrl_path(src, rank))
        return cls(rank, world, prefix, inbound, outbound, num_stages) if ok else None

    # -- the Channel protocol ---------------------------------------------------------------
    def begin_step(self, signature: int) -> bool:
        """Messages carry their layouts: nothing to discover. Always False."""
        return False

    def end_step(self) -> None:
        """Nothing to commit."""

    def send(self, tensors: Sequence[torch.Tensor], peer: int, tag: int) -> _Done:
        """Pack into the next slot of the ring to ``peer`` (waiting for a free one if all are full)."""
        ring = self._out[peer]
        ctrl = ring.ctrl
        w = int(ctrl[_W])
        if w - int(ctrl[_R]) >= SLOTS:
            self._wait_for(lambda: w - int(ctrl[_R]) < SLOTS, peer, 300.0,
                           f"rank {self.rank} waiting for a free slot to rank {peer}", drain=True)
        slot = w % SLOTS
        tensors = list(tensors)
        need = sum(t.numel() * t.element_size() + 64 for t in tensors) or 1
        data = ring.data[slot]
        if data is None or data.numel() < need:
            ring.gen[slot] += 1
            cap = max(need, 2 * (0 if data is None else data.numel()), 4096)
            ring.data[slot] = data = _map(ring.data_path(slot, ring.gen[slot]), cap, create=True)
        _, layout = ops.pack(tensors, out=data)
        words = layout.to_tensor()
        if words.numel() > LAYOUT_WORDS:
            raise _C.ChannelError(f"rank {self.rank}: a message of {len(tensors)} tensors has too long a layout")
        hdr = ring.header(slot)
        hdr[0], hdr[1], hdr[2], hdr[3] = tag, ring.gen[slot], data.numel(), words.numel()
        hdr[4:4 + words.numel()] = words
        ctrl[_W] = w + 1  # publish last (x86 TSO: the stores above are visible first)
        return _DONE

    def recv(self, peer: int, tag: int) -> _Recv:
        """A handle; its ``wait`` reads the ring from ``peer`` until the message with ``tag``."""
        return _Recv(self, peer, tag)

    # -- receiving ---------------------------------------------------------------------------
    def _read_one(self, peer: int) -> bool:
        """Move the oldest unread message from ``peer`` into the stash; False if there is none."""
        ring = self._in[peer]
        ctrl = ring.ctrl
        r = int(ctrl[_R])
        if int(ctrl[_W]) <= r:
            return False
        slot = r % SLOTS
        hdr = ring.header(slot)
        tag, gen, cap, n = (int(v) for v in hdr[:4].tolist())
        layout = _C.PackLayout.from_tensor(hdr[4:4 + n].clone())
        if ring.gen[slot] != gen:
            path = ring.data_path(slot, gen)
            ring.data[slot] = _map(path, cap, create=False)
            ring.gen[slot] = gen
            _unlink(path)  # both ends have it mapped now
        own = ring.data[slot][:max(layout.nbytes, 1)].clone()  # the slot is reused once R moves on
        ctrl[_R] = r + 1
        self._stash[(peer, tag)] = ops.unpack(own, layout)
        return True

    def _drain(self) -> None:
        for peer in self._in:
            while self._read_one(peer):
                pass

    def _wait_message(self, peer: int, tag: int, timeout: Optional[float], what: str) -> list[torch.Tensor]:
        key = (peer, tag)

        def arrived() -> bool:
            while key not in self._stash and self._read_one(peer):
                pass
            return key in self._stash

        if not arrived():
            self._wait_for(arrived, peer, timeout, what, drain=False)
        return self._stash.pop(key)

    def _wait_for(self, done, peer: int, timeout: Optional[float], what: str, drain: bool) -> None:
        """Poll ``done`` (yielding the core, then sleeping briefly), with a timeout and a dead-peer check."""
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        next_check = start + _LIVENESS_S
        while True:
            if drain:
                self._drain()
            if done():
                return
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise _C.ChannelTimeout(f"{what}: timed out after {int(timeout * 1000)} ms")
            if now >= next_check:
                next_check = now + _LIVENESS_S
                pid = self._peer_pids.get(peer, 0)
                if pid and not _alive(pid):
                    raise _C.ChannelError(f"{what}: peer rank {peer} (pid {pid}) has exited")
            if now - start < _SPIN_S:
                os.sched_yield()
            else:
                time.sleep(5e-5)



def _all_ok(ok: bool, group: Optional[dist.ProcessGroup]) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
