"""pipeline_ext.runtime.ops against torch.tensor_split / torch.cat on seeded random inputs.

Each test runs on CPU and, marked ``cuda``, on a GPU when one is present.
"""
from __future__ import annotations

import pickle
import random

import pytest
import torch

from pipeline_ext import ops

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.bool]
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
    ),
]


def rand(shape, dtype, device="cpu", gen=None):
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=gen).to(dtype)


def random_sizes(rng: random.Random, n: int) -> list:
    """Uneven sizes (zeros allowed) summing to n."""
    k = rng.randint(1, 4)
    cuts = sorted(rng.randint(0, n) for _ in range(k - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [n])]


def variants(t: torch.Tensor):
    """The same values as contiguous, transposed-back and step-sliced tensors."""
    yield "contiguous", t
    if t.dim() >= 2:
        yield "transposed", t.transpose(0, -1).contiguous().transpose(0, -1)
    big = torch.zeros(t.shape[:-1] + (t.shape[-1] * 2,), dtype=t.dtype) if t.dim() else None
    if big is not None:
        big[..., ::2] = t
        yield "step-sliced", big[..., ::2]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and torch.equal(a, b)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


# ---------------------------------------------------------------- split
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_split_matches_tensor_split(device, dtype, gen):
    rng = random.Random(str(dtype))
    for _ in range(12):
        shape = tuple(rng.randint(0 if rng.random() < 0.1 else 1, 6) for _ in range(rng.randint(1, 4)))
        base = rand(shape, dtype, gen=gen).to(device)
        for dim in range(-len(shape), len(shape)):
            sizes = random_sizes(rng, shape[dim])
            for name, x in variants(base):
                x = x.to(device)
                got = ops.split(x, sizes, dim)
                want = torch.tensor_split(x, list(torch.tensor(sizes).cumsum(0)[:-1]), dim)
                assert len(got) == len(want), (name, shape, dim, sizes)
                for g, w in zip(got, want):
                    assert g.is_contiguous(), (name, shape, dim, sizes)
                    assert same(g, w), (name, shape, dim, sizes)


def test_split_returns_views_when_contiguous():
    x = torch.arange(60.0).view(10, 6)
    pieces = ops.split(x, [3, 3, 2, 2], 0)
    for p in pieces:
        assert p.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    y = torch.arange(60.0).view(1, 10, 6)  # dims before `dim` all have size 1
    assert all(p.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() for p in ops.split(y, [4, 6], 1))


def test_split_copies_into_fresh_tensors_otherwise():
    # Fresh, unaliased pieces: a torch custom op may not return outputs that share memory.
    x = torch.arange(60.0).view(6, 10)
    pieces = ops.split(x, [3, 3, 4], 1)
    storages = {p.untyped_storage().data_ptr() for p in pieces}
    assert len(storages) == 3 and x.untyped_storage().data_ptr() not in storages
    assert all(p.is_contiguous() for p in pieces)
    t = torch.arange(60.0).view(10, 6).t()  # non-contiguous input
    pieces = ops.split(t, [1, 5], 0)
    assert len({p.untyped_storage().data_ptr() for p in pieces} | {t.untyped_storage().data_ptr()}) == 3
    assert same(pieces[1], t[1:].contiguous())


def test_split_tiny_rows_and_conjugate_views():
    x = torch.randn(500, 3, dtype=torch.float64)  # 8-byte segments: strided fallback
    assert all(same(a, b) for a, b in zip(ops.split(x, [1, 2], 1), torch.tensor_split(x, [1], 1)))
    z = torch.randn(4, 40, dtype=torch.complex64).conj()
    assert all(same(a.resolve_conj(), b.resolve_conj()) for a, b in zip(ops.split(z, [10, 30], 1),
                                                                           torch.tensor_split(z, [10], 1)))


def test_split_0d_empty_and_accepts_sequences():
    x = torch.zeros(0, 3)
    assert [p.shape for p in ops.split(x, (0, 0), 0)] == [(0, 3), (0, 3)]
    y = torch.arange(10)
    assert [p.tolist() for p in ops.split(y, torch.Size([3, 3, 2, 2]))] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]


