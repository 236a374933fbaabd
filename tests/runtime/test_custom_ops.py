"""The kernels as torch custom ops: opcheck on every op, and torch.compile through them.

``torch.library.opcheck`` checks each op's schema (aliasing, mutation) against
its kernel, its autograd registration, its fake kernel against the real one,
and AOT dispatch with static and dynamic shapes. Then the functions users call
(``ops.split`` / ``ops.concat``, ``microbatch.split_args_kwargs`` /
``merge_chunks``) are traced by torch.compile without a graph break, with the
same values and gradients as in eager mode.
"""
from __future__ import annotations

import pytest
import torch
import torch._dynamo

from pipeline_ext import ops
from pipeline_ext.runtime.microbatch import TensorChunkSpec, merge_chunks, split_args_kwargs

NAMESPACE = "pipeline_ext"


def _randn(*shape: int, dtype: torch.dtype = torch.float32, grad: bool = False, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + sum(shape))
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=g).to(dtype)
    else:
        t = torch.randint(-100, 100, shape, generator=g).to(dtype)
    return t.requires_grad_(grad)


def _strided(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A non-contiguous tensor: every other column of a wider one."""
    return _randn(*shape[:-1], 2 * shape[-1], dtype=dtype)[..., ::2]


def _split_samples():
    """(args) for split_copy: uneven and empty pieces, several dims and dtypes, strided input."""
    yield _randn(10, 3), [3, 3, 2, 2], 0
    yield _randn(6, 7, dtype=torch.float64, grad=True), [2, 0, 5], 1
    yield _randn(4, 5, 6, dtype=torch.bfloat16), [1, 4], -2
    yield _randn(5, 8, dtype=torch.int64), [8], 1
    yield _strided(6, 5), [4, 1], 1
    yield _randn(9, 40, grad=True), [10, 30], 1  # rows long enough for the one-pass copy plan


def _concat_samples():
    yield [_randn(3, 4), _randn(1, 4), _randn(0, 4)], 0
    yield [_randn(2, 3, dtype=torch.float64, grad=True), _randn(2, 5, dtype=torch.float64, grad=True)], -1
    yield [_randn(2, 3, 4, dtype=torch.int32), _strided(2, 3, 4, dtype=torch.int32)], 2
    yield [_randn(64, 40, grad=True), _randn(64, 24, grad=True)], 1


def _pack_samples():
    yield [_randn(3, 5), torch.tensor(7, dtype=torch.int64), torch.zeros(0, 2), _strided(4, 3)]
    yield [_randn(2, 2, dtype=torch.bfloat16), torch.ones(5, dtype=torch.bool), _randn(1, dtype=torch.float64)]


def _opcheck_cases():
    """(op name, args) for every op; test_every_op_is_checked keeps this list complete."""
    for tensor, sizes, dim in _split_samples():
        yield "split_copy", (tensor, sizes, dim)
    for tensors, dim in _concat_samples():
        yield "concat", (tensors, dim)
        yield "concat_out", ([t.detach() for t in tensors], dim, torch.empty_like(torch.cat(tensors, dim)).detach())
    for tensors in _pack_samples():
        yield "pack", (tensors,)
        yield "pack_out", (tensors, torch.empty(1024, dtype=torch.uint8))
        buffer, layout = ops.pack(tensors)
        yield "unpack", (buffer, layout.encode())


CASES = list(_opcheck_cases())


def test_every_op_is_checked():
    registered = {name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith(NAMESPACE + "::")}
    assert registered == {"split_copy", "concat", "concat_out", "pack", "pack_out", "unpack"}
    assert {name for name, _ in CASES} == registered


@pytest.mark.parametrize("name,args", CASES, ids=[f"{name}-{i}" for i, (name, _) in enumerate(CASES)])
def test_opcheck(name, args):
    torch.library.opcheck(getattr(torch.ops.pipeline_ext, name).default, args)


def test_split_copy_never_aliases_its_input():
    x = torch.arange(12.0).view(6, 2)  # contiguous: ops.split would give views, the op copies
    pieces = torch.ops.pipeline_ext.split_copy(x, [4, 2], 0)
    assert all(p.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() for p in pieces)
    assert all(torch.equal(p, r) for p, r in zip(pieces, torch.split(x, [4, 2])))


def test_eager_and_traced_paths_agree_on_views():
    """Eager ops.split decides views in C++; traced calls use the Python mirror, ops._views_suffice."""
    base = torch.arange(120.0)
    cases = [((10, 12), [3, 3, 2, 2], 0), ((1, 10, 12), [4, 6], 1), ((10, 12), [5, 7], 1), ((10, 12), [0, 12], 1),
             ((0, 4), [0, 0], 0), ((10, 12), [3, 7], -2), ((4, 5, 6), [6], 2)]
    for shape, sizes, dim in cases:
        for x in (base[: torch.Size(shape).numel()].view(shape), base[: torch.Size(shape).numel()].view(shape).mT):
            if x.shape[dim] != sum(sizes):
                continue
            pieces = ops.split(x, sizes, dim)
            shared = all(p._base is x or p.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
                         for p in pieces if p.numel())
            assert ops._views_suffice(x, sizes, dim) == (shared and x.is_contiguous()), (shape, sizes, dim)


def test_fake_tensors_take_the_traced_path():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = torch.empty(6, 5)
        pieces = ops.split(x, [2, 3], 1)
        merged = ops.concat([pieces[1], pieces[0]], 1)
        buffer = torch.ops.pipeline_ext.pack([x, merged])
    assert [tuple(p.shape) for p in pieces] == [(6, 2), (6, 3)] and merged.shape == (6, 5)
    assert buffer.shape == (ops.pack([torch.empty(6, 5), torch.empty(6, 5)])[1].nbytes,)


# ---------------------------------------------------------------- torch.compile


def _microbatch_round_trip(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor):
    """What a pipeline step does to its inputs and outputs, with a little compute in between."""
    args_chunks, kwargs_chunks = split_args_kwargs(
        (x,), {"y": y, "mask": mask}, 4, chunk_spec=((TensorChunkSpec(0),), {"y": 1, "mask": None})
    )
    outs = [(a[0] * 2, k["y"] + 1, k["mask"].sum()) for a, k in zip(args_chunks, kwargs_chunks)]
    return merge_chunks(outs, (0, 1, None))


def _microbatch_inputs():
    # 10 rows into 4 microbatches (3, 3, 2, 2); y splits along dim 1 (the copying op).
    return _randn(10, 6), _randn(3, 10, 5, seed=1), _randn(10, 2, seed=2)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_split_args_kwargs_and_merge_trace_without_graph_breaks(dynamic):
    torch._dynamo.reset()
    inputs = _microbatch_inputs()
    explained = torch._dynamo.explain(_microbatch_round_trip)(*inputs)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    compiled = torch.compile(_microbatch_round_trip, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for got, want in zip(compiled(*inputs), _microbatch_round_trip(*inputs)):
        assert got.shape == want.shape and torch.equal(got, want)
    # The custom ops are in the traced graph (not an opaque call).
    targets = {str(node.target) for g in explained.graphs for node in g.graph.nodes}
    assert any("pipeline_ext.split_copy" in t for t in targets), targets
    assert any("pipeline_ext.concat" in t for t in targets), targets


def _split_concat_loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Both split cases (views along dim 0, the copy op along dim 1) and concat, weighted per piece."""
    rows = ops.split(x, [3, 1, 2], 0)
    cols = ops.split(x, [2, 5], 1)
    merged = ops.concat([cols[1] * w[:, :5], cols[0] * 3], 1)
    return (ops.concat([r.sin() for r in rows], 0) * merged).sum() + (merged ** 2).mean()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_gradients_through_ops_under_compile_equal_eager(backend):
    torch._dynamo.reset()
    x = _randn(6, 7, dtype=torch.float64, grad=True)
    w = _randn(6, 7, dtype=torch.float64, grad=True, seed=3)
    want = _split_concat_loss(x, w)
    want_grads = torch.autograd.grad(want, (x, w))
    compiled = torch.compile(_split_concat_loss, backend=backend, fullgraph=True)
    got = compiled(x, w)
    got_grads = torch.autograd.grad(got, (x, w))
    torch.testing.assert_close(got, want)
    for g, r in zip(got_grads, want_grads):
        torch.testing.assert_close(g, r)


def test_microbatch_gradients_under_compile_equal_eager():
    """split_args_kwargs -> per-microbatch compute -> merge_chunks, differentiated through the ops."""
    torch._dynamo.reset()
    x = _randn(10, 6, dtype=torch.float64, grad=True)
    y = _randn(3, 10, 5, dtype=torch.float64, grad=True, seed=1)
    mask = _randn(10, 2, dtype=torch.float64, seed=2)

    def loss(x, y, mask):
        a, b, _ = _microbatch_round_trip(x, y, mask)
        return (a.tanh() * a).sum() + (b * b).sum()

    want_grads = torch.autograd.grad(loss(x, y, mask), (x, y))
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    got_grads = torch.autograd.grad(compiled(x, y, mask), (x, y))
    for g, r in zip(got_grads, want_grads):
        torch.testing.assert_close(g, r)


def test_pack_unpack_trace_as_views():
    """unpack decomposes into narrow/view under tracing, so a compiled unpack reads the buffer."""
    torch._dynamo.reset()
    tensors = [_randn(3, 5), torch.arange(4), torch.zeros(0, 2)]
    buffer, layout = ops.pack(tensors)
    words = layout.encode()

    def read(buffer):
        a, b, c = torch.ops.pipeline_ext.unpack(buffer, words)
        return a * 2, b + 1, c

    got = torch.compile(read, backend="aot_eager", fullgraph=True)(buffer)
    want = (tensors[0] * 2, tensors[1] + 1, tensors[2])
    assert all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want))
    assert all(torch.equal(g, w) for g, w in zip(read(buffer), want))
