"""Tensors the C++ core cannot read (subclasses, wrappers, sparse, nested, quantized, meta) never crash a process.

The core reads a tensor's bytes at its data pointer (pack, every channel's
send, the kernels); a DTensor or another wrapper subclass has no memory of its
own there, and reading it killed the process with SIGSEGV. Every entry point
either handles such a tensor (the custom ops dispatch to a subclass's own
``__torch_dispatch__``) or raises a TypeError naming the argument (stage,
output position, microbatch, or the op's tensor), its kind and what to do.
Each kind runs in a child process, so a crash shows as a signal, not as a dead
test session. See [Note: tensors the core can read] in runtime/ops.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import pipeline_ext as pe
from models import ROOT
from mp_utils import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "tensor_kinds_child.py")

#: kind -> a word its error message must contain
KINDS = {
    "dtensor": "DTensor",
    "wrapper": "TwoTensor",
    "fake": "FakeTensor",
    "jagged": "nested",
    "nested": "nested",
    "sparse_coo": "sparse_coo",
    "sparse_csr": "sparse_csr",
    "quantized": "quantized",
    "meta": "meta",
    "mkldnn": "mkldnn",
}

#: entry -> what its error must name (None: the entry may handle the tensor; "" no name required)
REFUSED = {
    "local_send": "activation of stage 0 for stage 1, microbatch 0 (tag 0, step 0 mod 1024) to rank 1: tensor 1 is",
    "pipe_step_output": "stage 0's output at position 0, microbatch 0",
    "pipe_forward_output": "stage 0's output at position 0, microbatch 0",
}
MAY_HANDLE = {
    "split": "split: the tensor",
    "concat": "concat: tensor 0",
    "concat_mixed": "concat: tensor 1",
    "pack": "pack: tensor 0",
    "pack_out": "pack: tensor 1",
    "split_args": "cannot split args[0] into microbatches",
    "merge": "cannot merge the output over the microbatches",
}


def _results(kind: str, code: int, output: str, stderr: str = "") -> dict[str, dict]:
    """What a child reported per entry; the child must have ended by itself (a negative code: a signal)."""
    started = [line.split()[1] for line in output.splitlines() if line.startswith("ENTRY ")]
    assert code == 0, (
        f"{kind}: the child process ended with code {code} (negative: killed by signal "
        f"{-code}) in entry {started[-1] if started else None}\n{(stderr or output)[-3000:]}"
    )
    results = [json.loads(line[len("RESULT "):]) for line in output.splitlines() if line.startswith("RESULT ")]
    return {r["entry"]: r for r in results}


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), HERE]))


def _run_child(kind: str, *entries: str) -> dict[str, dict]:
    proc = subprocess.run([sys.executable, CHILD, kind, *entries], capture_output=True, text=True, timeout=240,
                          env=_env())
    return _results(kind, proc.returncode, proc.stdout, proc.stderr)


#: imports torch and the child's module once, then forks one process per kind (its own process: a crash in one
#: kind is that child's signal, seen by waitpid) that runs every entry, its output to a file of its own; two at a
#: time (the machine's cores), since they share nothing
_ZYGOTE = """
import json, os, sys, tempfile, traceback
import torch  # noqa: F401
import tensor_kinds_child as child
out, running = {}, {}


def reap():
    pid, status = os.wait()
    kind, path = running.pop(pid)
    with open(path) as f:
        out[kind] = {"code": os.waitstatus_to_exitcode(status), "output": f.read()}
    os.unlink(path)


for kind in json.loads(sys.argv[1]):
    if len(running) >= max(2, os.cpu_count() or 1):
        reap()
    fd, path = tempfile.mkstemp(prefix="pe-tensor-kinds-")
    pid = os.fork()
    if pid == 0:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.argv = [child.__file__, kind]
        code = 0
        try:
            child.main()
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    os.close(fd)
    running[pid] = (kind, path)
while running:
    reap()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def every_kind(request: pytest.FixtureRequest) -> dict[str, dict]:
    """Each selected kind's child, forked from one process that imported torch once (a fresh process per kind).

    Only the kinds this session runs (DTensor's child alone takes most of the time: tests/tiers.py runs it in
    the long tier)."""
    test = "test_every_single_process_entry_point_handles_or_names_a_tensor_the_core_cannot_read"
    kinds = [k for k in KINDS if any(getattr(item, "originalname", "") == test and item.name.endswith(f"[{k}]")
                                     for item in request.session.items)]
    proc = subprocess.run([sys.executable, "-c", _ZYGOTE, json.dumps(kinds)], capture_output=True,
                          text=True, timeout=600, env=_env(), cwd=HERE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_single_process_entry_point_handles_or_names_a_tensor_the_core_cannot_read(kind, every_kind):
    results = _results(kind, every_kind[kind]["code"], every_kind[kind]["output"])
    word = KINDS[kind]
    wrong = []
    for entry, r in results.items():
        said = f"{entry}: {r['outcome']} {r['type']}: {r['message'][:300]}"
        if entry in REFUSED:
            if r["outcome"] != "raised" or r["type"] != "TypeError" or REFUSED[entry] not in r["message"] \
                    or word not in r["message"]:
                wrong.append(said)
        elif entry in MAY_HANDLE and r["outcome"] == "raised":
            if r["type"] not in ("TypeError", "ValueError") or word not in r["message"]:
                wrong.append(said)
            elif r["type"] == "TypeError" and MAY_HANDLE[entry] not in r["message"]:
                wrong.append(said)
        # pipe_input: the tensor reaches the user's first layer as it would unsplit; the layer decides
    assert not wrong, f"{kind}:\n" + "\n".join(wrong)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["expanded", "transposed", "conj"])
