"""Sequence pieces (``seq_chunks=K``, Seq1F1B) in the user's loop: exact against the unsplit model.

2 Gloo CPU ranks; a small causal transformer whose attention calls
``chunked_causal_attention`` with the carry the pipeline makes current
(``current_carry()``; outside a pipeline it is None and the same model runs
whole). Each microbatch is one sequence cut into K pieces; loss, every
gradient and the parameters after an SGD step are compared with the unsplit
model on the whole sequences, under 1F1B, ZB-H1 (the I/W split held) and
interleaved 1F1B, with selective checkpointing inside the blocks, with
microbatches of different lengths (``step_microbatches``) and with pieces cut
to equal cost (``seq_split`` a float); the traced steps give the simulator
one cost weight per piece.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models import TOL, PieceBlock, sac_context
from mp_utils import rank_values


DIM, HQ, HKV, HEAD = 16, 4, 2, 4
ROWS, SEQ, M = 4, 12, 2


class Stage(nn.Module):
    def __init__(self, first_layer: int, sac: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([PieceBlock(first_layer, DIM, HQ, HKV, HEAD), PieceBlock(first_layer + 1, DIM, HQ, HKV, HEAD)])
        self.sac = sac

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.sac:
                from torch.utils.checkpoint import checkpoint

                x = checkpoint(block, x, use_reentrant=False, context_fn=sac_context)
            else:
                x = block(x)
        return x


def _stages(n: int, sac: bool = False) -> list[nn.Module]:
    torch.manual_seed(0)
    return [Stage(2 * i, sac) for i in range(n)]


def _unsplit(stages: list[nn.Module], xs: list[torch.Tensor], ys: list[torch.Tensor]) -> torch.Tensor:
    """The step's objective without pieces: each microbatch's mean loss, weighted by its share of the rows
    (equal rows here), each sequence run whole; pieces must not change it, also for unequal lengths."""
    loss = 0
    for x, y in zip(xs, ys):
        for s in stages:
            x = s(x)
        loss = loss + F.mse_loss(x, y) / len(ys)
    return loss


def _pieces_of(y: torch.Tensor, k: int, split: object) -> list[torch.Tensor]:
    from pipeline_ext.schedules.pieces import piece_lengths

    return list(torch.split(y, piece_lengths(y.shape[1], k, split), dim=1))


def _train(rank: int, world: int, cases: list[tuple[str, int, int, bool, str, object]]) -> list[str]:
    import pipeline_ext as pe
    import torch.distributed as dist

    bad: list[str] = []
    for name, v, k, sac, shapes, split in cases:
        ns = world * v
        stages, ref = _stages(ns, sac), _stages(ns)
        mine = [s for s in range(ns) if (s % world if name != "zbv" else min(s, 2 * world - 1 - s)) == rank]
        pstages = [pe.PipelineStage(stages[s], s, ns, "cpu") for s in mine]
        cls = pe.get_schedule_class(name)
        sched = cls(pstages if v > 1 else pstages[0], M, loss_fn=F.mse_loss, seq_chunks=k, seq_split=split,
                    trace=True)
        opt = torch.optim.SGD([p for s in mine for p in stages[s].parameters()], lr=0.1)
        ref_opt = torch.optim.SGD([p for m in ref for p in m.parameters()], lr=0.1)
        where = f"{name} v={v} seq_chunks={k} seq_split={split} sac={sac} {shapes} rank {rank}"
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            lengths = [SEQ] * M if shapes == "fixed" else [SEQ, SEQ - 4]
            xs = [torch.randn(ROWS // M, n, DIM, generator=g) for n in lengths]
            ys = [torch.randn(ROWS // M, n, DIM, generator=g) for n in lengths]
            opt.zero_grad()
            losses: list = []
            first, last = 0 in mine, ns - 1 in mine
            if shapes == "fixed":
                out = sched.step(*((torch.cat(xs),) if first else ()), target=torch.cat(ys) if last else None,
                                 losses=losses)
            else:
                out = sched.step_microbatches(arg_mbs=[(x,) for x in xs] if first else None,
                                              target_mbs=ys if last else None, losses=losses)
            ref_opt.zero_grad()
            ref_loss = _unsplit(ref, xs, ys)
            ref_loss.backward()
            if last:  # one loss per piece, each the mean over its positions; a microbatch's is their mean by size
                sizes = [[t.numel() for t in _pieces_of(y, k, split)] for y in ys]
                got = sum(sum(losses[j * k + i] * n for i, n in enumerate(per)) / sum(per)
                          for j, per in enumerate(sizes)) / len(ys)
                if len(losses) != M * k or not torch.allclose(got, ref_loss.detach(), **TOL):
                    bad.append(f"{where} step {step}: loss {got} != {ref_loss.item()} ({len(losses)} losses)")
                with torch.no_grad():
                    whole = []
                    for x in xs:
                        for s in ref:
                            x = s(x)
                        whole.append(x)
                outs = [out] if shapes == "fixed" else out
                want = [torch.cat(whole)] if shapes == "fixed" else whole
                if any(not torch.allclose(a, b, **TOL) for a, b in zip(outs, want)):
                    bad.append(f"{where} step {step}: the merged output differs from the unsplit model's")
            for s in mine:
                for (pn, p), q in zip(stages[s].named_parameters(), ref[s].parameters()):
                    if p.grad is None or not torch.allclose(p.grad, q.grad, **TOL):
                        err = "none" if p.grad is None else f"{(p.grad - q.grad).abs().max():.3g}"
                        bad.append(f"{where} step {step}: stage {s} {pn} grad differs (max err {err})")
            opt.step()
            ref_opt.step()
        for st in pstages:  # the I/W split held where the schedule splits
            if st._runner.split_seen and st._runner.split_fallback is not None:
                bad.append(f"{where}: stage {st.stage_index}'s I ran the whole backward: {st._runner.split_fallback}")
        report = sched.trace_report()  # the simulator's costs: one weight per piece, measured
        if report is not None:
            weights = report.costs.pieces
            if weights is None or len(weights) != k or not all(w > 0 for w in weights):
                bad.append(f"{where}: the traced costs have piece weights {weights}, not {k} positive ones")
        dist.barrier()
    return bad


QUICK = [("1f1b", 1, 4, False, "fixed", 0.5), ("zb_h1", 1, 2, True, "fixed", "equal"),
         ("interleaved_1f1b", 2, 2, False, "lengths", "balanced")]


@pytest.mark.timeout(300)
def test_sequence_pieces_match_the_unsplit_model():
    bad = [b for v in rank_values(_train, 2, QUICK, timeout=240).values() for b in v]
    assert not bad, "\n".join(bad[:20])


@pytest.mark.long
@pytest.mark.timeout(600)
def test_sequence_pieces_every_supported_schedule_and_setting():
    cases = [(name, v, k, sac, shapes, split) for name, v in (("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2))
             for k in (2, 3) for sac in (False, True) for shapes, split in (("fixed", "equal"), ("lengths", 0.6))]
    bad = [b for v in rank_values(_train, 2, cases, timeout=540).values() for b in v]
    assert not bad, "\n".join(bad[:20])