def test_even_sizes():
    assert ops.even_sizes(10, 4) == [3, 3, 2, 2]
    assert ops.even_sizes(8, 4) == [2, 2, 2, 2]
    assert ops.even_sizes(2, 3) == [1, 1, 0]
    for n in range(0, 20):
        for c in range(1, 6):
            x = torch.arange(n)
            assert [len(p) for p in torch.tensor_split(x, c)] == ops.even_sizes(n, c)
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        ops.even_sizes(3, 0)


# ---------------------------------------------------------------- concat
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_concat_matches_cat(device, dtype, gen):
    rng = random.Random(repr(dtype) + "cat")
    for _ in range(12):
        ndim = rng.randint(1, 4)
        shape = [rng.randint(1, 6) for _ in range(ndim)]
        for dim in range(-ndim, ndim):
            ts = []
            for _ in range(rng.randint(1, 4)):
                s = list(shape)
                s[dim] = rng.randint(0, 5)
                kind, t = rng.choice(list(variants(rand(tuple(s), dtype, gen=gen))))
                ts.append(t.to(device))
            want = torch.cat(ts, dim)
            assert same(ops.concat(ts, dim), want), (shape, dim)
            out = torch.empty_like(want)
            ptr = out.data_ptr()
            res = ops.concat(tuple(ts), dim, out=out)
            assert res is out or res.data_ptr() == ptr
            assert out.data_ptr() == ptr and same(out, want)


def test_concat_large_rows_and_noncontiguous_out():
    a, b = torch.randn(64, 300), torch.randn(64, 200)
    want = torch.cat([a, b], 1)
    assert same(ops.concat([a, b], 1), want)
    out = torch.empty(500, 64).t()  # non-contiguous out is honoured too
    ops.concat([a, b], 1, out=out)
    assert same(out, want)
    z = torch.randn(8, 16, dtype=torch.complex128)
    assert same(ops.concat([z.conj(), z], 0).resolve_conj(), torch.cat([z.conj(), z], 0).resolve_conj())


def test_split_concat_round_trip_large():
    x = torch.randn(3, 1 << 18)  # big enough for the parallel copy path
    pieces = ops.split(x, [1 << 16, 3 << 16], 1)
    assert same(ops.concat(pieces, 1), x)
    y = torch.randn(4099, 160)  # many rows: threads start and stop mid-row
    pieces = ops.split(y, [100, 37, 23], 1)
    assert all(same(a, b) for a, b in zip(pieces, torch.tensor_split(y, [100, 137], 1)))
    assert same(ops.concat(pieces, 1), y)


# ---------------------------------------------------------------- autograd
def test_split_concat_gradients():
    x = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    pieces = ops.split(x, [2, 0, 3], 1)
    ref = torch.tensor_split(x2, [2, 2], 1)
    w = [torch.randn(p.shape, dtype=torch.float64) for p in pieces]
    sum((p * wi).sum() for p, wi in zip(pieces[:1], w[:1])).backward()  # unused pieces get zero grad
    sum((p * wi).sum() for p, wi in zip(ref[:1], w[:1])).backward()
    assert torch.equal(x.grad, x2.grad)

    a = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: ops.concat([a, b], -1), (a, b))
    assert torch.autograd.gradcheck(lambda a: tuple(ops.split(a, [1, 2], 0)), (a,))
    with pytest.raises(RuntimeError, match="out= is not differentiable"):
        ops.concat([a, b], 1, out=torch.empty(3, 6, dtype=torch.float64))


