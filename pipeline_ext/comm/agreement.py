"""Step agreement: before any activation moves, every rank knows every rank agrees to this step.

Real training loops catch errors and go on, validate between training steps,
and get ranks to disagree by accident (a different ``n_microbatches`` on one
rank, a missing ``loss_fn`` or target on another). Unchecked, each of those
leaves the ranks one step apart, silently pairing one step's activations with
the next step's targets, or aborts a process inside Gloo. So every step starts
with one exchange: each rank sends every other rank a fixed-size record, and
waits (bounded by ``timeout``) for theirs:

=====  ==================================================================
word   meaning
=====  ==================================================================
0      magic (a record from something else, or another version, is rejected by name)
1      step number: every call of ``step``/``eval`` on the process group (any
       schedule), failed ones included, so a rank that skipped a call is named
2      step kind: training or forward-only (``STEP_KINDS``)
3      schedule key (hash of name, placement, microbatches, stages)
4, 5   n_microbatches, num_stages
6      status: 0 accepted; 1 this rank rejected its own inputs
7      whether this rank has a ``loss_fn``
8, 9   digest of the rows per microbatch, and the rows (rank of stage 0)
10     target rows (rank of the last stage; -1: none)
11     digest of the microbatch signatures whose layouts this rank has
       cached (they must match)
12     the sender's rank
13     digest of the skip connections this rank's stages declare (0: none);
       when any is set, the ranks exchange the declarations once
       (``PipelineSchedule``, ``pipeline_ext.skip``)
14     the transport this rank asked for (``TRANSPORT_CODES``): ranks that
       would set up different transports wait for each other forever
15     digest of the target's rows per microbatch (rank of the last stage)
16-19  schedule name (ASCII)
20-35  the rejecting rank's reason (UTF-8, truncated)
36     how many distinct microbatch signatures follow (rank of stage 0: of
       its inputs; any other rank: of its own keyword arguments, 0 when it
       has none, [Note: keyword arguments salt the signatures]; -1: more
       than fit, the step's layouts are exchanged and not kept)
37-68  the distinct microbatch signatures (at most 32)
69-100 which of them each microbatch has, one byte per microbatch (at most 256)
101    this rank's autocast state (``autocast_digest``; 0: off): it salts the
       signatures the layouts are cached by
102    digest of the transport per edge this rank settled (``transport.edges_digest``;
       0: not settled yet): every rank computes the table from the same
       descriptions, and the records check that they did
=====  ==================================================================

Every rank then runs the same pure decision (:func:`agree`) over the same
records, so either every rank starts the step knowing every microbatch's
signature (so every message's layout, when seen before: ``comm_plan.py``), or
every rank raises, naming the rank and the reason, and
all stay in step for the next call. Being fixed-size, a record can be received
whatever the peer's configuration: a disagreement is described in words,
never met as a Gloo abort or a read of unwritten memory.

Why point to point (not ``all_gather``): on Gloo a collective runs on the
group's worker thread (two thread wake-ups per rank per step on a critical
path); a send or receive runs in the caller's thread. The sends and receives
go as one ``batch_isend_irecv``, which NCCL needs to not deadlock.
"""
from __future__ import annotations

import enum
import functools
import itertools
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from pipeline_ext.runtime._ext import _C
from pipeline_ext.runtime.channel import ChannelError, ChannelTimeout, _ms
from pipeline_ext.runtime.ops import _is_dtensor
from pipeline_ext.comm.identity import stable_hash

__all__ = ["AGREEMENT_TAG", "TRAIN", "FORWARD", "STEP_KINDS", "MAX_SIGNATURES", "MAX_MICROBATCHES", "Agreement",
           "PendingExchange", "StepRecord", "StepAgreement", "StepAgreementError", "StepRejectedError", "agree",
           "autocast_digest", "describable", "sizes_digest"]

# Outside the executor's message tags (< 2^30) and their layout bit (2^30): see identity.py.
AGREEMENT_TAG = 2**31 - 1

