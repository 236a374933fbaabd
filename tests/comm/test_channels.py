"""Channels: DistChannel over Gloo and over shared memory (2 fresh rank processes), LocalChannel across threads."""
from __future__ import annotations

import os
import queue
import threading
import time
import traceback

import pytest
import torch
from loopback_pg import Loopback
from mp_utils import _fresh_rendezvous, fresh_context
from pipeline_ext.runtime import streams
from pipeline_ext.runtime.channel import ChannelError
from pipeline_ext.runtime.local import LocalHub
from pipeline_ext.comm.comm_plan import PlanCache
from pipeline_ext.comm.transport import AutoChannel, DistChannel, make_channel

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# -- multi-process harness -------------------------------------------------------------------
def _worker(rank: int, init_method: str, scenario: str, results, env: dict) -> None:
    import torch.distributed as dist

    os.environ.clear()  # a forkserver child has the server's environment: the test's comes along
    os.environ.update(env)
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
        channel = make_channel(None, "cpu", 2)  # the transport of $PIPELINE_EXT_TRANSPORT (conftest.transport)
        if isinstance(channel, AutoChannel):
            channel.connect()  # set up now, as Gloo's pairs are at init_process_group
        out = SCENARIOS[scenario](rank, channel)
    except BaseException:  # reported to the parent, which fails the test
        results.put((rank, "error", traceback.format_exc()))
        return
    results.put((rank, "ok", out))
    # Leave at once: some scenarios break the group on purpose (a Gloo pair whose
    # receive timed out is closed), and tearing it down then can stall.
    results.close()
    results.join_thread()
    os._exit(0)


