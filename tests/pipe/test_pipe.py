"""Single-process Pipe against the unsplit model: every schedule, step() and pipe(x)."""
from __future__ import annotations

import copy
import threading
import weakref

import pytest
import torch
from torch import nn

import pipeline_ext as pe
from models import ATOL, build, loss_fn, make_batch, reference, RTOL, run_stages
from pipeline_ext import schedules as S
from pipeline_ext.schedules.pieces import PIECE_SCHEDULES, build_pieces
from pipeline_ext.pipe.partition import balance_by_params, balance_by_time, split_min_max

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zb_h2", "zbv", "dualpipev", "v_half", "v_min"]


def _pipe(model: str, name: str, p: int, m: int, **kw):
    v = 2 if name in pe.pipe.MULTI_STAGE_SCHEDULES else 1
    stages = build(model, p * v)
    # the "tuple" model's stages take (x, skip, ids) as positional arguments: the multi-process convention
    kw.setdefault("unpack_tuples", model == "tuple")
    return pe.Pipe(nn.Sequential(*stages), balance=[1] * (p * v), devices=["cpu"] * p, chunks=m, schedule=name, **kw), stages


def _cases():
    for name in SCHEDULES:
        for p in (2, 4):
            for m, n in ((p, 4 * p), (2 * p, 8 * p), (2 * p, 8 * p + 3)):
                v = 2 if name in pe.pipe.MULTI_STAGE_SCHEDULES else 1
                try:
                    S.build(name, p, m, stages_per_rank=v)
                except S.ScheduleError:
                    continue
                yield name, p, m, n


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", ["mlp", "blocks", "tuple"])
def test_step_matches_unsplit_model_for_every_schedule(model):
    checked = 0
    for name, p, m, n in _cases():
        pipe, stages = _pipe(model, name, p, m, checkpoint="never")
        x, y = make_batch(model, n)
        ref_loss, ref_grads, _ = reference(model, len(stages), x, y)
        loss = pipe.step(x, target=y, loss_fn=loss_fn)
        where = f"{name} p={p} m={m} n={n}"
        torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL, msg=where)
        for s, (stage, grads) in enumerate(zip(stages, ref_grads)):
            for p_, g in zip(stage.parameters(), grads):
                torch.testing.assert_close(p_.grad, g, rtol=RTOL, atol=ATOL, msg=f"{where} stage {s}")
        checked += 1
    assert checked >= 40


@pytest.mark.parametrize("model", ["mlp", "blocks", "tuple"])
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zbv"])
def test_call_is_autograd_connected(model, name):
    pipe, stages = _pipe(model, name, 2, 4)
    x, y = make_batch(model, 11)
    ref_loss, ref_grads, _ = reference(model, len(stages), x, y)
    out = pipe(x)
    torch.testing.assert_close(out, run_stages(build(model, len(stages)), x), rtol=RTOL, atol=ATOL)
    loss = loss_fn(out, y)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    for stage, grads in zip(stages, ref_grads):
        for p_, g in zip(stage.parameters(), grads):
            torch.testing.assert_close(p_.grad, g, rtol=RTOL, atol=ATOL)


class CountSaved(nn.Module):
    """Wraps a layer; tracks, per worker thread (= rank), how many tensors autograd saved
    for it are alive, and the peak. Per rank the count is deterministic: a rank's
    actions run one after another."""

    lock = threading.Lock()
    live: dict[str, int] = {}
    peak: dict[str, int] = {}

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    @classmethod
    def reset(cls) -> None:
        cls.live, cls.peak = {}, {}

    @classmethod
    def max_peak(cls) -> int:
        return max(cls.peak.values())

    @classmethod
    def _pack(cls, t: torch.Tensor):
        class Holder:
            pass

        h, key = Holder(), threading.current_thread().name
        h.t = t
        with cls.lock:
            cls.live[key] = cls.live.get(key, 0) + 1
            cls.peak[key] = max(cls.peak.get(key, 0), cls.live[key])
        weakref.finalize(h, cls._free, key)
        return h

    @classmethod
    def _free(cls, key: str) -> None:
        with cls.lock:
            cls.live[key] -= 1

    def forward(self, x):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda h: h.t):
            return self.inner(x)