_MAGIC = 0x7065_5F73_7465_7034  # "pe_step4"
_WORDS = 103
_NAME_WORDS, _REASON_WORDS = (16, 20), (20, 36)
_COUNT_WORD, _SIGS, _INDEX = 36, (37, 69), (69, 101)
_AUTOCAST_WORD, _EDGES_WORD = 101, 102
#: distinct microbatch signatures, and microbatches, one record describes (beyond them a step is not cached)
MAX_SIGNATURES, MAX_MICROBATCHES = _SIGS[1] - _SIGS[0], 8 * (_INDEX[1] - _INDEX[0])
_CACHE_LIMIT = 1024
_CLOSED = (" (if an earlier step timed out, the backend closed this connection for good: "
           "create a new process group and schedule on every rank)")
_NOTHING_MOVED = ("no message was sent and no gradient accumulated on any rank (a forward already run "
                  "on this rank was discarded)")
#: word 2 of a record: what the step runs
TRAIN, FORWARD = 1, 2
STEP_KINDS = {TRAIN: "a training step", FORWARD: "a forward-only step (eval(), or step() without a loss_fn)"}
#: word 14 of a record: "process_group" is the group's own backend (Gloo on CPU, NCCL on GPU), whatever the hosts
TRANSPORT_CODES = {"process_group": 1, "auto": 2, "shm": 3, "ipc": 4}
_TRANSPORT_NAMES = {v: k for k, v in TRANSPORT_CODES.items()}


class StepAgreementError(RuntimeError):
    """The ranks disagree about the step (schedule, microbatches, step kind, loss, step number); nothing was sent."""


class StepRejectedError(StepAgreementError):
    """Another rank rejected its inputs for this step; nothing was sent, no gradient accumulated."""


@dataclass
class StepRecord:
    """What one rank says about the step it is about to run."""

    rank: int
    step: int
    kind: int
    schedule: str
    schedule_key: int
    n_microbatches: int
    num_stages: int
    has_loss: bool
    rejected: str = ""  # this rank's reason, empty when it accepts
    #: each microbatch's signature (``StepAgreement.microbatch_signatures``): of the inputs on stage 0's rank, of
    #: the rank's own keyword arguments on any other (``()``: none); None: too many distinct ones to describe,
    #: the step is not cached
    microbatches: Optional[tuple[int, ...]] = ()
    rows: int = 0
    sizes: int = 0  # digest of the rows per microbatch (``sizes_digest``)
    target_rows: int = -1
    target_sizes: int = 0  # digest of the target's rows per microbatch
    layouts: int = 0  # PlanCache.digest of this step kind: which microbatch signatures this rank has cached
    skips: int = 0  # digest of this rank's skip declarations (0: none)
    transport: int = 0  # TRANSPORT_CODES of the transport this rank asked for
    autocast: int = 0  # autocast_digest of this rank: what its stages compute in (0: autocast off)
    edges: int = 0  # edges_digest of the transport per edge this rank settled (0: not yet)

    def encode(self) -> list[int]:
        words = [0] * _WORDS
        words[:16] = [_MAGIC, self.step, self.kind, self.schedule_key, self.n_microbatches, self.num_stages,
                      int(bool(self.rejected)), int(self.has_loss), self.sizes, self.rows, self.target_rows,
                      self.layouts, self.rank, self.skips, self.transport, self.target_sizes]
        words[slice(*_NAME_WORDS)] = _text_words(self.schedule, _NAME_WORDS)
        words[slice(*_REASON_WORDS)] = _text_words(self.rejected, _REASON_WORDS)
        words[_COUNT_WORD:_AUTOCAST_WORD] = _microbatch_words(self.microbatches)
        words[_AUTOCAST_WORD] = self.autocast
        words[_EDGES_WORD] = self.edges
        return words

    @classmethod
    def decode(cls, words: Sequence[int], sender: int) -> "StepRecord":
        if len(words) != _WORDS or words[0] != _MAGIC:
            raise StepAgreementError(
                f"rank {sender} sent a step record pipeline_ext cannot read (another version of pipeline_ext, "
                "or something else sending on its tag?)"
            )
        w = list(words)
        return cls(rank=w[12], step=w[1], kind=w[2], schedule=_words_text(w[slice(*_NAME_WORDS)]),
                   schedule_key=w[3], n_microbatches=w[4], num_stages=w[5], has_loss=bool(w[7]),
                   rejected=_words_text(w[slice(*_REASON_WORDS)]) or ("rejected" if w[6] else ""),
                   microbatches=_words_microbatches(w[_COUNT_WORD:_AUTOCAST_WORD], w[4]), sizes=w[8], rows=w[9],
                   target_rows=w[10], target_sizes=w[15], layouts=w[11], skips=w[13], transport=w[14],
                   autocast=w[_AUTOCAST_WORD], edges=w[_EDGES_WORD])


