"""Train a Hugging Face ``transformers`` Llama on a pipeline x data-parallel mesh.

What a real (non-``nn.Sequential``) model needs to become pipeline stages, in
one file:

- **cutting** (``LlamaStage``): the first stage owns the token embedding, the
  last one the final norm and the LM head, every stage a slice of the decoder
  layers. A stage keeps the *unsplit model's names* (``model.layers.5...``),
  so checkpoints and ties are written against the names users know;
- **what travels**: a stage returns ``(hidden_states, position_ids,
  padding_mask)`` and the next one takes them positionally. Integer tensors
  travel without gradients. Each stage rebuilds the causal mask and the rotary
  embeddings from them (cheaper than sending a 4-D mask);
- **kwargs**: the first stage's rank passes ``attention_mask=`` to ``step()``;
  it is cut into microbatches (and, with ``--seq-chunks``, into pieces) like
  the input ids, and reaches every stage of that rank (as in torch), where it
  is the padding mask;
- **the loss**: ``pe.TokenMeanLoss`` over pre-shifted labels (``-100`` on
  padding) gives exactly the unsplit model's token mean, over the global batch
  of every data-parallel replica;
- **tied embeddings** (``tie_word_embeddings``): ``pe.tie_parameters`` keeps the
  first stage's embedding and the last stage's head one weight;
- **clipping**: ``pe.clip_grad_norm_`` over the whole pipeline;
- **stages by measured cost** (``--balance``): layer counts assume every layer
  costs the same, but the LM head with its loss costs several decoder layers
  at a large vocabulary, so the last stage sets the pace. ``--balance`` times
  the embedding, each decoder layer and the norm + head + loss on rank 0
  (``pe.balance_layers``; every rank takes rank 0's split, as timings differ
  by process) and cuts where the schedule's simulated step is shortest; a
  stage may then hold only the embedding or only the head;
- **PP x DP** from torch's ``DeviceMesh`` (``pe.pipeline_mesh``, dims "dp" and
  "pp"; ``pe.pipeline_layout`` says which stages this rank holds): each stage
  is wrapped in ``DistributedDataParallel`` over its replicas, and the schedule
  synchronises it once per step (``fully_shard`` works the same way);
- **PP x TP x DP** (``--tp``), composed as torchtitan does: a mesh with dims
  ("dp", "pp", "tp"), each stage made tensor-parallel with torch's
  ``parallelize_module`` (``tensor_parallel``: attention heads and MLP
  column/row-wise, the embedding row-wise and the head column-wise, so the
  tied weight is ``Shard(0)`` on both ends), then ``fully_shard`` over "dp",
  then a ``PipelineStage`` on "pp". The blocks return local (replicated)
  activations, so plain tensors cross stages; a stage whose outputs are
  DTensors sends the local shard and its layout the same way.

Run it (random weights, no downloads; ``pip install "pipeline_ext[llama]"``)::

    torchrun --nproc-per-node 4 examples/llama_pipeline.py --pp 2        # 2 stages x 2 replicas
    python examples/llama_pipeline.py --spawn 4 --pp 2 --check           # no torchrun; compare with unsplit
    python examples/llama_pipeline.py --spawn 4 --pp 4 --balance --check # stages cut by measured cost
    python examples/llama_pipeline.py --spawn 8 --pp 2 --tp 2 --check    # 2 stages x 2 TP ranks x 2 FSDP replicas

At start it prints the layout it runs (``layout: pp=2 x dp=2, schedule 1f1b,
1 stage per rank; rank 0: stage 0 (dp replica 0), ...``); with ``--balance``
rank 0 prints it once the split is measured, the split included (``..., split
[2, 3, 3, 2] of [embedding, 8 decoder layers, head]; ...``: entries per
stage). ``--check`` also runs the unsplit model on the global batch, compares
the pipeline's first-step loss, gradient norm and gradients with it, prints
one ``check: PASS (...)`` or ``check: FAIL (...)`` line and exits with status
1 on FAIL.
"""
from __future__ import annotations

