"""The same-host CUDA IPC transport's choice, on CPU (comm/transport/: check_request, ipc_unavailable, decide_transport).

What only a GPU can show (the copies, the events, the handle cache on real
handles, a peer killed mid-copy) runs in ``tools/gpu_check.sh`` (step
``ipc_suites``). Here: which transport every branch of the decision gives,
from plain descriptions; the refusals and their messages; and the real setup
over Gloo between two processes, where this build (no CUDA) makes every rank
fall back to the process group together, or refuse ``transport="ipc"`` naming why.
"""
from __future__ import annotations

import pytest
import torch

from mp_utils import run_ranks
from pipeline_ext.comm.transport import (TRANSPORT_ENV, make_channel, check_request, decide_transport, ipc_unavailable,
                                         probe_verdict, requested_transport)
from pipeline_ext.runtime._ext import _C
from pipeline_ext.runtime.channel import ChannelError

HOST = "box|boot|(1, 2)|4026531836"


def _me(**kw) -> dict:
    """A CUDA stage's description (``_Setup._describe``) that can use CUDA IPC, with ``kw`` changed."""
    return {"host": HOST, "ring_bytes": 8 << 20, "segment": "/proc/1/fd/3", "error": "", "ipc": "",
            "acks": "/proc/1/fd/4", **kw}


def test_ipc_is_a_transport_by_argument_and_environment(monkeypatch):
    assert requested_transport("ipc") == "ipc"
    monkeypatch.setenv(TRANSPORT_ENV, " IPC ")
    assert requested_transport(None) == "ipc"
    assert requested_transport("nccl") == "process_group"  # the argument wins


def test_ipc_on_cpu_stages_is_refused_before_any_setup():
    with pytest.raises(ValueError, match=r"transport='ipc' moves CUDA tensors between the processes of one host; "
                                         r"stages on cpu use shared memory or the process group"):
        check_request("ipc", torch.device("cpu"))
    with pytest.raises(ValueError, match="transport='ipc' moves CUDA tensors"):
        make_channel(None, "cpu", 2, "ipc")  # no process group needed to refuse
    with pytest.raises(ValueError, match="transport='shm' moves CPU tensors; stages on cuda:0"):
        check_request("shm", torch.device("cuda", 0))
    for choice in ("auto", "process_group", "ipc"):
        check_request(choice, torch.device("cuda", 0))
    for choice in ("auto", "process_group", "shm"):
        check_request(choice, torch.device("cpu"))


def test_this_process_says_why_it_cannot_use_ipc():
    assert ipc_unavailable("cpu") == "stages on cpu, not a CUDA device"
    if not _C.with_cuda:
        assert ipc_unavailable("cuda:0") == "pipeline_ext._C was built without CUDA"
    else:  # a CUDA build: the C++ channel is there; the device may not be
        assert hasattr(_C, "IpcChannel")


def test_gpu_stages_on_one_host_that_can_use_ipc_take_it():
    assert decide_transport("cuda", 0, _me(), {1: _me(), 2: _me()}) == ("ipc", "")


def test_cpu_stages_on_one_host_take_shared_memory():
    cpu = {"host": HOST, "ring_bytes": 8 << 20, "segment": "/proc/1/fd/3", "error": ""}
    assert decide_transport("cpu", 0, cpu, {1: dict(cpu)}) == ("shm", "")


def test_another_host_falls_back_to_the_process_group_naming_the_hosts():
    kind, reason = decide_transport("cuda", 0, _me(), {1: _me(), 2: _me(host="other|b|(1, 2)|9")})
    assert kind == "process_group"
    assert reason == "hosts: box, other (other boot or namespace)"


def test_a_rank_without_ipc_makes_every_rank_fall_back_naming_it():
    peers = {1: _me(ipc="pipeline_ext._C was built without CUDA", acks=""), 2: _me()}
    kind, reason = decide_transport("cuda", 0, _me(), peers)
    assert (kind, reason) == ("process_group", "no CUDA IPC (rank 1: pipeline_ext._C was built without CUDA)")
    # rank 2 sees the same descriptions (its own among them): the same answer, so every rank falls back together
    assert decide_transport("cuda", 2, _me(), {0: _me(), 1: peers[1]}) == (kind, reason)
    # a description without the key (a rank of an older build) counts as no IPC
    old = {k: v for k, v in _me().items() if k not in ("ipc", "acks")}
    assert decide_transport("cuda", 0, _me(), {1: old})[0] == "process_group"