def test_plain_tensors_in_odd_layouts_are_exact_at_every_entry_point(kind):
    results = _run_child(kind, "exact")
    assert results["exact"]["outcome"] == "ok", results["exact"]


@pytest.mark.timeout(300)
def test_a_dtensor_stage_output_is_refused_by_name_in_one_child_process():
    """The quick case of the matrix above (not marked slow): the kind that crashed, at the Pipe and the ops.

    The Pipe and a channel refuse a DTensor by name; split, concat and the microbatch merge cut and glue it
    (by its global rows; [Note: splitting a DTensor into microbatches] in runtime/dtensor_wire.py); a plain
    tensor beside a DTensor in one concat is refused."""
    results = _run_child("dtensor", "pipe_step_output", "concat", "concat_mixed", "local_send", "merge", "split")
    assert results["pipe_step_output"]["type"] == "TypeError", results
    message = results["pipe_step_output"]["message"]
    assert "stage 0's output at position 0, microbatch 0 is a DTensor" in message and ".to_local()" in message
    assert all(results[e]["outcome"] == "ok" for e in ("concat", "merge", "split")), results
    assert results["concat_mixed"]["type"] == "TypeError" and "concat: tensor 1 is a DTensor" \
        in results["concat_mixed"]["message"], results
    assert "activation of stage 0 for stage 1, microbatch 0 (tag 0, step 0 mod 1024) to rank 1: tensor 1 is a DTensor" \
        in results["local_send"]["message"]


class _Broadcast(nn.Module):
    """An output that is an expanded (overlapping) view, and one that is a transposed view."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        y = self.lin(x)
        return y.sum(1, keepdim=True).expand(-1, 16) + 0 * y, y.t().contiguous().t()


class _Join(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, pair):
        a, b = pair
        return self.lin(a * b)


@pytest.mark.timeout(120)
def test_pipe_with_view_outputs_matches_the_unsplit_model_over_steps():
    torch.manual_seed(0)
    model = nn.Sequential(_Broadcast(), _Join())
    ref = nn.Sequential(_Broadcast(), _Join())
    ref.load_state_dict(model.state_dict())
    pipe = pe.Pipe(model, balance=[1, 1], devices=["cpu"] * 2, chunks=4, schedule="zb_h1", checkpoint="never")
    opt, ref_opt = torch.optim.SGD(pipe.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, y = torch.randn(8, 16), torch.randn(8, 4)
        opt.zero_grad(), ref_opt.zero_grad()
        loss = pipe.step(x, target=y, loss_fn=nn.functional.mse_loss)
        ref_loss = nn.functional.mse_loss(ref(x), y)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), msg=f"step {step}")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=f"step {step}: {name}")
        opt.step(), ref_opt.step()


# -- multi-process: the reported crash (a DTensor stage output, shared memory and Gloo) -----------------
def _dtensor_stage(rank: int, world: int, through: str) -> str:
    """Stage 0 returns a DTensor (its tp mesh: this rank alone); 2 ranks, pp = 2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from models import loss_fn, make_batch

    tp = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "tp"))["tp"]

    class ToDTensor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            return DTensor.from_local(self.lin(x), tp, [Replicate()])

    x, y = make_batch("mlp", 4)
    try:
        if through == "channel":  # past the stage's check: the channel itself, as a gradient or skip would go
            from pipeline_ext.comm.transport import make_channel

            channel = make_channel(None, "cpu", num_stages=2)
            channel.connect()  # settles the transport: collective
            if rank == 0:
                channel.send([torch.randn(2), ToDTensor()(x)], 1, 0)
            return "no error"
        module = ToDTensor() if rank == 0 else nn.Linear(16, 4)
        stage = pe.PipelineStage(module, rank, world, "cpu")
        sched = pe.ScheduleGPipe(stage, 2, loss_fn=loss_fn, timeout=5.0)
        sched.step(x) if rank == 0 else sched.step(target=y)
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.isolated
@pytest.mark.timeout(180)
@pytest.mark.parametrize("through", ["stage", "channel"])
def test_a_dtensor_between_stages_raises_by_name_and_kills_no_process(transport, through):
    results = run_ranks(_dtensor_stage, 2, through, timeout=120, expect_errors=True)
    died = {r: v for r, (status, v) in results.items() if status == "died"}
    assert not died, f"ranks died (exit codes; negative = signal): {died}"
    if through == "stage":  # it travels (its local shard); the receiver has no mesh to rebuild it on
        status, message = results[1]
        assert status == "ok", message
        assert message.startswith("TypeError: stage 1's input 0, microbatch 0 is a DTensor from stage 0 on mesh "
                                  "('tp',) of shape (1,)") and "stage 1 has no such mesh" in message, message
        return
    status, message = results[0]
    assert status == "ok", message
    assert message.startswith("TypeError:") and "is a DTensor" in message and ".to_local()" in message, message
    assert "activation of stage 0 for stage 1, microbatch 0" in message and "tensor 1" in message, message


