"""Child process of tests/runtime/test_tensor_kinds.py: every tensor kind the core cannot read, at every entry point.

Run as ``python tensor_kinds_child.py KIND [ENTRY ...]``. For each entry it
prints ``ENTRY <name>`` before trying it (so a crash names the entry it died
in) and then one JSON line ``RESULT {...}``: ``{"entry", "outcome": "ok" |
"raised", "type", "message"}``. The parent asserts that the process ended
by itself (no signal) and what each entry did.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
from torch import nn

ENTRIES = ["split", "concat", "concat_mixed", "pack", "pack_out", "split_args", "merge", "local_send",
           "pipe_step_output", "pipe_forward_output", "pipe_input"]

ROWS = 4


def make(kind: str, rows: int = ROWS) -> torch.Tensor:
    t = torch.randn(rows, 16)
    if kind == "dtensor":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate

        if not dist.is_initialized():
            store = os.path.join(tempfile.mkdtemp(), "store")
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        return DTensor.from_local(t, init_device_mesh("cpu", (1,)), [Replicate()])
    if kind == "wrapper":  # a __torch_dispatch__ wrapper subclass (torch's own test subclass)
        from torch.testing._internal.two_tensor import TwoTensor

        return TwoTensor(t, t.clone())
    if kind == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode

        return FakeTensorMode().from_tensor(t)
    if kind == "jagged":
        return torch.nested.nested_tensor([torch.randn(2, 16) for _ in range(rows // 2)], layout=torch.jagged)
    if kind == "nested":
        return torch.nested.nested_tensor([torch.randn(2, 16) for _ in range(rows // 2)])
    if kind == "sparse_coo":
        return t.to_sparse()
    if kind == "sparse_csr":
        return t.to_sparse_csr()
    if kind == "quantized":
        return torch.quantize_per_tensor(t, 0.1, 0, torch.qint8)
    if kind == "meta":
        return torch.empty(rows, 16, device="meta")
    if kind == "mkldnn":
        return t.to_mkldnn()
    if kind == "expanded":  # overlapping memory: every row is the same 16 floats
        return torch.randn(1, 16).expand(rows, 16)
    if kind == "transposed":
        return torch.randn(16, rows).t()
    if kind == "conj":  # a conjugate view: its bytes are not its values
        return torch.randn(rows, 16, dtype=torch.cfloat).conj()
    raise ValueError(kind)


def exact(kind: str) -> None:
    """A plain tensor in an odd layout (views the core copies element by element): every entry point is exact."""
    from pipeline_ext.runtime import microbatch, ops
    from pipeline_ext.runtime.local import LocalHub

    t = make(kind)
    assert all(torch.equal(a, b) for a, b in zip(ops.split(t, [1, 3]), torch.split(t, [1, 3])))
    assert all(torch.equal(a, b) for a, b in zip(ops.split(t, [8, 8], dim=1), torch.split(t, [8, 8], dim=1)))
    assert torch.equal(ops.concat([t, t], dim=1), torch.cat([t, t], dim=1))
    buf, layout = ops.pack([t, t[1:]])
    a, b = ops.unpack(buf, layout)
    assert torch.equal(a, t) and torch.equal(b, t[1:])
    assert torch.equal(microbatch.merge_chunks([t, t]), torch.cat([t, t]))
    hub = LocalHub(["cpu", "cpu"])
    hub.channel(0).send([t], 1, 0)
    (got,) = hub.channel(1).recv(0, 0).wait(5.0, "receive")
    assert torch.equal(got, t)


class MakeKind(nn.Module):
    """A stage whose output is of ``kind`` (one row per input row)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        self.lin(x)
        return make(self.kind, x.shape[0])


def run(kind: str, entry: str):
    import pipeline_ext as pe
    from pipeline_ext.runtime import microbatch, ops
    from pipeline_ext.runtime.local import LocalHub

    if entry == "exact":
        return exact(kind)
    t = make(kind)
    if entry == "split":
        return ops.split(t, [2, 2])
    if entry == "concat":
        return ops.concat([t, t])
    if entry == "concat_mixed":
        return ops.concat([torch.randn(ROWS, 16), t])
    if entry == "pack":
        return ops.pack([t])
    if entry == "pack_out":
        return ops.pack([torch.randn(4), t], out=torch.empty(4096, dtype=torch.uint8))
    if entry == "split_args":
        return microbatch.split_args_kwargs((t,), {}, 2)
    if entry == "merge":
        return microbatch.merge_chunks([t, t])
    if entry == "local_send":
        hub = LocalHub(["cpu", "cpu"], num_stages=2)
        hub.channel(0).send([torch.randn(2), t], 1, 0)
        return hub.channel(1).recv(0, 0).wait(5.0, "receive")
    if entry in ("pipe_step_output", "pipe_forward_output"):
        pipe = pe.Pipe(nn.Sequential(MakeKind(kind), nn.Linear(16, 4)), balance=[1, 1], devices=["cpu"] * 2,
                       chunks=2, timeout=60)
        x = torch.randn(ROWS, 16)
        if entry == "pipe_forward_output":
            return pipe(x)
        return pipe.step(x, target=torch.randn(ROWS, 4), loss_fn=nn.functional.mse_loss)
    if entry == "pipe_input":
        pipe = pe.Pipe(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)), balance=[1, 1], devices=["cpu"] * 2,
                       chunks=2, timeout=60)
        return pipe.step(t, target=torch.randn(ROWS, 4), loss_fn=nn.functional.mse_loss)
    raise ValueError(entry)


def main() -> None:
    kind, entries = sys.argv[1], sys.argv[2:] or ENTRIES
    for entry in entries:
        print("ENTRY", entry, flush=True)
        try:
            run(kind, entry)
            result = {"entry": entry, "outcome": "ok", "type": "", "message": ""}
        except Exception as exc:  # noqa: BLE001 - the parent checks what was raised
            result = {"entry": entry, "outcome": "raised", "type": type(exc).__name__, "message": str(exc)}
        print("RESULT", json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