# ---------------------------------------------------------------- pack / unpack
@pytest.mark.parametrize("device", DEVICES)
def test_pack_unpack_round_trip(device, gen):
    rng = random.Random(1)
    all_dtypes = DTYPES + [torch.complex64, torch.int8, torch.uint8]
    for _ in range(20):
        tensors = []
        for _ in range(rng.randint(1, 8)):
            shape = tuple(rng.randint(0 if rng.random() < 0.15 else 1, 5) for _ in range(rng.randint(0, 3)))
            dt = rng.choice(all_dtypes)
            t = rand(shape, dt, gen=gen) if not dt.is_complex else torch.randn(shape, dtype=dt, generator=gen)
            tensors.append(rng.choice(list(variants(t)))[1].to(device))
        buffer, layout = ops.pack(tensors)
        assert buffer.dtype == torch.uint8 and buffer.dim() == 1 and buffer.device.type == device
        assert all(o % ops.PACK_ALIGNMENT == 0 for o in layout.offsets)
        assert layout.dtypes == [t.dtype for t in tensors]
        assert layout.shapes == [tuple(t.shape) for t in tensors]
        out = ops.unpack(buffer, layout)
        assert len(out) == len(tensors)
        for o, t in zip(out, tensors):
            assert same(o, t)
            if o.numel():
                assert o.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_unpack_returns_views_into_buffer():
    a, b = torch.arange(6.0).view(2, 3), torch.tensor(7, dtype=torch.int64)
    buffer, layout = ops.pack([a, b])
    ua, ub = ops.unpack(buffer, layout)
    ua[0, 0] = 100.0
    ub.fill_(-1)
    again = ops.unpack(buffer, layout)
    assert again[0][0, 0].item() == 100.0 and again[1].item() == -1
    assert a[0, 0].item() == 0.0  # pack copied


def test_pack_16_small_and_empty_list():
    ts = [torch.randn(3, 5) for _ in range(16)]
    buffer, layout = ops.pack(ts)
    assert len(layout) == 16 and layout.nbytes <= buffer.numel()
    assert all(same(a, b) for a, b in zip(ops.unpack(buffer, layout), ts))
    buffer, layout = ops.pack([])
    assert buffer.numel() == 0 and ops.unpack(buffer, layout) == []


