"""Pipeline x tensor parallel: what is paired with what, in rows and in ranks, against the unsplit model.

The set-up of tests/parallel/tp_case.py (4 Gloo CPU ranks, mesh (pp=2,
tp=2), two MLP blocks per stage made tensor-parallel with
``parallelize_module``), in the user's loop.

1. Rows: within one step, microbatch k of every input, keyword argument and
   target holds the same global rows, and the outputs merge back in the
   global order, whatever kind each tensor is: a ``Shard(0)`` DTensor input
   or keyword argument beside a plain target, a ``Shard(0)`` DTensor output
   beside a ``Replicate`` target, a batch whose rows do not divide over the
   tp ranks or the microbatches ([Note: splitting a DTensor into
   microbatches] in pipeline_ext/runtime/dtensor_wire.py). 1F1B, ZB-H1, ZBV
   and ``eval()``: the loss, every full gradient and the merged output (row by
   row) equal the unsplit model's.
2. Ranks: a pipeline whose stages sit at different places of the tp mesh (the
   user's own pp groups (0, 3) and (1, 2) on a (pp=2, tp=2) mesh: tp rank 0 of
   stage 0 feeds tp rank 1 of stage 1) would rebuild a ``Shard(1)`` activation
   as the other shard; it is refused by name on every rank ([Note: DTensors
   between stages]).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mp_utils import no_complaints, rank_values
from models import TOL
from tp_case import (D, M, SEQ, Stage, first_step_error, full, grad_mismatches, loss_mismatch, parallelize, placement,
                     pp_tp_mesh, rank_copies, schedule, sgd_pair, stages_on_rank, unsplit_loss)


class ShiftStage(Stage):
    """A stage whose input may come with a keyword argument added to it (a ``Shard(0)`` DTensor: its rows, gathered
    here, so the sum pairs row i of the input with row i of the argument only when both are the same global rows).

    ``gather``: a DTensor input is gathered first (``full_tensor()``), for microbatches whose rows do not divide over
    the tp ranks: torch 2.13's ``Linear`` refuses an unevenly ``Shard(0)`` 3-D input ("Cannot flatten unevenly
    sharded tensor"), the unsplit model's too; else the blocks take the ``Shard(0)`` DTensor as torch propagates it.
    ``adds_shift``: the first stage's; a later stage of the same rank (ZBV's last) is given ``shift`` too, as torch
    gives a rank's keyword arguments to each of its stages, and leaves it unused.
    """

    def __init__(self, gather: bool = False, adds_shift: bool = True) -> None:
        super().__init__()
        self.gather, self.adds_shift = gather, adds_shift

    def forward(self, x, shift=None):
        if self.gather and hasattr(x, "full_tensor"):
            x = x.full_tensor()
        if shift is not None and self.adds_shift:
            x = x + (shift.full_tensor() if hasattr(shift, "full_tensor") else shift)
        return self.blocks(x)


#: per form: (input, keyword argument, target, last stage's output) placements; "" is a plain tensor
FORMS = {
    "input": ("shard0", None, "", ""),  # a Shard(0) DTensor input beside a plain target and output
    "kwarg": ("", "shard0", "", ""),  # a plain input, a Shard(0) DTensor keyword argument, a plain target
    "output": ("shard0", None, "replicate", "shard0"),  # a Shard(0) output merged beside a Replicate target
}


def _build(mesh, name: str, last_out: str, gather: bool):
    """(stages on this rank, {stage: TP module}, the unsplit model, schedule, optimizer, the unsplit model's)."""
    tp, pp = mesh["tp"], mesh["pp"]
    ns, mine = stages_on_rank(name, pp)
    torch.manual_seed(0)
    ref = [ShiftStage() for _ in range(ns)]
    modules = rank_copies(ref, mine, lambda s: ShiftStage(gather, adds_shift=s == 0))
    for s in mine:
        modules[s] = parallelize(modules[s], s, ns, "replicate", tp, last_out)
    _, sched = schedule(name, modules, mine, ns, pp)
    return (mine, modules, ref, sched, *sgd_pair(mine, modules, ref))


def _rows_in_order(rank: int, world: int, cases: list[tuple[str, str, int]]) -> list[str]:
    """Per case (schedule, form, rows): an eval, then a training step, then an eval after it; every output row,
    loss and gradient against the unsplit model's on the same global rows."""
    from torch.distributed.tensor import distribute_tensor

    from pipeline_ext.runtime.ops import even_sizes

    mesh = pp_tp_mesh()
    bad: list[str] = []

    def put(t: torch.Tensor, given) -> torch.Tensor:
        return distribute_tensor(t, mesh["tp"], [placement(given)]) if given else t

    for name, form, rows in cases:
        x_as, shift_as, y_as, out_as = FORMS[form]
        mine, modules, ref, sched, opt, ref_opt = _build(mesh, name, out_as, rows % (2 * M) != 0)
        first, last = sched.has_first_stage, sched.has_last_stage
        share = torch.tensor(even_sizes(rows, M), dtype=torch.float32) / rows  # each microbatch's loss weight
        for step, kind in enumerate(("eval", "step", "eval")):
            where = f"{form} {name} rows={rows} rank {rank} {kind} {step}"
            g = torch.Generator().manual_seed(step)
            x, y, shift = (torch.randn(rows, SEQ, D, generator=g) for _ in range(3))
            args = (put(x, x_as),) if first else ()
            kwargs = {"shift": put(shift, shift_as)} if first and shift_as is not None else {}
            losses: list = []
            run = sched.eval if kind == "eval" else sched.step
            out = run(*args, target=put(y, y_as) if last else None, losses=losses, **kwargs)
            want, ref_loss = unsplit_loss(ref, x + shift if shift_as is not None else x, y, backward=kind == "step")
            if last:
                got = full(out)
                if tuple(got.shape) != tuple(want.shape):
                    bad.append(f"{where}: merged output of shape {tuple(got.shape)}, the unsplit model's "
                               f"{tuple(want.shape)}")
                else:
                    wrong = [i for i in range(rows) if not torch.allclose(got[i], want[i].detach(), **TOL)]
                    if wrong:  # which global rows: a permutation shows as rows equal to other rows of the reference
                        moved = {i: j for i in wrong for j in range(rows)
                                 if torch.allclose(got[i], want[j].detach(), **TOL)}
                        bad.append(f"{where}: merged output rows {wrong} differ from the unsplit model's (equal to "
                                   f"its rows {moved})")
                bad += loss_mismatch(where, (torch.stack([full(v) for v in losses]) * share).sum(), ref_loss)
            if kind == "step":
                bad += grad_mismatches(where, mine, modules, ref)
                opt.step(), ref_opt.step()
                opt.zero_grad(), ref_opt.zero_grad()
            elif any(p.grad is not None for s in mine for p in modules[s].parameters()):
                bad.append(f"{where}: eval produced gradients")
        dist.barrier()
    return bad


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["1f1b", "zb_h1", "zbv"])
def test_a_shard0_dtensor_input_kwarg_or_output_pairs_the_same_rows_as_plain_tensors(name):
    no_complaints(_rows_in_order, 4, [(name, form, 8) for form in FORMS], timeout=280)