import argparse
import copy
import inspect
import math
import os
import sys
import time
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

import pipeline_ext as pe
from pipeline_ext.seqchunks import check_rope, current_carry, piece_positions, register_hf_attention

try:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.masking_utils import create_causal_mask
except ImportError as exc:  # pragma: no cover - exercised by hand
    raise SystemExit("this example needs transformers: pip install 'pipeline_ext[llama]'") from exc

# create_causal_mask's cache argument is ``cache`` in current transformers and
# ``past_key_values`` in older 5.x releases (where ``cache`` is unknown); newer
# ones accept the old name with a FutureWarning. Pick the name once.
_MASK_CACHE_KW = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"

SIZES = {  # (hidden, layers, heads, kv heads, vocab)
    "tiny": (32, 4, 4, 2, 128),
    "small": (256, 8, 8, 4, 2048),
}


def llama_config(size: str, seq: int, vocab: Optional[int] = None) -> LlamaConfig:
    """The model of ``SIZES[size]``, its vocabulary replaced by ``vocab`` when given (the head's cost grows with it)."""
    hidden, layers, heads, kv, vocab = SIZES[size][:4] + (vocab or SIZES[size][4],)
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=max(64, seq),
                       tie_word_embeddings=True, attention_dropout=0.0)


def cost_split(model: LlamaForCausalLM, seq: int) -> float:
    """``seq_split`` for pieces of equal cost: causal attention's share ``a`` of a decoder layer's cost over ``seq``
    positions (``attention_share``: the query heads' width against the layer's weights in matrix products)."""
    from pipeline_ext.schedules.pieces import attention_share

    config, layer = model.config, model.model.layers[0]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    matmul = sum(m.weight.numel() for m in layer.modules() if isinstance(m, nn.Linear))
    return attention_share(length=seq, width=config.num_attention_heads * head_dim, matmul_params=matmul)


class LlamaStage(nn.Module):
    """Decoder layers ``[lo, hi)`` of a ``LlamaForCausalLM``, plus the embedding (first) or norm and head (last).

    The submodules are the unsplit model's own (no copies) under the unsplit
    model's names, so ``state_dict()`` keys are the unsplit model's keys.
    """

    def __init__(self, full: LlamaForCausalLM, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.config = full.config
        self.first, self.last = first, last
        self.model = nn.Module()
        if first:
            self.model.embed_tokens = full.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): full.model.layers[i] for i in range(lo, hi)})
        self.model.rotary_emb = full.model.rotary_emb  # no parameters: every stage needs it
        if last:
            self.model.norm = full.model.norm
            self.lm_head = full.lm_head

    def forward(self, x: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                padding_mask: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None):
        # the padding mask travels positionally from the previous stage; a rank's own keyword argument (it reaches
        # every stage of the rank) is the same mask
        attention_mask = attention_mask if attention_mask is not None else padding_mask
        if self.first:  # x: token ids; position ids are made here and travel with the activations
            # the piece's own positions under seq_chunks (arange(length) would restart every piece at 0)
            position_ids = piece_positions(current_carry(), x.shape[1], x.device).repeat(x.shape[0], 1)
            x = self.model.embed_tokens(x)
        mask = create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=attention_mask,
                                  position_ids=position_ids, **{_MASK_CACHE_KW: None})
        rotary = self.model.rotary_emb(x, position_ids=position_ids)
        for layer in self.model.layers.values():
            x = layer(x, attention_mask=mask, position_embeddings=rotary, position_ids=position_ids)
        if self.last:
            return self.lm_head(self.model.norm(x))
        return x, position_ids, attention_mask