def test_pack_into_out_buffer():
    ts = [torch.randn(5, 3), torch.arange(7)]
    out = torch.empty(1024, dtype=torch.uint8)
    buffer, layout = ops.pack(ts, out=out)
    assert buffer.data_ptr() == out.data_ptr() and layout.nbytes < 1024
    assert all(same(a, b) for a, b in zip(ops.unpack(out, layout), ts))
    with pytest.raises(ValueError, match=r"pack: buffer has 8 bytes but the layout needs"):
        ops.pack(ts, out=torch.empty(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="pack: buffer must be a contiguous 1-D uint8"):
        ops.pack(ts, out=torch.empty(1024))
    with pytest.raises(ValueError, match="not a multiple of 64"):
        ops.pack(ts, out=out[1:])


def test_layout_encode_decode_pickle():
    _, layout = ops.pack([torch.zeros(2, 3), torch.ones((), dtype=torch.bool), torch.zeros(0, 4, dtype=torch.int32)])
    assert ops.PackLayout.decode(layout.encode()) == layout
    t = layout.to_tensor()
    assert t.dtype == torch.int64 and t.dim() == 1
    assert ops.PackLayout.from_tensor(t) == layout
    assert pickle.loads(pickle.dumps(layout)) == layout
    assert layout != ops.pack([torch.zeros(3, 2)])[1] and layout != "x"
    assert "PackLayout(nbytes=" in repr(layout) and "[2, 3]" in repr(layout)


# ---------------------------------------------------------------- errors
def test_split_errors():
    x = torch.zeros(4, 6)
    with pytest.raises(ValueError, match=r"sizes \[1, 2\] sum to 3 but dimension 0 .*shape \[4, 6\] has size 4"):
        ops.split(x, [1, 2])
    with pytest.raises(ValueError, match=r"sizes\[0\] = -1 is negative"):
        ops.split(x, [-1, 5])
    with pytest.raises(IndexError, match=r"dim 2 is out of range for a tensor with 2 dimensions \(expected -2 to 1\)"):
        ops.split(x, [4], 2)
    with pytest.raises(IndexError, match="dim -3 is out of range"):
        ops.split(x, [4], -3)
    with pytest.raises(ValueError, match="cannot split a 0-d tensor"):
        ops.split(torch.tensor(1.0), [1])
    with pytest.raises(ValueError, match="sizes is empty"):
        ops.split(x, [])
    with pytest.raises(TypeError, match="even_sizes"):
        ops.split(x, 2)
    with pytest.raises(TypeError, match="only ints"):
        ops.split(x, [1.5, 2.5])


def test_concat_errors():
    a = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="non-empty list"):
        ops.concat([])
    with pytest.raises(TypeError, match="tensor 1 has dtype Double but tensor 0 has dtype Float"):
        ops.concat([a, a.double()])
    with pytest.raises(ValueError, match=r"tensor 2 has shape \[2, 4\] but tensor 0 has shape \[2, 3\]; .*dimension 0"):
        ops.concat([a, a, torch.zeros(2, 4)], 0)
    with pytest.raises(ValueError, match=r"tensor 1 has shape \[2, 3, 1\]"):
        ops.concat([a, torch.zeros(2, 3, 1)], 1)
    with pytest.raises(ValueError, match="tensor 0 is 0-d"):
        ops.concat([torch.tensor(1.0), torch.tensor(2.0)])
    with pytest.raises(IndexError, match="dim 2 is out of range"):
        ops.concat([a, a], 2)
    with pytest.raises(ValueError, match=r"out has shape \[4, 4\] but the result has shape \[4, 3\]"):
        ops.concat([a, a], 0, out=torch.empty(4, 4))
    with pytest.raises(TypeError, match="out has dtype Long but the tensors have dtype Float"):
        ops.concat([a, a], 0, out=torch.empty(4, 3, dtype=torch.long))
    with pytest.raises(RuntimeError, match="unsupported operation"):
        big = torch.zeros(4, 3)
        ops.concat([big[:2], big[2:]], 0, out=big)
    with pytest.raises(TypeError, match="list or tuple of tensors"):
        ops.concat(a)
    with pytest.raises(TypeError, match="element 1 is a int"):
        ops.concat([a, 3])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_mismatch_errors():
    a, b = torch.zeros(2, 3), torch.zeros(2, 3, device="cuda")
    with pytest.raises(ValueError, match=r"tensor 1 is on device cuda:0 but tensor 0 is on device cpu"):
        ops.concat([a, b])
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        ops.pack([a, b])
    with pytest.raises(ValueError, match="out is on device cpu"):
        ops.concat([b, b], out=torch.empty(4, 3))


def test_unpack_errors():
    buffer, layout = ops.pack([torch.zeros(10), torch.zeros(3, dtype=torch.float64)])
    with pytest.raises(ValueError, match=rf"buffer has 64 bytes but the layout needs {layout.nbytes}"):
        ops.unpack(buffer[:64], layout)
    with pytest.raises(ValueError, match="contiguous 1-D uint8"):
        ops.unpack(buffer[:80].view(torch.float32), layout)
    words = layout.encode()
    words[4 + 3 + 1 + 1] = 4  # second entry (float64) at byte offset 4
    with pytest.raises(ValueError, match="byte offset 4, which is not a non-negative multiple of its element size 8"):
        ops.PackLayout.decode(words)
    words = layout.encode()
    words[3] = 8  # nbytes too small for the entries
    with pytest.raises(ValueError, match="ends past the layout's 8 bytes"):
        ops.PackLayout.decode(words)
    with pytest.raises(ValueError, match="not an encoded PackLayout"):
        ops.PackLayout.decode([1, 2, 3])
    with pytest.raises(ValueError, match="invalid dtype code"):
        bad = layout.encode()
        bad[4] = 999
        ops.PackLayout.decode(bad)
    with pytest.raises(ValueError, match="expected a 1-D int64 tensor"):
        ops.PackLayout.from_tensor(torch.zeros(3))
    with pytest.raises(TypeError, match="layout must be a PackLayout"):
        ops.unpack(buffer, layout.encode())
