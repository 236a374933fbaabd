"""Microbatch split/merge over pytrees: values, uneven batches, specs, errors, no mutation."""
from __future__ import annotations

import pytest
import torch

from pipeline_ext.runtime.microbatch import (
    REPLICATE,
    TensorChunkSpec,
    given_microbatches,
    given_targets,
    merge_chunks,
    microbatch_sizes,
    microbatch_weights,
    split_args_kwargs,
    split_step_inputs,
    split_step_target,
    target_sizes,
)


def test_uneven_rows_follow_tensor_split():
    x = torch.arange(10.0).reshape(10, 1)
    args_chunks, kwargs_chunks = split_args_kwargs((x,), {}, 4)
    assert [a[0].shape[0] for a in args_chunks] == [3, 3, 2, 2]
    for got, ref in zip(args_chunks, torch.tensor_split(x, 4)):
        assert torch.equal(got[0], ref)
    assert kwargs_chunks == [{}] * 4
    assert microbatch_sizes((x,), {}, 4) == [3, 3, 2, 2]


def test_pytree_args_kwargs_and_non_tensors_replicated():
    torch.manual_seed(0)
    x, y, mask = torch.randn(6, 3), torch.randn(6, 2, 5), torch.ones(4, 4)
    args = ((x, {"y": y}), 7)
    kwargs = {"mask": mask, "flag": "train"}
    args_chunks, kwargs_chunks = split_args_kwargs(args, kwargs, 3, chunk_spec=(None, {"mask": REPLICATE, "flag": None}))
    assert len(args_chunks) == len(kwargs_chunks) == 3
    for k in range(3):
        (xs, d), seven = args_chunks[k]
        assert torch.equal(xs, x[2 * k : 2 * k + 2])
        assert torch.equal(d["y"], y[2 * k : 2 * k + 2])
        assert seven == 7
        assert kwargs_chunks[k]["mask"] is mask
        assert kwargs_chunks[k]["flag"] == "train"


def test_chunk_spec_other_dim():
    x = torch.randn(2, 9)
    args_chunks, _ = split_args_kwargs((x,), None, 3, chunk_spec=((TensorChunkSpec(1),), None))
    for got, ref in zip(args_chunks, torch.tensor_split(x, 3, dim=1)):
        assert torch.equal(got[0], ref)
    merged = merge_chunks([a[0] for a in args_chunks], spec=1)
    assert torch.equal(merged, x)


def test_merge_round_trip_tuple_outputs_and_scalars():
    torch.manual_seed(1)
    a, b = torch.randn(7, 4), torch.randint(0, 9, (7,))
    args_chunks, _ = split_args_kwargs(((a, b),), {}, 3)
    outs = [(c[0][0] * 2, c[0][1], torch.tensor(float(i)), "same") for i, c in enumerate(args_chunks)]
    ma, mb, losses, tag = merge_chunks(outs)
    assert torch.equal(ma, a * 2)
    assert torch.equal(mb, b)
    assert torch.equal(losses, torch.tensor([0.0, 1.0, 2.0]))
    assert tag == "same"
    assert merge_chunks([1, 2, 3]) == [1, 2, 3]


def test_inputs_not_mutated():
    x = torch.randn(5, 3)
    before = x.clone()
    args = [x]
    kwargs = {"k": x}
    split_args_kwargs(args, kwargs, 2)
    assert torch.equal(x, before) and args == [x] and list(kwargs) == ["k"]


def test_weights_give_whole_batch_mean():
    torch.manual_seed(2)
    x = torch.randn(10, 3)
    sizes = microbatch_sizes((x,), {}, 4)
    chunks, _ = split_args_kwargs((x,), {}, 4)
    weighted = sum(w * c[0].mean() for w, c in zip(microbatch_weights(sizes), chunks))
    torch.testing.assert_close(weighted, x.mean())