def sizes_digest(sizes: Sequence[int]) -> int:
    """What ranks compare to know two lists of rows per microbatch are the same (the inputs' and the target's)."""
    return stable_hash(repr([int(s) for s in sizes]))


def _microbatch_words(microbatches: Optional[Sequence[int]]) -> list[int]:
    """Words 36-100: the distinct signatures, then one byte per microbatch naming which it has."""
    words = [0] * (_AUTOCAST_WORD - _COUNT_WORD)
    if microbatches is None:
        words[0] = -1
        return words
    distinct = list(dict.fromkeys(microbatches))
    words[0] = len(distinct)
    words[1 : 1 + len(distinct)] = distinct
    index = {sig: i for i, sig in enumerate(distinct)}
    words[_INDEX[0] - _COUNT_WORD:] = _bytes_words(bytes(index[sig] for sig in microbatches), _INDEX)
    return words


def _words_microbatches(words: Sequence[int], n: int) -> Optional[tuple[int, ...]]:
    count = words[0]
    if count < 0:
        return None
    if count == 0 or not 0 < n <= MAX_MICROBATCHES or count > MAX_SIGNATURES:
        return ()
    distinct = words[1 : 1 + count]
    raw = _words_bytes(words[_INDEX[0] - _COUNT_WORD:_INDEX[1] - _COUNT_WORD])
    return tuple(distinct[min(b, count - 1)] for b in raw[:n])


def describable(microbatches: Sequence[int]) -> Optional[tuple[int, ...]]:
    """The signatures as a record carries them; None when they are too many (the step is then not cached)."""
    if len(microbatches) > MAX_MICROBATCHES or len(set(microbatches)) > MAX_SIGNATURES:
        return None
    return tuple(microbatches)


def _bytes_words(raw: bytes, span: tuple[int, int]) -> list[int]:
    """``raw`` as the int64 words of ``span`` (cut or zero-padded to fit)."""
    n = (span[1] - span[0]) * 8
    raw = raw[:n].ljust(n, b"\0")
    return [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, n, 8)]


def _words_bytes(words: Sequence[int]) -> bytes:
    return b"".join(int(w).to_bytes(8, "little", signed=True) for w in words)


def _text_words(text: str, span: tuple[int, int]) -> list[int]:
    return _bytes_words(text.encode("utf-8"), span)


def _words_text(words: Sequence[int]) -> str:
    return _words_bytes(words).rstrip(b"\0").decode("utf-8", errors="replace")


@dataclass
class Agreement:
    """What every rank starts the step with."""

    step: int  # the step number, part of every message's tag (identity.py)
    microbatches: Optional[tuple[int, ...]]  # each microbatch's signature; None: not cached (too many)
    rediscover: bool  # exchange every message's layout again, whatever the caches say
    skips: tuple[int, ...] = ()  # every rank's skip declaration digest, in rank order
    rows: int = 0  # the batch's rows on stage 0's rank
    sizes: int = 0  # ``sizes_digest`` of its rows per microbatch (a rank's own keyword arguments are held to it)