def _dropout_model():
    torch.manual_seed(3)
    return nn.Sequential(*[CountSaved(nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.3), nn.ReLU())) for _ in range(4)])


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1"])
def test_checkpoint_modes_same_grads_with_dropout_and_fewer_saved_tensors(name):
    x, y = torch.randn(12, 16), torch.randn(12, 16)
    grads, peaks = {}, {}
    for mode in ("never", "except_last", "always"):
        model = _dropout_model()
        pipe = pe.Pipe(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=4, schedule=name, checkpoint=mode)
        CountSaved.reset()
        torch.manual_seed(7)
        pipe.step(x, target=y, loss_fn=loss_fn)
        grads[mode] = [p.grad.clone() for p in model.parameters()]
        peaks[mode] = CountSaved.max_peak()
    for mode in ("except_last", "always"):
        for a, b in zip(grads[mode], grads["never"]):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=mode)
    if name == "zb_h1":
        # Recomputation happens at I and the graph lives until W, which ZB-H1 defers
        # past the other microbatches' I: here every recomputed graph is alive at
        # once, so checkpointing cannot lower the peak (it shortens F -> I only).
        assert peaks["always"] <= peaks["never"], peaks
    else:
        assert peaks["always"] < peaks["never"] and peaks["always"] <= peaks["except_last"] <= peaks["never"], peaks
    # dropout really dropped: gradients differ from a run without dropout masks
    assert grads["never"][0].count_nonzero() > 0


def test_call_with_checkpoint_and_dropout_matches_unsplit_run_with_same_masks():
    x = torch.randn(8, 16)
    outs = {}
    for mode in ("never", "always"):
        model = _dropout_model()
        pipe = pe.Pipe(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=4, checkpoint=mode)
        torch.manual_seed(11)
        out = pipe(x)
        out.sum().backward()
        outs[mode] = (out.detach(), [p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(outs["always"][0], outs["never"][0])
    for a, b in zip(outs["always"][1], outs["never"][1]):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_no_grad_and_autocast_apply_inside_workers():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    pipe = pe.Pipe(model, balance=[2, 1], devices=["cpu", "cpu"], chunks=2)
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert not pipe(x).requires_grad
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert pipe(x).dtype == torch.bfloat16
    assert pipe(x).dtype == torch.float32


def test_train_eval_to_dtype_and_to_device_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 4))
    pipe = pe.Pipe(model, balance=[1, 2], devices=["cpu", "cpu"], chunks=2)
    pipe.eval()
    x = torch.randn(6, 4)
    torch.testing.assert_close(pipe(x), model(x))  # eval: dropout off in both
    pipe.train()
    assert model[1].training
    pipe.to(torch.float64)
    assert pipe(x.double()).dtype == torch.float64 and model[0].weight.dtype == torch.float64
    with pytest.raises(TypeError, match="places each stage on its own device"):  # torchgpipe's type
        pipe.to("cpu")
    with pytest.raises(TypeError, match="places each stage on its own device"):
        pipe.cuda()


def test_parameters_are_shared_with_the_user_module():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    pipe = pe.Pipe(model, devices=["cpu", "cpu"], chunks=2)
    assert {id(p) for p in pipe.parameters()} == {id(p) for p in model.parameters()}
    assert pipe.balance == [1, 1]


def test_split_min_max_and_balancing():
    assert split_min_max([1, 1, 1, 1], 2) == [2, 2]
    assert split_min_max([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert split_min_max([1, 2, 3, 4, 5], 3) == [3, 1, 1]  # 6 | 4 | 5: max 6
    assert sum(split_min_max([3.0] * 7, 3)) == 7
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(8, 8), nn.Linear(8, 8))
    assert balance_by_params(model, 2) == [1, 3]
    big = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
    before = [p.grad for p in big.parameters()]
    b = balance_by_time(big, torch.randn(64, 256), 2)
    assert sum(b) == 5 and len(b) == 2 and all(k >= 1 for k in b)
    assert [p.grad for p in big.parameters()] == before
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 stages"):
        split_min_max([1, 1], 3)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: pe.Pipe(nn.Linear(2, 2)), "needs an nn.Sequential"),
        (lambda: pe.Pipe(nn.Sequential(nn.Linear(2, 2)), balance=[2], devices=["cpu"]), "summing to the module's 1 layers"),
        (lambda: pe.Pipe(nn.Sequential(nn.Linear(2, 2)), chunks=0), "chunks must be a positive int"),
        (lambda: pe.Pipe(nn.Sequential(nn.Linear(2, 2)), checkpoint="sometimes"), "checkpoint is not one of 'always', 'except_last', or 'never'"),
        (
            lambda: pe.Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), devices=["cpu"] * 2, chunks=1, schedule="1f1b"),
            "1f1b needs n_microbatches >= num_ranks",
        ),
    ],
)
def test_bad_construction_is_a_clear_error(make, match):
    with pytest.raises((ValueError, TypeError, S.ScheduleError), match=match):
        make()