def _tensor_parallel_stage(rank: int, world: int) -> str:
    """The reported script: mesh pp=2 x tp=2, stage 0 ends in RowwiseParallel(use_local_output=False)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from models import loss_fn, make_batch

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp = mesh["pp"].get_local_rank()
    torch.manual_seed(0)
    if pp == 0:
        module = parallelize_module(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)), mesh["tp"],
                                    {"0": ColwiseParallel(), "2": RowwiseParallel(use_local_output=False)})
    else:
        module = nn.Linear(16, 4)
    stage = pe.PipelineStage(module, pp, 2, "cpu", group=mesh["pp"].get_group())
    sched = pe.ScheduleGPipe(stage, 2, loss_fn=loss_fn, timeout=5.0)
    x, y = make_batch("mlp", 4)
    try:
        sched.step(x) if pp == 0 else sched.step(target=y)
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.isolated
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pp2_tp2_rowwise_parallel_dtensor_output_without_a_receiving_mesh_raises_by_name(transport):
    results = run_ranks(_tensor_parallel_stage, 4, timeout=240, expect_errors=True)
    died = {r: v for r, (status, v) in results.items() if status == "died"}
    assert not died, f"ranks died (exit codes; negative = signal): {died}"
    for r in (2, 3):  # stage 1's ranks (pp coordinate 1): a plain Linear, no mesh to rebuild the DTensor on
        status, message = results[r]
        assert status == "ok", message
        assert "stage 1's input 0, microbatch 0 is a DTensor from stage 0 on mesh ('tp',) of shape (2,)" in message \
            and "stage 1 has no such mesh" in message, message


# -- merging outputs whose dtype varies per microbatch (issue 45, item 9) ---------------------------------
class _HalfOnShortMicrobatches(nn.Module):
    """Returns float16 for microbatches of fewer than 3 rows (10 rows in 4 microbatches: 3, 3, 2, 2)."""

    def __init__(self, as_dict: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 4)
        self.as_dict = as_dict

    def forward(self, x):
        y = self.lin(x)
        y = y.half() if x.shape[0] < 3 else y
        return {"logits": y, "rows": torch.ones(x.shape[0])} if self.as_dict else y


@pytest.mark.timeout(120)
def test_pipe_output_whose_dtype_varies_per_microbatch_names_output_microbatches_and_dtypes():
    pipe = pe.Pipe(nn.Sequential(nn.Linear(16, 16), _HalfOnShortMicrobatches()), balance=[1, 1],
                   devices=["cpu"] * 2, chunks=4)
    with torch.no_grad():
        with pytest.raises(TypeError) as info:
            pipe(torch.randn(10, 16))
    message = str(info.value)
    assert "cannot merge the output over the microbatches: its dtype varies per microbatch" in message, message
    assert "torch.float32 in microbatches 0, 1" in message and "torch.float16 in microbatches 2, 3" in message


def test_merge_names_the_output_key_whose_dtype_varies():
    from pipeline_ext.runtime.microbatch import merge_chunks

    m = _HalfOnShortMicrobatches(as_dict=True)
    chunks = [m(torch.randn(n, 16)) for n in (3, 2, 3)]
    with pytest.raises(TypeError, match=r"cannot merge output\['logits'\] over the microbatches: its dtype varies "
                                        r"per microbatch \(torch.float32 in microbatches 0, 2; torch.float16 in "
                                        r"microbatch 1\)"):
        merge_chunks(chunks)
    with pytest.raises(ValueError, match=r"cannot merge output\[1\] over the microbatches \(shapes per microbatch: "
                                         r"\(2, 3\), \(2, 4\)\)"):
        merge_chunks([(torch.ones(2), torch.ones(2, 3)), (torch.ones(2), torch.ones(2, 4))])