def _disagreement(records: Sequence[StepRecord]) -> Optional[str]:
    """The first thing the ranks disagree on, in words; None when they agree."""
    def differ(key: Any) -> bool:
        return len({key(r) for r in records}) > 1

    if differ(lambda r: r.step):
        said = ", ".join(f"rank {r.rank} is at step {r.step}" for r in records)
        return (f"the ranks are out of step: {said}. Every rank must call step()/eval() the same number of times "
                "(a failed step raises on every rank: catch it on every rank)")
    if differ(lambda r: r.transport):
        said = ", ".join(f"rank {r.rank} asked for transport={_TRANSPORT_NAMES.get(r.transport, '?')!r}"
                         for r in records)
        return (f"the ranks ask for different transports: {said}. Pass the same transport= (or set the same "
                "$PIPELINE_EXT_TRANSPORT) on every rank")
    settled = [r for r in records if r.edges]  # a rank whose transport is not settled yet has nothing to compare
    if len({r.edges for r in settled}) > 1:
        said = ", ".join(f"rank {r.rank}: {r.edges:016x}" for r in settled)
        return (f"the ranks settled different transports per edge (digests {said}): their descriptions of "
                "themselves differed (comm/transport/decide.py decide_edges); report it with every rank's "
                "PipelineSchedule.transport_per_edge")
    if differ(lambda r: (r.schedule_key, r.n_microbatches, r.num_stages)):
        # Two schedules of one name and size (hand-written ones) differ in their actions: say which is whose.
        same_words = not differ(lambda r: (r.schedule, r.n_microbatches, r.num_stages))
        return "the ranks run different schedules: " + ", ".join(
            f"rank {r.rank} runs {r.schedule} with {r.n_microbatches} microbatches over {r.num_stages} stages"
            + (f" (actions digest {r.schedule_key:016x})" if same_words else "")
            for r in records) + (" (same name and sizes, different actions or stage placement)" if same_words else "")
    if differ(lambda r: r.has_loss):  # before the kind: a missing loss_fn is what makes step() forward-only
        said = ", ".join(f"rank {r.rank} {'has a' if r.has_loss else 'has no'} loss_fn" for r in records)
        return (f"the ranks disagree on the loss: {said}. Pass the same loss_fn on every rank "
                "(loss_fn=None on every rank makes step() forward-only)")
    if differ(lambda r: r.kind):
        return "the ranks run different kinds of step: " + ", ".join(
            f"rank {r.rank} runs {STEP_KINDS.get(r.kind, r.kind)}" for r in records)
    return None


def agree(records: Sequence[StepRecord], first_rank: int, last_rank: int) -> Agreement:
    """The one decision every rank takes over the same records (so they all take the same one)."""
    records = sorted(records, key=lambda r: r.rank)
    step = records[0].step
    problem = _disagreement(records)
    if problem is not None:
        raise StepAgreementError(f"step {step}: {problem}; {_NOTHING_MOVED}")
    rejected = [r for r in records if r.rejected]
    if rejected:
        said = "; ".join(f"rank {r.rank}: {r.rejected}" for r in rejected)
        raise StepRejectedError(f"step {step} was rejected before any activation moved ({said}); {_NOTHING_MOVED}")
    by_rank = {r.rank: r for r in records}
    first, last = by_rank[first_rank], by_rank[last_rank]
    if last.target_rows >= 0 and last.target_rows != first.rows:
        raise StepRejectedError(
            f"step {step} was rejected before any activation moved: the target on rank {last_rank} has "
            f"{last.target_rows} rows but the batch on rank {first_rank} has {first.rows}; {_NOTHING_MOVED}"
        )
    if last.target_rows >= 0 and last.target_sizes != first.sizes:
        raise StepRejectedError(
            f"step {step} was rejected before any activation moved: the target's microbatches on rank "
            f"{last_rank} have other rows than the inputs' microbatches on rank {first_rank} ({first.rows} rows "
            f"in all on both): microbatch k of the target must have the rows of microbatch k of the inputs; "
            f"{_NOTHING_MOVED}"
        )
    # Caches differ when a step failed on some ranks after others had committed
    # its layouts: then every rank exchanges them again (a known step on one
    # side and a discovery step on the other would deadlock).
    kwargs = tuple((r.rank, r.microbatches) for r in records if r.rank != first_rank and r.microbatches != ())
    signatures = _with_rank_kwargs(first.microbatches, kwargs)
    return Agreement(step, _with_autocast(signatures, tuple(r.autocast for r in records)),
                     len({r.layouts for r in records}) > 1, tuple(r.skips for r in records), first.rows, first.sizes)