def _run(scenario: str, timeout: float = 40.0, expect_reports: int = 2) -> dict:
    """Start 2 fresh ranks running SCENARIOS[scenario]; returns {rank: result}; never leaves processes.

    Fresh, not the session's pool (``mp_utils.run_ranks``): every scenario ends
    its ranks with ``os._exit``, and some break their group on purpose. They
    come from the tests' fork server (torch already imported) and meet on a
    fresh ``file://`` rendezvous.
    """
    ctx = fresh_context()
    results = ctx.Queue()
    init_method = _fresh_rendezvous()
    procs = [ctx.Process(target=_worker, args=(r, init_method, scenario, results, dict(os.environ)), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    reports: dict = {}
    try:
        deadline = time.monotonic() + timeout
        while len(reports) < expect_reports:
            rank, status, out = results.get(timeout=max(0.1, deadline - time.monotonic()))
            if status != "ok":
                pytest.fail(f"rank {rank} failed:\n{out}")
            reports[rank] = out
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return reports


def _mixed() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=g)
    return [
        torch.tensor(3.5),  # 0-d
        torch.empty(0, 3),  # empty
        torch.tensor([True, False, True]),
        torch.randn(2, 5, generator=g).to(torch.bfloat16),
        base.t(),  # non-contiguous
        base[:, ::2],  # strided
        torch.arange(7, dtype=torch.int64),
    ]


def _scenario_roundtrip(rank: int, channel: DistChannel) -> dict:
    """Discovery step, known step, many tags, then a changed shape under a known plan."""
    import torch.distributed as dist

    out: dict = {}
    plans = PlanCache()
    for step in range(2):
        ch = plans.step(channel, list(range(32)))  # a signature per microbatch
        out[f"discovery{step}"] = not ch.known
        if rank == 0:
            handles = [ch.send(_mixed(), 1, 4)]
            handles += [ch.send([torch.full((t + 1,), float(t))], 1, 100 + t) for t in reversed(range(12))]
            for h in handles:
                h.wait(10.0, "send")
            ch.send([], 1, 5).wait(10.0, "send empty")
        else:
            posted = {t: ch.recv(0, 100 + t) for t in range(12)}
            got = ch.recv(0, 4).wait(10.0, "recv mixed")
            out[f"mixed{step}"] = all(
                a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(got, _mixed())
            ) and len(got) == len(_mixed())
            out[f"tags{step}"] = all(
                torch.equal(posted[t].wait(10.0, f"recv {t}")[0], torch.full((t + 1,), float(t)))
                for t in reversed(range(12))
            )
            out[f"empty{step}"] = ch.recv(0, 5).wait(10.0, "recv empty")
        plans.commit(ch)
    other = make_channel(dist.new_group([0, 1]), "cpu", None)  # any group, peers are its ranks
    other.connect()  # a same-host channel settles its group's transport first (collective), as a step's opening does
    sub = PlanCache().step(other, None)
    if rank == 0:
        sub.send([torch.ones(2, 2)], 1, 0).wait(10.0, "send on new_group")
    else:
        out["new_group"] = torch.equal(sub.recv(0, 0).wait(10.0, "recv on new_group")[0], torch.ones(2, 2))
    ch = plans.step(channel, list(range(32)))  # a signature per microbatch
    if rank == 0:
        with pytest.raises(ChannelError) as err:
            ch.send([torch.zeros(3)] + _mixed()[1:], 1, 4)
        out["shape_error"] = str(err.value)
    if rank == 0:  # a layout that does not fit its fixed-size message is refused before sending
        with pytest.raises(ValueError, match="needs 804 words, more than the 512 a layout message holds"):
            plans.step(channel, [1000] * 32).send([torch.zeros(1)] * 200, 1, 6)
    dist.barrier()
    return out


def _scenario_timeout(rank: int, ch: DistChannel) -> dict:
    import torch.distributed as dist

    out: dict = {}
    if rank == 1:
        try:
            PlanCache().step(ch, None).recv(0, 3).wait(1.0, "rank 1 waiting on RECV_F of stage 1 microbatch 1 with peer rank 0")
        except TimeoutError as exc:
            out["error"] = (type(exc).__name__, str(exc))
    else:
        # Stay alive (and silent) until rank 1 has timed out: a closed peer is another error.
        # No barrier after: Gloo closes the pair to a peer whose receive timed out.
        time.sleep(2.5)
    return out


def _scenario_dead_peer(rank: int, ch: DistChannel) -> dict:
    import torch.distributed as dist

    dist.barrier()  # every connection is up
    if rank == 0:
        os._exit(0)  # dies without a word, like a crashed worker
    try:  # a 1000 s wait: only the peer's death can end it within the test's timeout
        PlanCache().step(ch, None).recv(0, 3).wait(1000.0, "rank 1 waiting on the dead rank 0")
    except ChannelError as exc:
        return {"error": (type(exc).__name__, str(exc))}
    return {"error": None}


SCENARIOS = {"roundtrip": _scenario_roundtrip, "timeout": _scenario_timeout, "dead_peer": _scenario_dead_peer}


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("transport")
def test_dist_roundtrip_discovery_known_and_shape_change():
    res = _run("roundtrip")
    r0, r1 = res[0], res[1]
    assert r0["discovery0"] and not r0["discovery1"] and r1["discovery0"] and not r1["discovery1"]
    for step in range(2):
        assert r1[f"mixed{step}"], f"mixed tensors differ in step {step}"
        assert r1[f"tags{step}"], f"tagged messages mismatched in step {step}"
        assert r1[f"empty{step}"] == []
    assert r1["new_group"]
    msg = r0["shape_error"]
    assert "activation of stage 0 for stage 1, microbatch 1" in msg and "changed shape or dtype" in msg
    assert "[3]" in msg and "[]" in msg  # both layouts are named


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("transport")
def test_dist_recv_times_out_naming_what():
    out = _run("timeout")[1]
    name, msg = out["error"]
    assert name == "ChannelTimeout"
    assert "RECV_F of stage 1 microbatch 1 with peer rank 0" in msg and "timed out after 1000 ms" in msg


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("transport")
def test_dist_dead_peer_raises_instead_of_hanging():
    out = _run("dead_peer", expect_reports=1)[1]
    assert out["error"] is not None
    name, msg = out["error"]
    assert name == "ChannelError" and "dead rank 0" in msg  # a ChannelError, not its subclass ChannelTimeout


# -- in-process channel ----------------------------------------------------------------------
def _spawn_thread(fn, *args) -> tuple[threading.Thread, queue.Queue]:
    box: queue.Queue = queue.Queue()

    def run():
        try:
            box.put(("ok", fn(*args)))
        except BaseException as exc:  # handed to the test thread
            box.put(("error", exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


@pytest.mark.timeout(30)
def test_local_threads_exchange_tensors():
    hub = LocalHub(["cpu", "cpu"], capacity=4)
    a, b = hub.channel(0), hub.channel(1)

    def ping_pong(ch, peer, n):
        got = []
        for i in range(n):
            if ch.rank == 0:
                ch.send([torch.full((2,), float(i)), torch.tensor(i)], peer, i).wait(5.0, "send")
                got.append(ch.recv(peer, 1000 + i).wait(5.0, f"rank 0 recv {i}")[0])
            else:
                x, k = ch.recv(peer, i).wait(5.0, f"rank 1 recv {i}")
                ch.send([x * 2 + k], peer, 1000 + i)
        return got

    t, box = _spawn_thread(ping_pong, b, 0, 50)
    got = ping_pong(a, 1, 50)
    t.join(10)
    assert box.get_nowait()[0] == "ok"
    assert all(torch.equal(g, torch.full((2,), 3.0 * i)) for i, g in enumerate(got))
    assert hub.pending() == 0


@pytest.mark.timeout(30)
def test_local_recv_timeout_and_bound():
    hub = LocalHub(["cpu", "cpu"], capacity=2, send_timeout=0.2)
    a, b = hub.channel(0), hub.channel(1)
    with pytest.raises(TimeoutError, match="rank 1 waiting on RECV_B.*timed out after 300 ms"):
        b.recv(0, 1).wait(0.3, "rank 1 waiting on RECV_B")
    a.send([torch.ones(1)], 1, 1)
    a.send([torch.ones(1)], 1, 2)
    with pytest.raises(TimeoutError, match="per peer"):  # the third message does not fit
        a.send([torch.ones(1)], 1, 3)
    h = b.recv(0, 2)
    assert h.is_completed()
    h.wait(1.0, "x")
    with pytest.raises(ChannelError, match="already waited"):
        h.wait(1.0, "x")


@pytest.mark.timeout(30)
def test_local_close_wakes_waiters_with_reason():
    hub = LocalHub(["cpu"] * 3)
    # 1000 s waits: only the close can end them within the test's timeout (and not as a TimeoutError)
    waiters = [_spawn_thread(hub.channel(r).recv(0, 9).wait, 1000.0, f"rank {r} waiting") for r in (1, 2)]
    time.sleep(0.2)
    hub.close("worker 0 raised ZeroDivisionError")
    for t, box in waiters:
        status, exc = box.get()
        assert status == "error" and isinstance(exc, ChannelError) and not isinstance(exc, TimeoutError)
        assert "worker 0 raised ZeroDivisionError" in str(exc)
    with pytest.raises(ChannelError, match="closed"):
        hub.channel(0).send([torch.ones(1)], 1, 0)


@pytest.mark.timeout(30)
def test_local_wait_releases_the_gil():
    hub = LocalHub(["cpu", "cpu"])
    # The waiter blocks first (1000 s). The send below is Python on this thread: it can only run, and so
    # end the wait, if the waiting thread let go of the GIL; holding it, the test would run into its timeout.
    t, box = _spawn_thread(hub.channel(1).recv(0, 0).wait, 1000.0, "rank 1 waiting")
    time.sleep(0.2)
    hub.channel(0).send([torch.arange(3)], 1, 0)
    status, got = box.get()
    assert status == "ok" and torch.equal(got[0], torch.arange(3))


def test_host_channel_waits_with_the_callers_timeout():
    """On a CPU (Gloo) channel our timeout is passed to every wait; only CUDA channels wait
    device-side (tests/comm/test_cuda_paths.py), so a hung peer still times out here."""
    pg = Loopback()
    channel, plans = DistChannel(pg, "cpu", num_stages=2), PlanCache()
    for step in range(2):  # a discovery step, then a known one
        messages = plans.step(channel, [3])
        send = messages.send([torch.full((2, 3), float(step)), torch.arange(4)], 1, 0)
        got = messages.recv(1, 0).wait(5.0, "recv")
        send.wait(5.0, "send")
        plans.commit(messages)
        assert torch.equal(got[0], torch.full((2, 3), float(step))) and torch.equal(got[1], torch.arange(4))
    assert pg.waits and all(0 < t.total_seconds() <= 5.0 for t in pg.waits)


def test_known_steps_reuse_one_pack_buffer_and_a_send_owns_its_bytes():
    """Several tensors are packed into the plan's reused buffer; one contiguous tensor is copied too,
    into a buffer of the send's own: the backend reads it later, and the stage may write the tensor
    it returned again (a reused output buffer) as soon as the send returned."""
    pg = Loopback()
    channel, plans = DistChannel(pg, "cpu", num_stages=2), PlanCache()
    buffers = []
    for step in range(3):
        messages = plans.step(channel, [3, 4])
        pair = [torch.full((2, 3), float(step)), torch.arange(4) + step]
        single = torch.full((5,), float(step))
        sends = [messages.send(pair, 1, 0), messages.send([single], 1, 2)]
        got_pair, got_single = messages.recv(1, 0).wait(5.0, "pair"), messages.recv(1, 2).wait(5.0, "single")
        for h in sends:
            h.wait(5.0, "send")
        assert torch.equal(got_pair[0], pair[0]) and torch.equal(got_pair[1], pair[1])
        assert torch.equal(got_single[0], single)
        assert pg.sent[-1].data_ptr() != single.data_ptr()  # a copy went on the wire, not the caller's tensor
        grad = torch.full((5,), float(step))  # the pipeline's own (a gradient autograd made): sent as itself
        messages.send([grad], 1, 4, owned=True)
        assert pg.sent[-1].data_ptr() == grad.data_ptr()
        messages.recv(1, 4).wait(5.0, "grad")
        plans.commit(messages)
        buffers.append(plans.send_buffers.get(("send", 1, 0)))
    assert buffers[0] is None  # discovery packs afresh; known steps reuse one buffer
    assert buffers[1] is not None and buffers[1] is buffers[2]


def test_layouts_are_known_per_microbatch_signature_in_any_order():
    """A microbatch seen in an earlier step has known layouts wherever it comes in a later step; a send
    buffer grows to the largest message it carried and sends only the bytes of the current one."""
    pg = Loopback()
    channel, plans = DistChannel(pg, "cpu", num_stages=2), PlanCache()
    rows = {10: 2, 20: 5}  # signature -> rows of that microbatch's activation
    for step, sigs in enumerate([[10, 20], [20, 10], [20, 20], [10, 10], [30, 10]]):
        rows[30] = 7
        messages = plans.step(channel, sigs)
        assert messages.known == (step in (1, 2, 3)), step
        xs = [[torch.full((rows[sig], 3), float(step)), torch.arange(rows[sig])] for sig in sigs]
        sends = [messages.send(x, 1, mb * 4) for mb, x in enumerate(xs)]  # microbatch mb, stage 0's activation
        got = [messages.recv(1, mb * 4).wait(5.0, "recv") for mb in range(len(sigs))]
        for h in sends:
            h.wait(5.0, "send")
        plans.commit(messages)
        for x, g in zip(xs, got):
            assert torch.equal(x[0], g[0]) and torch.equal(x[1], g[1])
    assert set(plans._known) == {10, 20, 30} and plans.cached_layouts == 3 * 2


def test_plan_cache_is_bounded_and_an_evicted_signature_is_rediscovered():
    pg = Loopback()
    channel, plans = DistChannel(pg, "cpu", num_stages=2), PlanCache(max_signatures=8)
    digests = set()
    for shape in list(range(1, 41)) + [1, 2]:  # 40 batch shapes, then two evicted long ago
        x = torch.arange(shape * 3, dtype=torch.float32).reshape(shape, 3)
        messages = plans.step(channel, [("sig", shape)])
        send = messages.send([x], 1, 0)
        got = messages.recv(1, 0).wait(5.0, "recv")
        send.wait(5.0, "send")
        plans.commit(messages)
        assert not messages.known and torch.equal(got[0], x)
        digests.add(plans.digest)
    assert len(plans) == 8 and plans.cached_layouts == 8 * 2  # 8 signatures x (one send + one receive layout)
    assert plans.step(channel, [("sig", 2)]).known  # still cached: a known step
    assert len(digests) == 42  # every commit and eviction changed the digest


# -- CUDA ------------------------------------------------------------------------------------
@pytest.mark.cuda
@cuda
@pytest.mark.timeout(60)
@pytest.mark.parametrize("src,dst", [("cuda:0", "cpu"), ("cpu", "cuda:0"), ("cuda:0", "cuda:0"),
                                     ("cuda:0", f"cuda:{max(0, torch.cuda.device_count() - 1)}")])
def test_local_cuda_copies_on_copy_streams(src, dst):
    hub = LocalHub([src, dst])
    x = torch.randn(256, 256, device=src)
    y = x @ x  # queued on the producer's compute stream
    hub.channel(0).send([y, x[:, 1]], 1, 0)
    got = hub.channel(1).recv(0, 0).wait(10.0, "recv")
    assert got[0].device == torch.device(dst) and got[1].device == torch.device(dst)
    torch.testing.assert_close(got[0].cpu(), (x @ x).cpu())
    torch.testing.assert_close(got[1].cpu(), x[:, 1].cpu())
    if dst != "cpu" and src != dst:
        assert streams.copy_stream(dst, "to_device") != streams.current_stream(dst)


@pytest.mark.cuda
@cuda
def test_stream_event_on_cuda():
    dev = torch.device("cuda:0")
    copy = streams.copy_stream(dev, "to_device")
    ev = streams.Event()
    with streams.use_stream(copy):
        assert streams.current_stream(dev) == copy
        z = torch.ones(1024, 1024, device=dev) * 2
        ev.record(copy)
    streams.current_stream(dev).wait(ev)
    streams.record_stream(z, streams.current_stream(dev))
    ev.synchronize()
    assert ev.query() and float(z.sum()) == 2 * 1024 * 1024


def test_stream_event_are_noops_on_cpu():
    s = streams.copy_stream("cpu", "from_device")
    ev = streams.Event()
    ev.record(s)
    s.wait(ev)
    ev.synchronize()
    with streams.use_stream(s):
        pass
    streams.record_stream(torch.ones(1), s)
    assert ev.query() and s.query() and not s.is_cuda and s == streams.current_stream("cpu")