def llama_layers(full: LlamaForCausalLM) -> list[LlamaStage]:
    """The model as ``[embedding, decoder layer 0, ..., norm + head]`` for ``pe.balance_layers``.

    Each entry is a ``LlamaStage`` (the ends hold no decoder layer), so it
    follows the stages' calling convention and is timed as a stage runs it,
    mask and rotary embeddings included. ``pe.block_ranges`` turns a split of
    this list into each stage's decoder layers.
    """
    n = full.config.num_hidden_layers
    return [LlamaStage(full, 0, 0, first=True, last=False),
            *(LlamaStage(full, i, i + 1, first=False, last=False) for i in range(n)),
            LlamaStage(full, n, n, first=False, last=True)]


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The unsplit model's loss: token mean of cross entropy over pre-shifted labels (-100 ignored)."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def balanced_split(full: LlamaForCausalLM, schedule: str, pp: int, microbatches: int, rows: int, seq: int,
                   device: torch.device, repeats: int = 5) -> list[int]:
    """Entries of ``llama_layers(full)`` per stage, cut by measured cost for ``schedule`` on ``pp`` ranks.

    Times one microbatch of ``rows`` rows (step 0's batch) through each entry,
    the loss on the head; with torch.distributed up, rank 0 times and every
    rank gets its split (``pe.balance_layers``).
    """
    ids, mask, labels = make_batch(rows, seq, full.config.vocab_size, 0)
    bal = pe.balance_layers(llama_layers(full), (ids.to(device),), schedule, num_ranks=pp, microbatches=microbatches,
                            stages_per_rank=stages_per_rank(schedule),
                            example_kwargs={"attention_mask": mask.to(device)}, loss_fn=lm_loss,
                            target=labels.to(device), repeats=repeats)
    return bal.sizes


def check_balance_fits(layers: int, pp: int, schedule: str) -> None:
    """``--balance`` cuts ``[embedding, layers, head]``: a ValueError when the schedule has more stages."""
    n = pp * stages_per_rank(schedule)
    if n > layers + 2:
        raise ValueError(f"--balance: {schedule} on --pp {pp} has {n} stages, more than the {layers + 2} entries "
                         f"(embedding, {layers} decoder layers, head) it can cut")