@functools.lru_cache(maxsize=64)
def _with_rank_kwargs(microbatches: Optional[tuple[int, ...]],
                      kwargs: tuple[tuple[int, Optional[tuple[int, ...]]], ...]) -> Optional[tuple[int, ...]]:
    """The signatures the layouts are cached by: stage 0's, salted per microbatch by every other rank's keyword
    arguments.

    [Note: keyword arguments salt the signatures]
    Every stage gets its rank's own keyword arguments ([Note: keyword
    arguments per rank] in ``runtime/executor.py``), so a middle stage's
    output shapes may follow from a mask or a config given on its rank alone
    (``width=64``), which stage 0's signature knows nothing of. Each such
    rank sends its keyword arguments' signature per microbatch in its own
    record, and microbatch k's signature becomes stage 0's joined with each
    of theirs (with the rank's number): a new value on any rank is a new
    signature, so its layouts are exchanged again instead of a known step
    sending under the old ones (which a sender would refuse, naming the
    layout, but a step too late). Unchanged where no other rank has keyword
    arguments, so those steps keep their layouts; None (not cached) when any
    rank had too many distinct ones to describe.
    """
    if not microbatches or not kwargs:
        return microbatches
    if any(sigs is None or len(sigs) != len(microbatches) for _, sigs in kwargs):
        return None
    return tuple(stable_hash(repr((sig, tuple((rank, sigs[k]) for rank, sigs in kwargs))))
                 for k, sig in enumerate(microbatches))


def autocast_digest(device: torch.device) -> int:
    """What this rank's stages compute in beyond their inputs: 0 with autocast off, else its dtype's digest.

    A stage's output dtype follows from its inputs *and* from autocast
    (``torch.autocast("cpu", torch.bfloat16)`` makes a Linear's output
    bfloat16), so the step record carries it and a change is a new layout.
    """
    kind = device.type
    if not torch.is_autocast_enabled(kind):
        return 0
    return _autocast_words(kind, torch.get_autocast_dtype(kind))


@functools.lru_cache(maxsize=16)
def _autocast_words(kind: str, dtype: torch.dtype) -> int:
    return stable_hash(repr(("autocast", kind, dtype))) or 1


@functools.lru_cache(maxsize=64)
def _with_autocast(microbatches: Optional[tuple[int, ...]], autocast: tuple[int, ...]) -> Optional[tuple[int, ...]]:
    """The microbatch signatures the layouts are cached by: the first rank's, salted by every rank's autocast.

    Layouts are cached by signature; a step under autocast moves other dtypes
    than the same inputs without it, so its signatures are other ones (a new
    autocast state is learnt as any new shape is). Unchanged with autocast off
    everywhere.
    """
    if not microbatches or not any(autocast):
        return microbatches
    return tuple(stable_hash(repr((sig, autocast))) for sig in microbatches)