def test_sequence_pieces_are_refused_by_name_and_the_message_names_what_runs_them():
    """The Pipe cuts rows only and carries no keys and values between pieces: seq_chunks must be a ValueError that
    says so (not Python's "unexpected keyword argument"), and a Schedule built over pieces must not run its pieces
    as microbatches of rows (it did: chunks = sequences x pieces made a valid, wrong pipe)."""
    model = lambda: nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))  # noqa: E731
    piece_classes = sorted(pe.get_schedule_class(n).__name__ for n in PIECE_SCHEDULES)
    for kw in ({"seq_chunks": 2}, {"seq_chunks": 4, "seq_split": "balanced", "seq_dim": 1}):
        with pytest.raises(ValueError, match=r"does not run sequence pieces \(seq_chunks=") as err:
            pe.Pipe(model(), devices=["cpu"] * 2, chunks=2, schedule="1f1b", **kw)
        assert all(c in str(err.value) for c in piece_classes), str(err.value)
    pieces = build_pieces("1f1b", 2, 2, 2)  # 2 sequences of 2 pieces: 4 units
    with pytest.raises(ValueError, match=r"'1f1b\[seq_chunks=2\]' is built over sequence pieces \(seq_chunks=2\)"):
        pe.Pipe(model(), devices=["cpu"] * 2, chunks=4, schedule=pieces)
    with pytest.raises(ValueError, match="seq_chunks=2"):  # lowered or forward-only, it still says so
        pe.Pipe(model(), devices=["cpu"] * 2, chunks=4, schedule=S.forward_only(S.lower(pieces)))
    # seq_chunks=1 means no pieces: accepted, and the same pipe as without it
    pipe = pe.Pipe(model(), devices=["cpu"] * 2, chunks=2, schedule="1f1b", seq_chunks=1, seq_split="balanced")
    assert pipe.schedule.name == "1f1b" and pipe.schedule.n_microbatches == 2
    plain = build_pieces("1f1b", 2, 2, 1)  # one piece: the built-in itself, unlabelled
    assert pe.Pipe(model(), devices=["cpu"] * 2, chunks=2, schedule=plain).schedule.n_microbatches == 2


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_batch_smaller_than_chunks_runs_one_row_per_microbatch(name):
    """torchgpipe allows it (the last batch of an epoch); the result is the unsplit model's."""
    pipe, stages = _pipe("mlp", name, 2, 4)
    x, y = make_batch("mlp", 3)
    ref_loss, ref_grads, _ = reference("mlp", len(stages), x, y)
    torch.testing.assert_close(pipe.step(x, target=y, loss_fn=loss_fn), ref_loss, rtol=RTOL, atol=ATOL)
    for stage, grads in zip(stages, ref_grads):
        for p_, g in zip(stage.parameters(), grads):
            torch.testing.assert_close(p_.grad, g, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(pipe(x), run_stages(build("mlp", len(stages)), x), rtol=RTOL, atol=ATOL)
    if name == "1f1b":  # 1F1B needs as many microbatches as devices: a clear error, not a wrong answer
        with pytest.raises(ValueError, match="fewer than chunks=4"):
            pipe(x[:1])


def test_user_inputs_not_mutated():
    pipe, _ = _pipe("mlp", "1f1b", 2, 4)
    x, y = make_batch("mlp", 9)
    x0, y0 = x.clone(), y.clone()
    pipe.step(x, target=y, loss_fn=loss_fn)
    assert torch.equal(x, x0) and torch.equal(y, y0) and not x.requires_grad


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")
def test_cuda_two_stages_one_gpu_match_cpu():
    stages = build("blocks", 2)
    cpu_stages = copy.deepcopy(stages)
    pipe = pe.Pipe(nn.Sequential(*stages), balance=[1, 1], devices=["cuda:0", "cuda:0"], chunks=4, schedule="1f1b")
    x, y = make_batch("blocks", 16)
    loss = pipe.step(x, target=y, loss_fn=loss_fn)
    ref = loss_fn(run_stages(cpu_stages, x), y)
    ref.backward()
    torch.testing.assert_close(loss.cpu(), ref.detach(), rtol=1e-4, atol=1e-5)
    for a, b in zip(pipe.parameters(), (p for s in cpu_stages for p in s.parameters())):
        torch.testing.assert_close(a.grad.cpu(), b.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", S.available())
@pytest.mark.parametrize("p", [2, 4])
def test_runtime_peak_equals_the_simulators(name, p, monkeypatch):
    """The activations the runtime holds are the ones the simulator predicts: per stage and per rank, equal.

    Equal, not just <=: a stage keeps a microbatch's state from its F to its B (or its W when the backward
    is split), exactly the simulator's accounting, and each rank runs its list in order on one thread. The
    per-rank count sums the live microbatches of the rank's stages each time one is kept (the only moment
    the count grows). Schedules are the built-ins at their default stages per rank, m = 2p.
    """
    from pipeline_ext.runtime.stage import StageRunner
    from pipeline_ext.schedules.simulate import peak_live_activations

    m = 2 * p
    v = S.default_stages_per_rank(name)
    sched = S.build(name, p, m, stages_per_rank=v)
    sim = S.simulate(sched)
    per_stage = [peak_live_activations([a for a in sched.actions[r] if a.stage == s])  # the simulator's count
                 for s, r in enumerate(sched.stage_to_rank)]
    runners: dict[int, StageRunner] = {}
    rank_peak = [0] * p
    keep = StageRunner._keep

    def counting_keep(self, mb, state):
        keep(self, mb, state)
        runners[self.stage_index] = self
        rank = sched.stage_to_rank[self.stage_index]
        live = sum(r.live_microbatches for s, r in list(runners.items()) if sched.stage_to_rank[s] == rank)
        rank_peak[rank] = max(rank_peak[rank], live)

    monkeypatch.setattr(StageRunner, "_keep", counting_keep)
    pipe, _ = _pipe("mlp", name, p, m, checkpoint="never")
    x, y = make_batch("mlp", 4 * m)
    pipe.step(x, target=y, loss_fn=loss_fn)
    assert pipe.peak_live_microbatches == per_stage
    assert rank_peak == sim.peak_activations


class _Masked(nn.Module):
    """A first layer with a keyword input (``scale``: one row per microbatch, not per sample)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, scale=None):
        return self.fc(x) * scale.mean()


_OWN_ROWS = "different numbers of rows"


@pytest.mark.parametrize("call", ["forward", "step"])
@pytest.mark.parametrize("chunks,rows,scale_rows,cut", [
    (2, 10, 2, "cut into 2 parts on its own, as torch does, and part k of each goes to microbatch k "
               "(args[0]: 10 rows into 2 of 5 rows; kwargs['scale']: 2 rows into 2 of 1 row)"),
    # a batch with fewer rows than chunks runs one row per microbatch (torchgpipe); the keyword input is cut alike
    (4, 3, 6, "cut into 3 parts on its own, as torch does, and part k of each goes to microbatch k "
              "(args[0]: 3 rows into 3 of 1 row; kwargs['scale']: 6 rows into 3 of 2 rows)"),
])
def test_a_keyword_input_with_its_own_rows_warns_once_per_call_with_the_real_cut(call, chunks, rows, scale_rows, cut):
    """The batch is cut into min(chunks, rows) microbatches; a keyword input whose rows differ is cut into as
    many parts of its own (accepted, torch does it) with one warning per call that says so with those numbers:
    never a second warning about a cut into 1 part, which is not what runs."""
    torch.manual_seed(0)
    pipe = pe.Pipe(nn.Sequential(_Masked(), nn.Linear(4, 2)), balance=[1, 1], devices=["cpu", "cpu"], chunks=chunks)
    x, y, scale = torch.randn(rows, 4), torch.randn(rows, 2), torch.rand(scale_rows, 1)
    for _ in range(2):
        with pytest.warns(UserWarning, match=_OWN_ROWS) as record:
            if call == "forward":
                pipe(x, scale=scale)
            else:
                pipe.step(x, scale=scale, target=y, loss_fn=nn.functional.mse_loss)
        said = [str(w.message) for w in record if _OWN_ROWS in str(w.message)]
        assert len(said) == 1 and cut in said[0], said