def test_split_is_differentiable_for_inputs_that_require_grad():
    x = torch.randn(6, 2, requires_grad=True)
    chunks, _ = split_args_kwargs((x,), {}, 3)
    sum((i + 1) * c[0].sum() for i, c in enumerate(chunks)).backward()
    expected = torch.tensor([1.0, 1, 2, 2, 3, 3]).unsqueeze(1).expand(6, 2)
    assert torch.equal(x.grad, expected)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: split_args_kwargs((torch.randn(3, 2),), {}, 4), "n_microbatches must not exceed the batch size"),
        (lambda: split_args_kwargs((torch.randn(3),), {}, 0), "positive int"),
        (lambda: split_args_kwargs((torch.tensor(1.0),), {}, 1), "0-d tensor"),
        (lambda: split_args_kwargs((torch.randn(3),), {}, 1, chunk_spec=((TensorChunkSpec(2),), None)), "out of range"),
        (lambda: split_args_kwargs((torch.randn(3), torch.randn(3)), {}, 1, chunk_spec=((0,), None)), "does not match"),
        (lambda: microbatch_sizes((1, "a"), {}, 2), "no tensor"),
        # each input is split on its own (as torch): one with fewer rows than microbatches leaves one without any
        (lambda: split_step_inputs((torch.randn(8, 2),), {"w": torch.randn(1, 2)}, 2, torch.device("cpu")),
         r"cannot split kwargs\['w'\] with 1 rows into 2 microbatches.*args\[0\], the batch, has 8 rows"),
        (lambda: microbatch_sizes((torch.randn(8), (torch.randn(8), torch.randn(2))), {}, 3), r"args\[1\]\[1\] with 2 rows"),
        (lambda: merge_chunks([]), "at least one"),
        (lambda: merge_chunks([(torch.ones(1),), [torch.ones(1)]]), "structure"),
    ],
)
def test_errors_name_the_problem(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_inputs_whose_rows_differ_are_each_split_on_their_own_as_torch_does_and_named_in_a_warning():
    from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks as torch_split

    x, w, per_mb = torch.randn(8, 2), torch.randn(6, 2), torch.randn(4, 1)
    with pytest.warns(UserWarning, match=r"args\[0\]: 8 rows into 4 of 2 rows; kwargs\['w'\]: 6 rows into 2 of 2 and "
                                          r"2 of 1 rows.*kwargs\['s'\]: 4 rows into 4 of 1 row"):
        args, kwargs, sizes = split_step_inputs((x,), {"w": w, "s": per_mb}, 4, torch.device("cpu"))
    assert sizes == [2, 2, 2, 2]  # the batch's: the first split input's
    theirs_args, theirs_kwargs = torch_split((x,), {"w": w, "s": per_mb}, 4)
    import torch.utils._pytree as pytree

    ours, theirs = pytree.tree_leaves((args, kwargs)), pytree.tree_leaves((theirs_args, theirs_kwargs))
    assert len(ours) == len(theirs) == 12 and all(torch.equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("args,kwargs", [
    ((torch.arange(8.0).reshape(4, 2), 3, "s"), {"b": torch.ones(4), "a": torch.zeros(4, 1), "k": None}),
    (([torch.arange(4.0)],), {"m": {"x": torch.arange(4.0)}}),  # one-leaf containers are not flat
    ((torch.arange(4.0), None), {}),  # None is an empty node, not a leaf
    ((torch.return_types.max((torch.arange(4.0), torch.arange(4))),), {}),  # a namedtuple
])
def test_split_rebuilds_every_structure_as_pytree_does(args, kwargs):
    import torch.utils._pytree as pytree

    got_args, got_kwargs = split_args_kwargs(args, kwargs, 2)
    for k in range(2):
        for got, whole in ((got_args[k], args), (got_kwargs[k], kwargs)):
            leaves, tree = pytree.tree_flatten(whole)
            want = pytree.tree_unflatten([x.tensor_split(2)[k] if isinstance(x, torch.Tensor) else x
                                          for x in leaves], tree)
            assert pytree.tree_structure(got) == tree and type(got) is type(want)
            assert list(got) == list(want) if isinstance(got, dict) else True  # keys in the caller's order
            for g, w in zip(pytree.tree_leaves(got), pytree.tree_leaves(want)):
                assert torch.equal(g, w) if isinstance(w, torch.Tensor) else g == w


@pytest.mark.parametrize("call,match", [
    (lambda: split_step_inputs((torch.randn(0, 3),), {}, 2, torch.device("cpu")), r"^args\[0\] has 0 rows"),
    (lambda: given_microbatches([(torch.randn(2, 3),), (torch.randn(0, 3),)], None, 2, torch.device("cpu")),
     r"^microbatch 1: args\[0\] has 0 rows: every microbatch needs at least one row"),
    (lambda: target_sizes({"labels": torch.randn(3)}, 4),
     r"cannot split target\['labels'\] with 3 rows into 4 microbatches"),
    (lambda: split_step_target(torch.randn(6), 2, torch.device("cpu"), sizes=[4, 4]), "target splits"),
    (lambda: given_targets([torch.randn(2), torch.randn(0)], 2, torch.device("cpu")),
     r"^target_mbs\[1\]: target has 0 rows"),
])
def test_zero_rows_and_targets_are_named(call, match):
    """An empty microbatch says so (not "n_microbatches must not exceed the batch size"); a target is "target"."""
    with pytest.raises(ValueError, match=match):
        call()