class StepAgreement:
    """Runs the exchange of :class:`StepRecord` between the pipeline's ranks over ``group``, bounded by ``timeout``.

    ``ranks`` are the pipeline ranks' global ranks, in pipeline-rank order
    (default: ``group``'s). ``group`` may be another group over the same
    processes (a Gloo twin of an NCCL pipeline group, so records stay in host
    memory).
    """

    def __init__(self, group: Optional[dist.ProcessGroup], rank: int, num_ranks: int, device: torch.device,
                 timeout: float, ranks: Optional[Sequence[int]] = None) -> None:
        self.group, self.rank, self.num_ranks, self.device = group, rank, num_ranks, device
        self.timeout = timeout
        if ranks is None:
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(num_ranks))
        self._ranks = list(ranks)
        self._signatures: dict[tuple, int] = {}  # keys hold plain values and object ids only: no user object
        self._objects = _ObjectIds()
        #: signature -> the arguments in it that count by value (objects), in words; kept as long as the key
        self._by_value: dict[int, str] = {}
        #: exchanges of failed steps this rank did not wait for (``PendingExchange.abandon``), oldest first
        self._owed: list["PendingExchange"] = []

    def _global(self, pipeline_rank: int) -> int:
        return self._ranks[pipeline_rank]

    def microbatch_signatures(self, args_chunks: Sequence[Sequence[Any]], kwargs_chunks: Sequence[dict]) -> list[int]:
        """Each microbatch's 62-bit signature: the hash of its pytree structure, tensor shapes and dtypes (a
        DTensor's placements and mesh too: [Note: a DTensor's signature]), the
        values of its plain non-tensor leaves (numbers, strings, booleans, None), and for any other leaf the
        id its value has on this rank (``_ObjectIds``).

        A stage's messages for a microbatch have layouts that follow from
        these (that is what a stage must guarantee: shapes from inputs, not
        from tensor data), so layouts are cached by them, wherever the
        microbatch comes in a step. Stage 0's rank computes them over its
        inputs, any other rank over its own keyword arguments (which salt
        stage 0's: [Note: keyword arguments salt the signatures]); every rank
        learns them all from the records. Cached per distinct key.
        """
        out = []
        for args, kwargs in zip(args_chunks, kwargs_chunks):
            fresh = self._objects.fresh
            key = _flat_key(args, kwargs)
            keys: tuple = ()
            if key is None:  # nested containers: the general (slower) pytree walk
                leaves, spec = pytree.tree_flatten((tuple(args), kwargs))
                keys = tuple(_leaf_key(x, self._objects) for x in leaves)
                key = (spec, keys)
            sig = self._signatures.get(key)
            if sig is None:
                sig = stable_hash(repr(key))
                if self._objects.fresh != fresh:  # a key no later step can meet: not worth a cache entry
                    out.append(sig)
                    continue
                if len(self._signatures) >= _CACHE_LIMIT:
                    self._signatures.clear()
                    self._by_value.clear()
                self._signatures[key] = sig
                if any(len(k) == 4 and k[2] == "value" for k in keys):  # say which, should a send not match
                    paths = [p for p, _ in pytree.tree_flatten_with_path((tuple(args), kwargs))[0]]
                    self._by_value[sig] = ", ".join(f"{_argument(p)}: {k[1]}" for p, k in zip(paths, keys)
                                                    if len(k) == 4 and k[2] == "value")
            out.append(sig)
        return out

    def counted_by_value(self, signature: Any) -> str:
        """What to tell a user whose stage sent other shapes under a signature its object arguments decided."""
        said = self._by_value.get(signature)
        if not said:
            return ""
        return (f"This microbatch's object arguments count by value (== and hash): {said}. Each is equal to the "
                "one the layouts were exchanged with, yet the stage's output shapes differ: every field that "
                "decides shapes must take part in its class's __eq__ and __hash__")

    def post(self, mine: StepRecord) -> "PendingExchange":
        """Start the exchange of ``mine`` now; its ``records()`` waits for the peers' records.

        Posting early and waiting late takes the exchange off the critical
        path: the executor waits only before the step's first message, so the
        records travel while this rank runs the step's leading compute.
        """
        if self.num_ranks == 1:
            return PendingExchange(self, mine, [], {}, [])
        peers = [r for r in range(self.num_ranks) if r != self.rank]
        out = torch.tensor(mine.encode(), dtype=torch.int64, device=self.device)
        bufs = {r: torch.zeros(_WORDS, dtype=torch.int64, device=self.device) for r in peers}
        # One batch (torch's batch_isend_irecv): NCCL runs a pair's sends and receives on one stream,
        # so separately issued "everyone receives, then sends" would deadlock there.
        ops = [dist.P2POp(dist.irecv, bufs[r], self._global(r), self.group, AGREEMENT_TAG) for r in peers]
        ops += [dist.P2POp(dist.isend, out, self._global(r), self.group, AGREEMENT_TAG) for r in peers]
        works = self._start(lambda: dist.batch_isend_irecv(ops), ", ".join(map(str, peers)), mine.step)
        return PendingExchange(self, mine, peers, bufs, works + [out])

    def _what(self, peer: Any, step: int, doing: str) -> str:
        return f"rank {self.rank} {doing} the step record of step {step} with rank {peer}"

    def _start(self, post: Any, peer: Any, step: int) -> Any:
        try:
            return post()
        except RuntimeError as exc:
            raise ChannelError(f"{self._what(peer, step, 'exchanging')}: {exc}{_CLOSED}") from exc

    def _wait(self, work: Any, peer: int, step: int, doing: str) -> None:
        """Wait as the channels do (bounded, ended by Ctrl-C: ``wait_work``), with what to check in the error."""
        what = self._what(peer, step, doing)
        try:
            _C.wait_work(work, _ms(self.timeout), what)
        except ChannelTimeout as exc:
            raise ChannelTimeout(
                f"{exc} (is rank {peer} calling step()/eval() on the same schedule? After a Gloo timeout the group "
                "is closed: create a new process group)"
            ) from None
        except ChannelError as exc:
            raise ChannelError(f"{exc} (rank {peer} failed or is gone){_CLOSED}") from None


