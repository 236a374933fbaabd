"""A steady-state step never synchronises the host and moves the same messages every step (issue 58, item 2).

Why: a GPU pipeline only runs ahead of its kernels if the host never waits
for the device inside a step, and a step can only be captured as a CUDA
graph (and replayed) if every step issues the same operations in the same
order. Both are properties of the library's step path, so they are checked
here on CPU, where every rank is a cheap process, and on ``cuda:0`` with
``torch.cuda.set_sync_debug_mode("error")`` when a GPU is there
(``tools/gpu_check.sh`` runs that case early, step ``steady_state_cuda``).

What runs: 2 ranks, 1F1B, ZB-H1 (I/W split) and interleaved 1F1B (two
stages per rank), plain tensors, 4 microbatches of one shape, 5 steps each:
step 1 discovers the layouts, step 2 is the first known step, steps 3..5
are the steady state. Once over Gloo, once over shared memory, once on
``cuda:0`` over NCCL (GPU only). Each rank records, inside ``step()`` only:

- **host synchronisations**: a ``TorchDispatchMode`` records every op that
  makes the host wait on CUDA (``SYNC_OPS``: ``.item()``'s
  ``_local_scalar_dense``, ``nonzero``, ``equal``, ``masked_select``,
  ``unique``, ``repeat_interleave`` without ``output_size``, boolean-mask
  indexing, ...), and patched Python entry points record what it cannot see
  (``torch.cuda.synchronize``, ``Stream``/``Event.synchronize``, and
  ``Tensor.cpu``/``tolist``/``item``/``numpy``/``__bool__``). On CPU none
  of them waits, which is the point: each is counted where it *would* wait
  on a GPU. The stages (``models.mlp``: Linear, ReLU) and the loss (MSE)
  issue none (checked, ``model_syncs``), so every count is the library's;
  each is reported at its innermost ``pipeline_ext`` frame.
- **the communication sequence**: every call on the C++ channel's Python
  face (``_C.Channel.send``/``recv``/``recv_layout``/``begin_step``,
  ``_C.ProcessGroupChannel.begin_batch``/``end_batch``: what the executor's
  messages become, ``comm/transport/channels.py``) and every
  ``torch.distributed`` call (the step records' ``batch_isend_irecv``,
  ``_C.wait_work``), as (operation, peer, group, shapes, tag within the
  step): step numbers are left out, they differ by design.

Host-side by design (``HOST_SIDE``, allowed in the steady state):

- the step records (``comm/agreement.py``, ``PendingExchange._settle``): each
  step's 103-word record from every peer is decoded with ``.tolist()`` to
  decide the step on the host. They travel over the pipeline's own group on
  CPU and over its Gloo twin (``comm/session.host_group``) on a GPU, so the
  buffers are always CPU tensors: a host read, never a device wait. Their
  exchange (one ``batch_isend_irecv`` of a send and a receive per peer, then
  ``wait_work`` on each) is in the sequence every step, the same every step.

What is asserted: no other synchronisation in steps 3..5; the sequences of
steps 2..5 identical on every rank; step 1 (discovery) moves the same data
messages, each preceded by its layout (``[Note: known and discovery steps]``
in ``comm/comm_plan.py``), so only it differs, and reads nothing but the
records, each received layout and (shared memory) the transport's
descriptions at the group's first connect (``DISCOVERY_SIDE``).

Two more checks of what a GPU run alone would show:

- where a step waits for its sends (``Executor._reap``) must not depend on
  when they complete: on NCCL that is the GPU's progress, and each wait is a
  device-side stream wait, so a progress-driven reap makes the device-side
  operation stream differ from step to step. Played on CPU with scripted
  completions; it does depend on them today (xfail, strict: the reason names
  the place and a proposal);
- the NCCL ordering model's verdict on torch PR 195760's looped schedule (a
  cycle on one shared communicator, none under the runtime's choices), run
  with the runtime on ``cuda:0`` over NCCL when a GPU is there (step
  ``nccl_order`` of ``tools/gpu_check.sh``), over Gloo otherwise.
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from models import build, loss_fn, make_batch
from mp_utils import device_under_test, rank_values

SCHEDULES = ["1f1b", "zb_h1", "interleaved_1f1b"]
MULTI_STAGE = {"interleaved_1f1b"}
STEPS, DISCOVERY = 5, 2  # steps 3..5 are the steady state
MICROBATCHES, ROWS = 4, 16

#: ops that make the host wait for the device on CUDA, by overload packet name, as the dispatch mode sees them
#: (below the composite ops: ``.item()``, ``bool()``, ``allclose`` arrive as ``_local_scalar_dense``); an output
#: whose size is data (``nonzero``, ``masked_select``, ``unique*``, ``bincount``) is read back to allocate it.
#: ``_assert_async`` is a device-side check rather than a wait, listed too: a steady step checks no data
SYNC_OPS = frozenset({
    "_local_scalar_dense", "is_nonzero", "nonzero", "equal", "masked_select", "_unique", "_unique2", "unique_dim",
    "unique_consecutive", "unique_dim_consecutive", "bincount", "_assert_async",
})
#: where a host read is the design, not a device wait (see the module doc): (file under pipeline_ext, function)
HOST_SIDE = {("pipeline_ext/comm/agreement.py", "PendingExchange._settle"):
             "the step records' decode (CPU tensors over Gloo)"}
#: what a discovery step (step 1) reads besides: each received layout (a device wait on NCCL, once per message of
#: a step with a new microbatch signature: [Note: known and discovery steps]), and the same-host transport's
#: descriptions at the group's first connect (host memory)
DISCOVERY_SIDE = {("pipeline_ext/comm/comm_plan.py", "StepMessages._resolve"): "a received layout",
                  ("pipeline_ext/comm/transport/setup.py", "_Setup._gather"): "the ranks' transport descriptions"}

_MISSING = object()
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__import__("pipeline_ext").__file__)))
_LIB = os.path.join(_PKG, "pipeline_ext") + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _where(f: Any) -> str:
    code = f.f_code
    return f"{os.path.relpath(code.co_filename, _PKG)}:{f.f_lineno} ({getattr(code, 'co_qualname', code.co_name)})"


def _site() -> str:
    """Who made the read: the innermost ``pipeline_ext`` frame (file:line (function)), else the innermost frame
    outside torch and this recorder (the test's own code)."""
    f, other = sys._getframe(1), None
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(_LIB):
            return _where(f)
        if other is None and not name.startswith(_TORCH) and f.f_code not in _RECORDER_CODE:
            other = f
        f = f.f_back
    return _where(other) if other is not None else "?"


def _waits_on_cuda(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` on these arguments makes the host wait for a CUDA device."""
    name = func._overloadpacket.__name__
    if name in SYNC_OPS:
        return True
    if name == "repeat_interleave":  # the output's size is the repeats' sum, read on the host unless given
        return kwargs.get("output_size") is None
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):  # a boolean mask: nonzero inside
        indices = args[1] if len(args) > 1 else ()
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
    return False


#: the recorder's own frames (its wrappers), never a site
_RECORDER_CODE: set = set()


class Recorder(TorchDispatchMode):
    """Records, while ``active``: host synchronisations (by site) and the communication sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.syncs: list[tuple[str, str]] = []  # (what, site)
        self.comm: list[tuple] = []
        self._labels: dict[int, str] = {}
        self._nested = 0  # inside a recorded torch.distributed call: its own inner calls are not new operations
        self._keep: list[Any] = []  # labelled objects, so an id is never reused within a run

    # -- host synchronisations -----------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if self.active and _waits_on_cuda(func, args, kwargs):
            self._sync(f"aten.{func._overloadpacket.__name__}")
        return func(*args, **kwargs)

    def _sync(self, what: str) -> None:
        self.syncs.append((what, _site()))

    # -- the sequence --------------------------------------------------------------------------
    def label(self, obj: Any, kind: str) -> str:
        """A name for a channel or group, stable within the run (first-seen order on this rank)."""
        key = id(obj)
        if key not in self._labels:
            self._labels[key] = f"{kind}#{sum(v.startswith(kind) for v in self._labels.values())}"
            self._keep.append(obj)
        return self._labels[key]

    def op(self, *entry: Any) -> None:
        if self.active and not self._nested:
            self.comm.append(entry)

    def take(self) -> tuple[list, list]:
        out = self.syncs, self.comm
        self.syncs, self.comm = [], []
        return out


_RECORDER_CODE.update({Recorder.__torch_dispatch__.__code__, Recorder._sync.__code__})


def _shapes(tensors: Any) -> tuple:
    return tuple((tuple(t.shape), str(t.dtype).replace("torch.", "")) for t in tensors)


def _in_step(tag: int) -> int:
    from pipeline_ext.runtime.tags import message_of

    return message_of(tag)


@contextlib.contextmanager
def _patched(rec: Recorder) -> Iterator[None]:
    """Every entry point the dispatch mode cannot see, wrapped for ``rec``; all put back at the end.

    The C++ channels' methods are patched on their pybind classes (``send``/``recv``/``recv_layout``/
    ``begin_step`` live on the base ``_C.Channel``), so every C++ channel the library calls is seen;
    ``torch.distributed``'s functions in both of its namespaces (``P2POp`` checks ``op is isend``).
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from pipeline_ext.runtime._ext import _C

    undo: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        old = owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name)
        undo.append((owner, name, old))  # inherited (torch.Tensor's from TensorBase): deleted again at the end
        setattr(owner, name, make(getattr(owner, name)))

    # host reads the dispatch mode cannot see (tolist, numpy, cpu on a CUDA tensor: no op of their own there)
    def reading(what: str) -> Callable[[Any], Any]:
        def make(orig: Any) -> Any:
            def wrapper(*a: Any, **k: Any) -> Any:
                if rec.active:
                    rec._sync(what)
                return orig(*a, **k)
            _RECORDER_CODE.add(wrapper.__code__)
            return wrapper
        return make

    for name in ("cpu", "tolist", "item", "numpy", "__bool__"):
        patch(torch.Tensor, name, reading(f"Tensor.{name}"))
    patch(torch.cuda, "synchronize", reading("torch.cuda.synchronize"))
    patch(torch.cuda.Stream, "synchronize", reading("torch.cuda.Stream.synchronize"))
    patch(torch.cuda.Event, "synchronize", reading("torch.cuda.Event.synchronize"))
    # a received layout read on the host (discovery steps only; on NCCL its words are in device memory)
    read_layout = reading("PackLayout.from_tensor")(_C.PackLayout.from_tensor)
    undo.append((_C.PackLayout, "from_tensor", _C.PackLayout.__dict__["from_tensor"]))
    _C.PackLayout.from_tensor = staticmethod(read_layout)

    # the C++ channel's Python face (its pybind signatures' argument names)
    names = {"send": ("tensors", "peer", "tag", "expected", "with_layout", "out", "owned"),
             "recv": ("layout", "peer", "tag"), "recv_layout": ("peer", "tag")}

    def channel(op: str) -> Callable[[Any], Any]:
        def make(orig: Any) -> Any:
            def wrapper(self: Any, *a: Any, **k: Any) -> Any:
                who = rec.label(self, type(self).__name__)
                got = {**dict(zip(names.get(op, ()), a)), **k}
                if op == "send":
                    rec.op("send+layout" if got.get("with_layout") else "send", got["peer"], who,
                           _shapes(got["tensors"]), _in_step(got["tag"]))
                elif op == "recv":
                    layout = got["layout"]
                    rec.op("recv", got["peer"], who, tuple((tuple(s), str(d).replace("torch.", ""))
                                                           for s, d in zip(layout.shapes, layout.dtypes)),
                           _in_step(got["tag"]))
                elif op == "recv_layout":
                    rec.op("recv_layout", got["peer"], who, (((_C.Channel.LAYOUT_WORDS,), "int64"),),
                           _in_step(got["tag"]))
                else:
                    rec.op(op, None, who, (), None)
                return orig(self, *a, **k)
            return wrapper
        return make

    for op in ("send", "recv", "recv_layout", "begin_step"):
        patch(_C.Channel, op, channel(op))
    for op in ("begin_batch", "end_batch"):
        patch(_C.ProcessGroupChannel, op, channel(op))

    def wait_work(orig: Any) -> Any:
        def wrapper(work: Any, *a: Any) -> Any:
            rec.op("wait_work", None, None, (), None)
            return orig(work, *a)
        return wrapper

    patch(_C, "wait_work", wait_work)

    # torch.distributed, as the library calls it (the step records; anything else would show here too)
    def distributed(name: str) -> Callable[[Any], Any]:
        def make(orig: Any) -> Any:
            def wrapper(*a: Any, **k: Any) -> Any:
                if name == "batch_isend_irecv":
                    ops = a[0] if a else k["p2p_op_list"]
                    rec.op("batch_isend_irecv", None, None, (), None)
                    for p in ops:
                        rec.op(p.op.__name__.strip("_"), p.peer, rec.label(p.group, "group"), _shapes([p.tensor]),
                               p.tag)
                else:
                    tensors = [x for x in list(a) + list(k.values()) if isinstance(x, torch.Tensor)]
                    group = k.get("group")
                    peer = k.get("dst", k.get("src", a[1] if len(a) > 1 and isinstance(a[1], int) else None))
                    rec.op(name, peer, rec.label(group, "group") if group is not None else "default",
                           _shapes(tensors), k.get("tag"))
                rec._nested += 1
                try:
                    return orig(*a, **k)
                finally:
                    rec._nested -= 1
            wrapper.__name__ = orig.__name__
            return wrapper
        return make

    for name in ("isend", "irecv", "send", "recv", "batch_isend_irecv", "all_reduce", "all_gather",
                 "all_gather_into_tensor", "all_gather_object", "broadcast", "broadcast_object_list", "barrier",
                 "reduce_scatter_tensor", "gather", "scatter", "all_to_all_single", "monitored_barrier"):
        make = distributed(name)
        wrapped = make(getattr(c10d, name))
        for owner in (c10d, dist):
            undo.append((owner, name, getattr(owner, name)))
            setattr(owner, name, wrapped)
    try:
        yield
    finally:
        for owner, name, old in reversed(undo):
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


def _steady_steps(rank: int, world: int, names: list[str], steps: int) -> dict[str, Any]:
    """Per schedule: this rank's syncs and communication sequence in each of ``steps`` steps; and the model's own."""
    import pipeline_ext as pe
    from pipeline_ext import schedules as S

    device = device_under_test()
    cuda = device.type == "cuda"
    x, y = make_batch("mlp", ROWS)
    rec = Recorder()
    out: dict[str, Any] = {}
    with _patched(rec), rec:
        # the stages and the loss alone (the unsplit model): they must issue none, so every count is the library's
        ref = build("mlp", 4)
        rec.active = True
        h = x
        for m in ref:
            h = m(h)
        loss_fn(h, y).backward()
        rec.active = False
        out["model_syncs"] = rec.take()[0]
        for name in names:
            v = 2 if name in MULTI_STAGE else 1
            modules = build("mlp", world * v)
            placement = S.build(name, world, MICROBATCHES, stages_per_rank=v).stage_to_rank
            mine = [s for s, r in enumerate(placement) if r == rank]
            stages = [pe.PipelineStage(modules[s], s, world * v, device) for s in mine]
            sched = pe.get_schedule_class(name)(stages if v > 1 else stages[0], MICROBATCHES, loss_fn=loss_fn)
            args = (x,) if 0 in mine else ()
            target = y if world * v - 1 in mine else None
            per_step = []
            for i in range(steps):
                steady = i >= DISCOVERY
                if cuda:
                    torch.cuda.synchronize()
                with (_sync_errors() if cuda and steady else contextlib.nullcontext()):
                    rec.active = True
                    try:
                        sched.step(*args, target=target)
                    finally:
                        rec.active = False
                syncs, comm = rec.take()
                per_step.append({"syncs": syncs, "comm": comm})
            out[name] = per_step
            for m in modules:
                m.zero_grad(set_to_none=True)
    return out


@contextlib.contextmanager
def _sync_errors() -> Iterator[None]:
    """On a GPU: any host-device synchronisation inside the block raises (torch's own check of the device side)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _host_side(site: str, allowed: Any = HOST_SIDE) -> bool:
    """Whether a site (``file:line (qualified function)``) is one of ``allowed`` (or a comprehension in it)."""
    file, _, rest = site.partition(":")
    func = rest.partition("(")[2].rstrip(")")
    return any(file == f and (func == q or func.startswith(q + ".")) for f, q in allowed)


def _data(seq: list[tuple]) -> Counter:
    """The data messages of a sequence (what travels, whatever the order and the layouts around it)."""
    ops = {"send": "send", "send+layout": "send", "recv": "recv"}
    return Counter((ops[e[0]],) + tuple(e[1:]) for e in seq if e[0] in ops)


def _steady_violations(results: dict[int, dict]) -> list[str]:
    """Every host synchronisation of steps 3..5 outside HOST_SIDE (of step 1 outside it and DISCOVERY_SIDE), and
    every step whose sequence differs."""
    bad = []
    for rank, per_schedule in sorted(results.items()):
        for name in SCHEDULES:
            steps = per_schedule[name]
            for what, site in steps[0]["syncs"]:
                if not _host_side(site, {**HOST_SIDE, **DISCOVERY_SIDE}):
                    bad.append(f"{name} rank {rank} step 1 (discovery): {what} at {site}")
            for i, step in enumerate(steps[DISCOVERY:], DISCOVERY + 1):
                for (what, site), n in sorted(Counter(step["syncs"]).items()):
                    if not _host_side(site):
                        bad.append(f"{name} rank {rank} step {i}: {what} x{n} at {site}")
            known = [s["comm"] for s in steps[1:]]
            for i, seq in enumerate(known[1:], 3):
                if seq != known[0]:
                    first = next((k for k, (a, b) in enumerate(zip(seq, known[0])) if a != b),
                                 min(len(seq), len(known[0])))
                    bad.append(f"{name} rank {rank}: step {i}'s communication differs from step 2's at operation "
                               f"{first}: {seq[first:first + 2]} vs {known[0][first:first + 2]}")
            if _data(steps[0]["comm"]) != _data(known[0]):
                bad.append(f"{name} rank {rank}: the discovery step moved other data messages than step 2: "
                           f"{_data(steps[0]['comm']) - _data(known[0])} / {_data(known[0]) - _data(steps[0]['comm'])}")
    return bad


def test_the_recorder_sees_each_kind_of_read_and_names_who_made_it():
    """The instrument first: each kind of read it counts is seen and attributed to the right frame, the step
    records' decode is the one allowed site, and a channel's messages come out as (operation, peer, group,
    shapes, tag within the step)."""
    from loopback_pg import Loopback
    from pipeline_ext.comm.transport import DistChannel
    from pipeline_ext.runtime.skips import unpack_skips
    from pipeline_ext.runtime.tags import step_bits

    rec = Recorder()
    t = torch.tensor([1.0, 0.0, 2.0])
    here = os.path.relpath(__file__, _PKG)
    with _patched(rec), rec:
        rec.active = True
        t.sum().item()
        t.nonzero()
        bool(t.sum())
        unpack_skips(["a"], [torch.tensor([False]), t])  # the library's frame: a skip message's mask read
        channel = DistChannel(Loopback(), "cpu", num_stages=2)
        channel.send([t], 1, step_bits(7) | 3)[0].wait(5.0, "send")
        rec.active = False
        t.tolist()  # not recorded: outside a step
    syncs, comm = rec.take()
    whats = Counter(what for what, _ in syncs)
    assert whats == {"Tensor.item": 1, "aten._local_scalar_dense": 2, "aten.nonzero": 1, "Tensor.__bool__": 1,
                     "Tensor.tolist": 1}, syncs
    assert all(site.startswith(here) for what, site in syncs if what != "Tensor.tolist"), syncs
    library = [site for what, site in syncs if what == "Tensor.tolist"]
    assert library[0].startswith("pipeline_ext/runtime/skips.py:") and library[0].endswith("(unpack_skips)"), library
    assert not _host_side(library[0])
    assert _host_side("pipeline_ext/comm/agreement.py:515 (PendingExchange._settle.<locals>.<listcomp>)")
    assert comm == [("send", 1, "ProcessGroupChannel#0", (((3,), "float32"),), 3)], comm


def test_what_the_steady_state_check_reports():
    """The verdict over recorded steps: a read outside the records in a steady step, a step whose sequence
    differs, a discovery step that moves other data, each named; the records' decode and a discovery step's
    layout reads are not."""
    records = ("Tensor.tolist", "pipeline_ext/comm/agreement.py:515 (PendingExchange._settle.<locals>.<listcomp>)")
    layout = ("PackLayout.from_tensor", "pipeline_ext/comm/comm_plan.py:251 (StepMessages._resolve)")
    send = ("send", 1, "ProcessGroupChannel#0", (((4, 16), "float32"),), 0)
    recv = ("recv", 1, "ProcessGroupChannel#0", (((4, 16), "float32"),), 3)
    discovery = {"syncs": [records, layout],
                 "comm": [("recv_layout", 1, "x", (), 3), recv, ("send+layout",) + send[1:]]}
    known = {"syncs": [records], "comm": [recv, send]}
    good = {name: [discovery] + [known] * (STEPS - 1) for name in SCHEDULES}
    assert _steady_violations({0: good}) == []
    read = ("aten._local_scalar_dense", "pipeline_ext/runtime/stage.py:601 (_weight_as_grad)")
    bad = dict(good, zb_h1=[discovery, known, known, {"syncs": [records, read], "comm": [send, recv]}, known])
    said = _steady_violations({1: bad})
    assert said == ["zb_h1 rank 1 step 4: aten._local_scalar_dense x1 at pipeline_ext/runtime/stage.py:601 "
                    "(_weight_as_grad)",
                    f"zb_h1 rank 1: step 4's communication differs from step 2's at operation 0: [{send!r}, "
                    f"{recv!r}] vs [{recv!r}, {send!r}]"], said
    other = dict(good, **{"1f1b": [{"syncs": [records, read], "comm": [recv]}] + [known] * (STEPS - 1)})
    said = _steady_violations({0: other})
    assert len(said) == 2 and "step 1 (discovery): aten._local_scalar_dense" in said[0], said
    assert "discovery step moved other data messages" in said[1], said


@pytest.mark.slow
def test_a_steady_step_never_synchronises_and_repeats_its_messages(rank_device):
    """Steps 3..5 of 1F1B, ZB-H1 and interleaved 1F1B on 2 ranks: no host read outside the step records, and the
    same operations with the same peers, groups and shapes as step 2 (see the module doc)."""
    results = rank_values(_steady_steps, 2, SCHEDULES, STEPS, timeout=240)
    for rank, got in results.items():
        assert got["model_syncs"] == [], f"rank {rank}: the test's model or loss synchronises: {got['model_syncs']}"
        for name in SCHEDULES:
            assert any(e[0] == "send" for e in got[name][-1]["comm"]), (name, rank, got[name][-1]["comm"])
            assert any(e[0] == "recv_layout" for e in got[name][0]["comm"]), "step 1 is a discovery step"
            assert not any(e[0] in ("recv_layout", "send+layout") for e in got[name][1]["comm"]), "step 2 is known"
    bad = _steady_violations(results)
    assert not bad, "\n".join(bad[:30])


class _ScriptedMessages:
    """A step's messages whose handles never block and answer ``is_completed`` as ``done`` says: what NCCL's
    do, where the answer is the GPU's progress at that moment (an event query) and a wait is device-side (the
    compute stream waits for the send's stream, at the point of the call)."""

    def __init__(self, done: bool, grad: torch.Tensor) -> None:
        self.done, self.grad, self.stream = done, grad, []

    def send(self, tensors: Any, peer: int, tag: int, owned: bool = False) -> "_ScriptedHandle":
        self.stream.append(("send", peer, _in_step(tag)))
        return _ScriptedHandle(self, ("wait send", peer, _in_step(tag)), [])

    def recv(self, peer: int, tag: int) -> "_ScriptedHandle":
        self.stream.append(("recv", peer, _in_step(tag)))
        return _ScriptedHandle(self, ("wait recv", peer, _in_step(tag)), [self.grad])

    def batch(self) -> Any:
        return contextlib.nullcontext()


class _ScriptedHandle:
    def __init__(self, owner: _ScriptedMessages, what: tuple, tensors: list) -> None:
        self.owner, self.what, self.tensors = owner, what, tensors

    def wait(self, timeout: Optional[float], what: str) -> list:
        self.owner.stream.append(self.what)
        return self.tensors

    def is_completed(self) -> bool:
        return self.owner.done


class _ScriptedStep:
    skip_stages = frozenset()

    def __init__(self, number: int, messages: _ScriptedMessages) -> None:
        self.number, self.messages = number, messages

    def open(self) -> _ScriptedMessages:
        return self.messages

    def skip_routes(self) -> None:
        return None

    def loss_weights(self) -> list:
        return [1 / MICROBATCHES] * MICROBATCHES


@pytest.mark.xfail(strict=True, reason=(
    "runtime/executor.py, Executor.run: after every action `if st.sends: self._reap(st, block=False)`, and _reap "
    "waits each send whose handle.is_completed() is True. On NCCL that answer is the GPU's progress (an event "
    "query) and the wait is device-side (the compute stream waits for the send's stream there), so where those "
    "waits land among the step's kernels depends on timing: the device-side operation stream differs from step "
    "to step (and an event query cannot run inside a CUDA-graph capture). Proposal: on a channel whose waits are "
    "device-side (a Messages flag read once per step), skip the reap by progress and wait sends at the step's "
    "end only (_reap(block=True), as schedules/nccl_order.py's IssuePolicy.runtime() already models it); the cost: "
    "each input gradient sent as itself (owned) is held until then"))
def test_where_a_step_waits_for_its_sends_does_not_depend_on_when_they_complete():
    """The same step run twice over messages that never block: once every send reports it completed at once,
    once none does until the step's end. A device-side channel (NCCL) sees any mix of the two, by timing, so
    the order of sends, receives and waits must not depend on it."""
    from pipeline_ext import schedules as S
    from pipeline_ext.runtime.executor import Executor, StepInputs
    from pipeline_ext.runtime.stage import StageRunner

    torch.manual_seed(0)
    schedule = S.lower(S.build("1f1b", 2, MICROBATCHES))
    runner = StageRunner(torch.nn.Linear(16, 16), 0, 2)
    executor = Executor(schedule, 0, {0: runner}, timeout=5.0)
    xs = [(torch.randn(4, 16),) for _ in range(MICROBATCHES)]
    streams = []
    for number, done in enumerate((True, False)):
        messages = _ScriptedMessages(done, torch.randn(4, 16))
        executor.run(StepInputs(args=xs), _ScriptedStep(number, messages))
        streams.append(messages.stream)
    assert Counter(streams[0]) == Counter(streams[1])  # the same operations, each once
    assert streams[0] == streams[1], f"completed at once: {streams[0]}\ncompleted at the end: {streams[1]}"


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("stage_device")
def test_the_ordering_models_hang_case_trains_under_the_runtimes_choices():
    """The NCCL ordering model's verdict on torch PR 195760's schedule, checked on the transport it is about.

    Looped BFS, 4 ranks, 2 stages each, 2 microbatches: the model
    (``schedules/nccl_order.py``, tests/schedules/test_nccl_order.py) finds a cycle when
    every message shares one communicator and none under the runtime's
    choices (direction groups, the receive window, batched sends). Gloo
    cannot hang there either way; on ``cuda:0`` over NCCL (each rank an NCCL
    host of its own) this is the model's claim against NCCL itself: the step
    completes and matches the unsplit model. A hang is the run's timeout.
    """
    from pipeline_ext import schedules as S
    from pipeline_ext.schedules import check_fifo_order, model_order
    from test_distributed import _check_step
    from mp_utils import run_ranks

    sch = S.lower(S.build("looped_bfs", 4, 2, 2))
    assert check_fifo_order(sch, discovery=True).ok  # the runtime's choices: no cycle (the first step discovers)
    assert not model_order(sch, "shared", discovery=True).ok  # one shared communicator: the PR's cycle
    results = run_ranks(_check_step, 4, "looped_bfs", "mlp", 2, 8, timeout=100)
    bad = [b for _, (_, errs) in sorted(results.items()) for b in errs]
    assert not bad, "\n".join(bad[:20])