def test_a_rank_without_an_inbox_makes_every_rank_fall_back():
    kind, reason = decide_transport("cuda", 1, _me(), {0: _me(segment="", error="no space left in /dev/shm")})
    assert (kind, reason) == ("process_group", "no shared-memory inbox (rank 0: no space left in /dev/shm)")
    assert decide_transport("cuda", 1, _me(), {0: _me(acks="")})[0] == "process_group"


def test_the_probe_round_fails_for_every_rank_when_one_rank_could_not_open_a_peers_memory():
    assert probe_verdict({0: "", 1: "", 2: ""}) == ""
    reports = {2: "rank 2 cannot open rank 0's memory: invalid device context", 0: "", 1: "rank 1 cannot open x"}
    # every rank holds every report (its own included), so every rank gets this same reason, in rank order
    assert probe_verdict(reports) == "rank 1 cannot open x; rank 2 cannot open rank 0's memory: invalid device context"


def test_the_acknowledgement_rings_of_an_ipc_channel_are_rings_shared_memory_takes():
    """An IPC channel sends each message's block id back on a shared-memory ring of ACK_RING_BYTES: a size the
    ring refuses would fail every IPC channel at its setup, which only a GPU run reaches."""
    from pipeline_ext.comm.transport import ACK_RING_BYTES, DEFAULT_SPIN_US

    assert _C.ShmChannel(0, 2, ACK_RING_BYTES, DEFAULT_SPIN_US) is not None
    with pytest.raises(ValueError, match="ring_bytes must be a multiple of 4096 and at least"):
        _C.ShmChannel(0, 2, ACK_RING_BYTES // 2, DEFAULT_SPIN_US)


def test_rings_of_different_sizes_are_an_error_on_both_transports():
    with pytest.raises(ChannelError, match=r"PIPELINE_EXT_SHM_RING_BYTES differs between the ranks \(\[1024, 8388608\]\)"):
        decide_transport("cuda", 0, _me(), {1: _me(ring_bytes=1024)})
    with pytest.raises(ChannelError, match="differs between the ranks"):
        decide_transport("cpu", 0, _me(), {1: _me(ring_bytes=1024)})


def error_of(fn, kind: type = Exception) -> str:
    """The message of the ``kind`` error ``fn()`` raises; "no error" when it returns."""
    try:
        fn()
    except kind as exc:
        return str(exc)
    return "no error"


def _setup_on_this_build(rank: int, world: int) -> dict:
    """GPU stages' setup over Gloo, as a Session runs it, on a build and machine without CUDA IPC."""
    import torch.distributed as dist

    import pipeline_ext.comm.transport.setup as transport

    out = {}
    auto = make_channel(dist.new_group([0, 1]), "cuda:0", 2, "auto", timeout=20.0)
    out["auto"] = auto.connect()
    out["auto_by_tag"] = auto.matches_by_tag()
    forced = make_channel(dist.new_group([0, 1]), "cuda:0", 2, "ipc", timeout=20.0)
    out["forced"] = error_of(forced.connect, ChannelError)
    if rank == 1:
        transport._host_id = lambda: "elsewhere|boot|dev|ns"
    elsewhere = make_channel(dist.new_group([0, 1]), "cuda:0", 2, "ipc", timeout=20.0)
    out["other_host"] = error_of(elsewhere.connect, ChannelError)
    return out


@pytest.mark.timeout(60)
def test_gpu_stages_without_ipc_fall_back_together_and_forcing_ipc_names_why():
    res = {r: v for r, (_, v) in run_ranks(_setup_on_this_build, 2, timeout=50).items()}
    if _C.with_cuda and torch.cuda.is_available():
        pytest.skip("this machine can use CUDA IPC: tools/gpu_check.sh runs the transport itself")
    why = ipc_unavailable("cuda:0")
    for rank in (0, 1):
        assert res[rank]["auto"] == "process_group"
        assert res[rank]["auto_by_tag"] is False  # NCCL matches by order: skips between processes stay refused
        assert res[rank]["forced"].startswith("transport='ipc': group "), res[rank]["forced"]
        assert f"cannot use CUDA IPC (no CUDA IPC (rank 0: {why}; rank 1: {why}))" in res[rank]["forced"]
        assert "cannot use CUDA IPC (hosts: " in res[rank]["other_host"], res[rank]["other_host"]
        assert "(other boot or namespace)" in res[rank]["other_host"]


class Opener:
    """Open and close functions for ``_C._HandleCache`` that record what they did (plain data, no device)."""

    def __init__(self) -> None:
        self.opened: list[tuple[int, int, str]] = []
        self.closed: list[tuple[int, int, str]] = []

    def open(self, peer: int, block: int, handle: str) -> str:
        if handle == "bad":
            raise RuntimeError(f"cannot open rank {peer}'s block {block}")
        self.opened.append((peer, block, handle))
        return f"mapped:{handle}"

    def close(self, peer: int, block: int, value: str) -> None:
        self.closed.append((peer, block, value))


def test_handle_cache_opens_once_per_peer_and_block():
    o = Opener()
    cache = _C._HandleCache(4, o.open, o.close)
    assert cache.get(1, 0, "h10") == "mapped:h10"
    assert cache.get(1, 0, "ignored once cached") == "mapped:h10"
    assert cache.get(2, 0, "h20") == "mapped:h20"  # another peer's block 0 is another entry
    assert o.opened == [(1, 0, "h10"), (2, 0, "h20")]
    assert (cache.size, cache.hits, cache.misses, cache.evictions) == (2, 1, 2, 0)
    assert cache.contains(1, 0) and not cache.contains(1, 1)


def test_handle_cache_is_bounded_and_evicts_the_least_recently_used():
    o = Opener()
    cache = _C._HandleCache(2, o.open, o.close)
    cache.get(0, 1, "a")
    cache.get(0, 2, "b")
    cache.get(0, 1, "a")  # (0, 1) is now the most recently used
    cache.get(0, 3, "c")  # full: (0, 2) goes
    assert o.closed == [(0, 2, "mapped:b")]
    assert cache.keys() == [(0, 3), (0, 1)]
    assert (cache.size, cache.capacity, cache.evictions) == (2, 2, 1)
    cache.get(0, 2, "b")  # opened again
    assert o.opened[-1] == (0, 2, "b") and cache.size == 2


def test_handle_cache_failed_open_changes_nothing():
    o = Opener()
    cache = _C._HandleCache(1, o.open, o.close)
    cache.get(0, 1, "a")
    with pytest.raises(RuntimeError, match="cannot open rank 0's block 2"):
        cache.get(0, 2, "bad")
    assert cache.keys() == [(0, 1)] and o.closed == []  # nothing evicted for an open that failed


def test_handle_cache_drops_a_peer_and_closes_everything_on_clear_and_destruction():
    o = Opener()
    cache = _C._HandleCache(8, o.open, o.close)
    for peer, block in [(1, 0), (2, 0), (1, 5), (3, 1), (1, 7)]:
        cache.get(peer, block, f"h{peer}{block}")
    assert cache.erase_peer(1) == 3  # a peer that exited: nothing of it stays open
    assert sorted(c[:2] for c in o.closed) == [(1, 0), (1, 5), (1, 7)]
    assert cache.erase_peer(1) == 0
    assert cache.erase(2, 0) and not cache.erase(2, 0)
    assert cache.evictions == 0  # dropped, not evicted
    cache.clear()
    assert cache.size == 0 and len(o.closed) == 5
    cache.get(4, 4, "x")
    del cache
    import gc
    gc.collect()
    assert o.closed[-1] == (4, 4, "mapped:x")
    with pytest.raises(ValueError, match="capacity must be at least 1"):
        _C._HandleCache(0, o.open, o.close)