class PendingExchange:
    """An exchange of step records in flight (see ``StepAgreement.post``)."""

    def __init__(self, owner: StepAgreement, mine: StepRecord, peers: list[int], bufs: dict[int, torch.Tensor],
                 works: list) -> None:
        self._owner, self.mine, self._peers, self._bufs = owner, mine, peers, bufs
        self._works = works[:-1] if works else []
        self._keep = works[-1:]  # the sent record's buffer lives until the send completed
        self._records: Optional[list[StepRecord]] = None

    def records(self) -> list[StepRecord]:
        """Every rank's record, ``mine`` first; waits (bounded by the timeout) on the first call.

        The exchanges of earlier failed steps this rank did not wait for are
        waited first: the peers' records arrive in step order.
        """
        if self._records is None:
            owed, self._owner._owed = self._owner._owed, []
            for earlier in owed:
                if earlier is not self:
                    earlier._settle()
            self._settle()
        return self._records  # type: ignore[return-value]

    def _settle(self) -> None:
        if self._records is None:
            peers = self._peers
            doing = ["receiving"] * len(peers) + ["sending"] * len(peers)
            for work, peer, what in zip(self._works, peers + peers, doing):
                self._owner._wait(work, peer, self.mine.step, what)
            self._records = [self.mine] + [StepRecord.decode(self._bufs[r].tolist(), r) for r in peers]
            self._works, self._keep = [], []

    def abandon(self) -> None:
        """This rank's step failed before it needed the records: wait for them with the next step's, not now.

        A rank that rejects its own inputs, or whose step fails before its
        first message, raises its own error at once, even when a peer never
        comes (it exited, or calls something else): its record, already
        posted, tells each peer in that peer's own call of the step. The
        exchange stays owed (its buffers alive until it completes) and is
        settled, in order, before the next step's records are read.
        """
        if self._records is None and self not in self._owner._owed:
            self._owner._owed.append(self)


#: non-tensor leaves that count by value in a step signature: a stage's output shapes may depend on them
#: (``width=64``, ``causal=True``, ``mode="train"``), so a new value is a new signature (its layouts exchanged again)
_BY_VALUE = (bool, int, float, str, bytes, type(None))
_FLAT = (torch.Tensor, *_BY_VALUE)  # leaves keyed without a pytree walk


def _flat_key(args: Sequence[Any], kwargs: dict) -> Optional[tuple]:
    """A microbatch's key when its arguments are all leaves (tensors, plain values): no pytree walk.

    The common case (``(input_ids,)``, ``{"attention_mask": ...}``) is keyed
    in a few microseconds per microbatch; None sends anything nested to the
    general walk. A microbatch always takes the same path, so its key and
    signature are stable.
    """
    keys = []
    for x in args:  # a loop, not all(...) over a chain: this runs per microbatch per step
        if not isinstance(x, _FLAT):
            return None
        keys.append(_leaf_key(x))
    if kwargs and not all(isinstance(x, _FLAT) for x in kwargs.values()):
        return None
    return ("flat", tuple(keys), tuple((name, _leaf_key(x)) for name, x in kwargs.items()) if kwargs else ())


def _argument(path: tuple) -> str:
    """A leaf's place in ``(args, kwargs)`` as the user wrote it: ``cfg``, ``args[1]``, ``cfg.layers[0]``."""
    head, rest = path[0].idx, path[1:]
    if head == 1 and rest:  # kwargs
        name, rest = str(rest[0].key), rest[1:]
    else:
        name, rest = (f"args[{rest[0].idx}]", rest[1:]) if rest else ("args", rest)
    return name + "".join(str(p) for p in rest)


def _leaf_key(x: Any, objects: Optional["_ObjectIds"] = None) -> Any:
    if isinstance(x, torch.Tensor):
        if type(x) is not torch.Tensor and _is_dtensor(x):
            return _dtensor_key(x)
        return (tuple(x.shape), x.dtype)
    if isinstance(x, _BY_VALUE):
        return (type(x).__name__, x)
    assert objects is not None, "objects are keyed by the pytree walk, which passes the ids"
    return objects.key(x)