@pytest.mark.timeout(300)
def test_shard0_dtensors_whose_rows_do_not_divide_over_tp_or_the_microbatches_pair_the_same_rows():
    """10 rows: tp shards of 5 each, microbatches of 3, 3, 2, 2 (each a DTensor sharded 2/1 or 1/1); 9 rows: tp
    shards of 5 and 4."""
    no_complaints(_rows_in_order, 4, [("1f1b", "input", 10), ("1f1b", "output", 10), ("1f1b", "kwarg", 9)],
                  timeout=280)


# -- 2. ranks: the stages of one pipeline at different places of the tp mesh --------------------------------
def _crossed(rank: int, world: int) -> str:
    """The user's own pp groups (0, 3) and (1, 2) on the (pp=2, tp=2) mesh [[0, 1], [2, 3]]: stage 0's tp rank 0
    feeds stage 1's tp rank 1 and the other way round; sequence-parallel Shard(1) activations between them."""
    import pipeline_ext as pe

    mesh = pp_tp_mesh()
    groups = {r: g for ranks in ((0, 3), (1, 2)) for g in [dist.new_group(list(ranks))] for r in ranks}
    index = mesh["pp"].get_local_rank()
    torch.manual_seed(0)
    module = parallelize(Stage(), index, 2, "sequence", mesh["tp"])
    return first_step_error(pe.PipelineStage(module, index, 2, "cpu", group=groups[rank]))


@pytest.mark.timeout(300)
def test_a_pipeline_pairing_different_tp_coordinates_is_refused_by_name_on_every_rank():
    said = rank_values(_crossed, 4, timeout=240)
    for sender, receiver in ((0, 3), (1, 2)):
        want = (f"stage 1's input 0, microbatch 0 is a DTensor from stage 0 on rank {sender} at (tp={sender % 2}) of "
                f"mesh ('tp',) of shape (2,), but stage 1 on rank {receiver} sits at (tp={receiver % 2})")
        for r in (sender, receiver):
            assert want in said[r], f"rank {r}: {said[r]}"