def make_batch(rows: int, seq: int, vocab: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Counting sequences (learnable) with right padding: ids, attention mask, labels shifted left (-100 masked)."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, vocab, (rows, 1), generator=g)
    ids = (start + torch.arange(seq)) % vocab
    lengths = torch.randint(seq // 2, seq + 1, (rows,), generator=g)
    mask = (torch.arange(seq) < lengths[:, None]).long()
    ids = ids * mask  # pad id 0
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return ids, mask, labels


def split_layers(layers: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges, as even as possible."""
    cuts = [round(i * layers / stages) for i in range(stages + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def stages_per_rank(schedule: str) -> int:
    """Model stages each pipeline rank holds: 2 for the looped and V schedules, else 1."""
    return 2 if schedule in ("interleaved_1f1b", "looped_bfs", "zbv", "dualpipev") else 1


def planned_layout(world: int, pp: int, schedule: str, tp: int = 1) -> list[tuple[int, tuple[int, ...]]]:
    """``[(dp replica, stages held)]`` per global rank, without a process group.

    Follows the mesh ``train`` builds (dims ("dp", "pp", "tp"), row-major: rank
    r is TP rank ``r % tp`` of pipeline rank ``r // tp % pp`` of replica
    ``r // (tp * pp)``; with ``tp == 1`` that is ``pe.pipeline_mesh``) and the
    schedule's stage placement, so the launcher can print the layout before any
    rank starts; ``train`` checks each rank against it.
    """
    if pp < 1 or tp < 1 or world % (pp * tp):
        raise ValueError(f"world size {world} is not a multiple of --pp {pp}" + (f" x --tp {tp}" if tp > 1 else ""))
    placement = pe.schedules.build(schedule, pp, 2 * pp, stages_per_rank=stages_per_rank(schedule)).stage_to_rank
    return [(r // (tp * pp), tuple(s for s, owner in enumerate(placement) if owner == r // tp % pp))
            for r in range(world)]


def describe_layout(world: int, pp: int, schedule: str, split: Optional[Sequence[int]] = None, tp: int = 1) -> str:
    """One line: ``layout: pp=2 x dp=2, schedule 1f1b, 1 stage per rank; rank 0: stage 0 (dp replica 0), ...``.

    ``split`` (a ``--balance`` split of ``llama_layers``) goes after the stages
    per rank: ``..., split [2, 3, 3, 2] of [embedding, 8 decoder layers, head]; rank 0: ...``.
    With ``tp > 1``: ``layout: pp=2 x dp=2 x tp=2, ...; rank 0: stage 0 (dp replica 0, tp rank 0), ...``.
    """
    v = stages_per_rank(schedule)
    ranks = ", ".join(f"rank {r}: stage{'s' if len(held) > 1 else ''} {', '.join(map(str, held))} (dp replica {dp}"
                      + (f", tp rank {r % tp})" if tp > 1 else ")")
                      for r, (dp, held) in enumerate(planned_layout(world, pp, schedule, tp)))
    cut = "" if split is None else f", split {list(split)} of [embedding, {sum(split) - 2} decoder layers, head]"
    per_rank = f"{v} stage{'s' if v > 1 else ''} per rank"
    dims = f"pp={pp} x dp={world // (pp * tp)}" + (f" x tp={tp}" if tp > 1 else "")
    return f"layout: {dims}, schedule {schedule}, {per_rank}{cut}; {ranks}"


def tensor_parallel(stage: LlamaStage, tp_mesh: Any) -> nn.Module:
    """``stage`` made tensor-parallel over ``tp_mesh`` with torch's ``parallelize_module``, in place.

    Each decoder layer's q/k/v and gate/up projections are column-wise (each TP
    rank holds some attention heads and part of the MLP), o and down row-wise
    (their outputs are summed over TP, back to whole hidden states). The
    embedding is row-wise and the head column-wise: both ``Shard(0)`` of the
    (vocab, hidden) weight, so ``pe.tie_parameters`` sums like shards. The norms
    stay plain, replicated parameters (every TP rank computes the same values
    and gradients). Every output is a local tensor: plain hidden states cross
    stages, and the head returns whole logits for the loss.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    heads, kv = stage.config.num_attention_heads, stage.config.num_key_value_heads
    if heads % tp_mesh.size() or kv % tp_mesh.size():
        raise ValueError(f"--tp {tp_mesh.size()} must divide the attention heads ({heads}) and kv heads ({kv})")
    plan: dict[str, Any] = {}
    for i in stage.model.layers:
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    if stage.first:
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
    if stage.last:
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    return parallelize_module(stage, tp_mesh, plan)


def train(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank of the run; returns what it measured (losses on the last stage, checks with ``check``)."""
    from torch.nn.parallel import DistributedDataParallel

    pp, tp = cfg["pp"], cfg.get("tp", 1)
    if world % (pp * tp):
        raise ValueError(f"world size {world} is not a multiple of --pp {pp} x --tp {tp}")
    dp = world // (pp * tp)
    device = torch.device(cfg.get("device", "cpu"))
    name = cfg["schedule"]
    v = stages_per_rank(name)
    if tp > 1:  # torch's DeviceMesh with a third dim, innermost (TP's collectives run on every layer)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
    else:
        mesh = pe.pipeline_mesh(pp=pp, dp=dp, device_type=device.type)  # torch's DeviceMesh, dims ("dp", "pp")
    layout = pe.pipeline_layout(mesh, name, stages_per_rank=v)  # which stages this rank holds
    mine, n, dp_rank = layout.stages, layout.num_stages, layout.dp_rank
    tp_rank = mesh["tp"].get_local_rank() if tp > 1 else 0
    if (dp_rank, mine) != planned_layout(world, pp, name, tp)[rank]:  # the printed layout must be the one that runs
        raise RuntimeError(f"rank {rank} holds stages {mine} of dp replica {dp_rank}, the printed layout says "
                           f"{planned_layout(world, pp, name, tp)[rank]}")
    dp_group = layout.dp_group if dp > 1 else None
    rows = cfg["batch"] // dp

    config = llama_config(cfg["size"], cfg["seq"])
    pieces = cfg.get("seq_chunks", 1)
    if pieces > 1:  # the attention that carries keys and values across a sequence's pieces (Seq1F1B)
        config._attn_implementation = register_hf_attention()
        check_rope(config)
    torch.manual_seed(0)  # the same random weights on every rank
    full = LlamaForCausalLM(config).to(device)
    seq_split = cfg.get("seq_split", "equal")
    if seq_split == "cost":  # pieces of equal cost: later pieces attend to more keys, so the first is the longest
        seq_split = cost_split(full, cfg["seq"])
    reference = copy.deepcopy(full) if cfg.get("check") else None

    if cfg.get("balance"):  # rank 0 times each layer; every rank cuts where rank 0 says
        check_balance_fits(config.num_hidden_layers, pp, name)
        split = balanced_split(full, name, pp, cfg["microbatches"], max(1, rows // cfg["microbatches"]), cfg["seq"],
                               device)
        ranges = pe.block_ranges(split)
        if rank == 0 and cfg.get("verbose", True):  # the split is known only now: rank 0 prints the layout
            print(describe_layout(world, pp, name, split), flush=True)
    else:
        ranges = split_layers(config.num_hidden_layers, n)
    modules = {s: LlamaStage(full, *ranges[s], first=s == 0, last=s == n - 1) for s in mine}
    del full  # the stages hold what this rank needs
    if tp > 1:  # torchtitan's order: TP, then FSDP over "dp" (each decoder layer, then the stage)
        from torch.distributed.fsdp import fully_shard

        for m in modules.values():
            tensor_parallel(m, mesh["tp"])
            if dp > 1:
                for layer in m.model.layers.values():
                    fully_shard(layer, mesh=mesh["dp"])
                fully_shard(m, mesh=mesh["dp"])
        wrapped = dict(modules)
    else:  # data parallel: each stage in DDP over its replicas (synchronised once per step by the schedule)
        wrapped = {s: DistributedDataParallel(m, process_group=dp_group) if dp_group is not None else m
                   for s, m in modules.items()}
    stages = [pe.PipelineStage(wrapped[s], s, n, device, group=mesh["pp"]) for s in mine]
    loss_fn = pe.TokenMeanLoss(dp_group=dp_group)
    sched = pe.get_schedule_class(name)(stages if v > 1 else stages[0], cfg["microbatches"], loss_fn=loss_fn,
                                        **({"seq_chunks": pieces, "seq_split": seq_split} if pieces > 1 else {}))
    # names as in the stage module (the DDP wrapper's "module." prefix is not needed)
    pe.tie_parameters(sched, {"embed": {0: "model.embed_tokens.weight", n - 1: "lm_head.weight"}})
    params = list(nn.ModuleList(modules.values()).parameters())  # a weight shared by two local stages: once
    # with TP, DTensor parameters (sharded) and plain ones (the norms, without FSDP) are mixed: torch's foreach
    # kernels refuse the mix
    opt = torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=0.0, foreach=False if tp > 1 else None)

    out: dict[str, Any] = {"losses": [], "tokens_per_s": []}
    for step in range(cfg["steps"]):
        ids, mask, labels = make_batch(cfg["batch"], cfg["seq"], config.vocab_size, step)
        mine_rows = slice(dp_rank * rows, (dp_rank + 1) * rows)  # this replica's share of the global batch
        losses: list[torch.Tensor] = []
        t0 = time.perf_counter()
        args, kwargs = ((ids[mine_rows].to(device),), {"attention_mask": mask[mine_rows].to(device)}) \
            if sched.has_first_stage else ((), {})
        sched.step(*args, target=labels[mine_rows].to(device) if sched.has_last_stage else None, losses=losses,
                   **kwargs)
        if reference is not None and step == 0:
            out.update(_compare_first_step(reference, modules, sched, loss_fn, losses, ids, mask, labels, dp_group,
                                           cfg["clip"], device))
        norm = pe.clip_grad_norm_(sched, cfg["clip"])  # DTensor and plain gradients: each kind clipped on its own
        opt.step()
        opt.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - t0
        out["tokens_per_s"].append(cfg["batch"] * cfg["seq"] / elapsed)
        if sched.has_last_stage:
            loss = loss_fn.combine(losses).detach()
            if dp_group is not None:
                dist.all_reduce(loss, group=dp_group)
                loss /= dp
            out["losses"].append(float(loss))
            if dp_rank == 0 and tp_rank == 0 and cfg.get("verbose", True):
                print(f"step {step:3d}  loss {float(loss):.4f}  grad norm {float(norm):.3f}  "
                      f"{out['tokens_per_s'][-1]:,.0f} tokens/s", flush=True)
    return out


def _compare_first_step(reference: LlamaForCausalLM, modules: dict[int, LlamaStage], sched: Any, loss_fn: Any,
                        losses: list, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor,
                        dp_group: Optional[dist.ProcessGroup], clip: float, device: torch.device) -> dict[str, float]:
    """The unsplit model on the global batch vs this rank's stages after one step (grads before clipping)."""
    position_ids = torch.arange(ids.shape[1]).repeat(ids.shape[0], 1)
    logits = reference(ids.to(device), attention_mask=mask.to(device), position_ids=position_ids.to(device)).logits
    ref_loss = lm_loss(logits, labels.to(device))
    ref_loss.backward()
    ref_loss = ref_loss.detach()
    grad_err = 0.0
    for module in modules.values():
        for fqn, p in module.named_parameters():  # the stage's names are the unsplit model's
            q = reference.get_parameter(fqn)
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # TP/FSDP: a collective
            grad_err = max(grad_err, float((g - q.grad).abs().max() / q.grad.abs().max().clamp(min=1e-12)))
    total = pe.training.total_grad_norm(sched)
    ref_total = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    res = {"grad_rel_err": grad_err, "norm_err": abs(float(total) - float(ref_total)) / float(ref_total)}
    if sched.has_last_stage:
        loss = loss_fn.combine(losses).detach()
        if dp_group is not None:
            dist.all_reduce(loss, group=dp_group)
            loss /= dist.get_world_size(dp_group)
        res["loss_err"] = abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))
    return res


# Tolerances of --check, all relative errors, worst over the ranks. In float32
# the pipeline and the unsplit model sum the same terms in other orders
# (microbatches, DP all-reduce, tied-weight gradients added across stages), so
# they differ by rounding: about 1e-7..1e-6 for the tiny model, up to ~1e-5 for
# larger ones. A real mistake (a microbatch or replica missing, a mean over
# microbatches or replicas instead of over the global batch's tokens, a tie not
# summed) moves some gradient by 1e-2 or more (the mean per replica: 1.4e-1 on
# the tiny 2x2 run) and fails here; the loss and the global norm move less
# (3e-4 and 4e-3 for that mistake), so the gradients are the measure that
# decides. 1e-4 sits an order above the noise.
CHECK_TOLERANCES = {"grad_rel_err": 1e-4, "norm_err": 1e-4, "loss_err": 1e-4}
_CHECK_LABELS = {"grad_rel_err": "max grad rel err", "norm_err": "norm rel err", "loss_err": "loss rel err"}


def check_verdict(results: dict[int, dict[str, Any]]) -> tuple[bool, str]:
    """``(passed, "check: PASS (...)" or "check: FAIL (...)")`` from every rank's first-step comparison.

    A measure no rank reported, or one that is NaN, fails.
    """
    worst: dict[str, float] = {}
    for key in CHECK_TOLERANCES:
        values = [float(v[key]) for v in results.values() if key in v]
        if values:
            worst[key] = math.nan if any(math.isnan(x) for x in values) else max(values)
    failed = [f"{_CHECK_LABELS[k]} missing" if k not in worst else f"{_CHECK_LABELS[k]} {worst[k]:.1e} > {tol:.0e}"
              for k, tol in CHECK_TOLERANCES.items() if not worst.get(k, math.nan) <= tol]
    if failed:
        return False, f"check: FAIL ({', '.join(failed)})"
    return True, f"check: PASS ({', '.join(f'{_CHECK_LABELS[k]} {worst[k]:.1e}' for k in CHECK_TOLERANCES)})"


def main(argv: Optional[list[str]] = None) -> int:
    """Run the example; the exit status is 1 when ``--check`` fails, else 0."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=2, help="pipeline ranks (the rest of the world is data parallel)")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel ranks per stage (then the data-parallel replicas are FSDP2, not DDP)")
    ap.add_argument("--schedule", default="1f1b", help="1f1b, interleaved_1f1b, zb_h1, zbv, ...")
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--batch", type=int, default=16, help="global batch (rows), split over the DP replicas")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--check", action="store_true", help="compare the first step with the unsplit model")
    ap.add_argument("--balance", action="store_true",
                    help="cut the stages by measured cost (rank 0 times each layer) instead of equal layer counts")
    ap.add_argument("--seq-chunks", type=int, default=1,
                    help="cut each sequence into this many pieces and pipeline the pieces (Seq1F1B: 1f1b, zb_h1, "
                         "interleaved_1f1b)")
    ap.add_argument("--seq-split", choices=("equal", "cost"), default="equal",
                    help="with --seq-chunks: pieces of equal length, or of equal cost (the first longest: later "
                         "pieces attend to more keys)")
    ap.add_argument("--spawn", type=int, default=0, help="start this many local ranks (Gloo) instead of torchrun")
    args = ap.parse_args(argv)
    cfg = {k: getattr(args, k) for k in ("pp", "tp", "schedule", "size", "batch", "seq", "microbatches", "steps",
                                         "lr", "clip", "check", "balance", "seq_chunks", "seq_split")}
    if args.balance and args.tp > 1:
        ap.error("--balance times layers on one rank: it does not combine with --tp")
    if args.balance:
        try:
            check_balance_fits(SIZES[args.size][1], args.pp, args.schedule)
        except ValueError as exc:
            ap.error(str(exc))
    if args.spawn:
        from pipeline_ext.comm.launch import spawn

        try:
            layout = describe_layout(args.spawn, args.pp, args.schedule, tp=args.tp)
        except ValueError as exc:
            ap.error(str(exc))
        if not args.balance:  # with --balance, rank 0 prints it with the measured split
            print(layout, flush=True)
        # with --balance the other ranks wait in a broadcast while rank 0 profiles: a longer group timeout
        results = spawn(train, args.spawn, cfg, timeout=3600, pg_timeout=600 if args.balance else 60, threads=1)
        return _report({r: v for r, (_, v) in results.items()}, args.check)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        cfg["device"] = f"cuda:{local}"
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if rank == 0 and not args.balance:  # with --balance, train prints it with the measured split
            print(describe_layout(world, args.pp, args.schedule, tp=args.tp), flush=True)
        res = train(rank, world, cfg)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, res)
        # every rank reaches the same verdict, so each exits with the same status; rank 0 prints
        return _report(dict(enumerate(gathered)), args.check, quiet=rank != 0)
    finally:
        dist.destroy_process_group()


def _report(results: dict[int, dict[str, Any]], check: bool, quiet: bool = False) -> int:
    """Print throughput and, with ``check``, the one-line verdict; return the exit status."""
    # the first step includes one-off setup (process groups, first-touch allocations): left out when there are more
    timed = [v["tokens_per_s"][1:] or v["tokens_per_s"] for v in results.values()]
    if not quiet and all(timed):
        which = "steps after the first" if len(next(iter(results.values()))["tokens_per_s"]) > 1 else "the only step"
        print(f"mean over {which}: {min(sum(t) / len(t) for t in timed):,.0f} tokens/s (global batch, slowest rank)")
    if not check:
        return 0
    passed, line = check_verdict(results)
    if not quiet:
        print(line, flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