def _dtensor_key(x: Any) -> tuple:
    """A DTensor's key: its global shape and dtype, its placements and its mesh (device type, ranks, dim names).

    [Note: a DTensor's signature]
    What travels between stages is a DTensor's local shard ([Note: DTensors
    between stages] in ``runtime/dtensor_wire.py``), whose shape follows from
    the global shape, the placements and the mesh. Keyed by the global shape
    alone, a step with the input of an earlier one on other placements
    (``Shard(1)``, then ``Replicate``) ran as a known step under the earlier
    layouts, and its first send failed (the sender checks its layout: never a
    misread, but a correct loop stopped). Placements compare by value
    (``Shard(dim=1)``, ``Partial(sum)``); the mesh by what decides a local
    shape and a rebuild, not by object: two meshes of the same ranks and
    names share layouts.
    """
    mesh = x.device_mesh
    return (tuple(x.shape), x.dtype, tuple(repr(p) for p in x.placements),
            (mesh.device_type, tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()),
             tuple(mesh.mesh_dim_names or ())))


class _ObjectIds:
    """Any other leaf (a config object, an enum, a frozen dataclass): an id per value, holding no reference.

    Such an argument may decide a stage's output shapes (``cfg.width``), so
    two values must not share cached layouts, and the signature that travels
    must be a digest: its ``repr`` cannot be trusted to show the deciding
    field (``field(repr=False)``, a ``__repr__`` of its own, object's default
    repr of an object changed in place). An enum member counts by its name
    (a singleton of its class). Any other object that compares by value
    (hashable, its class defines ``__eq__``) gets an id from a counter on
    stage 0's rank: an object equal (``==``, same hash) to one that has an id
    gets that id, any other a new one; ids are never reused. The table holds
    its objects weakly: an argument (and whatever it holds, a new tensor each
    step) is freed when the user drops it, and with it its entry, so an equal
    value made after the last one is gone gets a new id (its layouts are
    exchanged again: correct, one discovery step). Python's rule that a
    hashable object's value does not change makes this exact; one changed in
    place that changes its hash with it (the usual ``__hash__`` over the
    fields) is looked up as its new value; one whose hash does not follow
    keeps its id, and a send that then does not match the layouts names it
    (``counted_by_value``).

    An object that compares by identity, cannot be hashed or compared (a
    frozen dataclass holding a list or a tensor), or cannot be weakly
    referenced says nothing a later step can trust (it may have been changed
    in place): it gets a fresh id every step, so the step exchanges its
    layouts again, correct whatever it decides.
    """

    _ids = itertools.count(1)  # one counter per process: no two tables (schedules) ever share an id

    def __init__(self) -> None:
        #: hash -> [(weak reference to the first object of a value, its id)]; the hash is taken at lookup
        #: (a weakref caches its referent's hash, which an object changed in place no longer has)
        self._table: dict[int, list[tuple[weakref.ref, int]]] = {}
        self.fresh = 0  # how many fresh ids were given: a key holding one is not cached (microbatch_signatures)

    def key(self, x: Any) -> tuple:
        cls = type(x)
        if isinstance(x, enum.Enum):  # a member is a singleton of its class: its name is its value
            return (cls.__module__, cls.__qualname__, "member", x.name)
        if cls.__eq__ is not object.__eq__ and cls.__hash__ is not None:
            try:
                return (cls.__module__, cls.__qualname__, "value", self._id(x))
            except Exception:  # noqa: BLE001 - unhashable value, no weak reference, an __eq__ that raises
                pass
        self.fresh += 1
        return (cls.__module__, cls.__qualname__, "fresh", next(self._ids))

    def _id(self, x: Any) -> int:
        h = hash(x)
        for ref, found in list(self._table.get(h, ())):  # a copy: a collection may drop an entry meanwhile
            other = ref()
            if other is not None and (other is x or bool(other == x)):
                return found
        ref = weakref.ref(x, functools.partial(self._drop, h))
        found = next(self._ids)
        self._table.setdefault(h, []).append((ref, found))
        return found

    def _drop(self, h: int, ref: weakref.ref) -> None:
        """The object behind ``ref`` is gone: forget its value."""
        bucket = [entry for entry in self._table.get(h, ()) if entry[0] is not ref]
        if bucket:
            self._table[h] = bucket
        else:
            self._table.pop(h, None)
