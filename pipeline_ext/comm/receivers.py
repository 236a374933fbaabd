"""Every stage's receiving side, exchanged once per schedule: what a sender checks a DTensor output against.

A stage's receiving side (``dtensor_wire.receiving_side``: the meshes it
rebuilds DTensor inputs on, whether it has a ``get_mesh`` callback, its
declared ``input_args``) is fixed when its schedule is built. Each rank posts
its stages' sides to every peer at its schedule's first step (``post``, from
``Session.begin``, before the step's inputs are checked: a rank that rejects
its step has posted too), Gloo point to point on the step records' host group,
one fixed-size JSON message per peer, so every wait is bounded. The first
sender that needs the next stage's side waits for them, once (``side``); a
rank that never sends a DTensor never waits. Nothing travels in later steps.

Posted at the first step, not when the schedule is built: a schedule built on
one rank only (to dump its order as CSV) never steps, so never posts. Each
message carries the step number and schedule key it was posted in; sides
posted for another step or schedule (ranks out of step, running different
schedules: the step agreement names that) are not used, so they can never
refuse a message by mistake. See [Note: DTensors between stages] in
runtime/dtensor_wire.py.
"""
from __future__ import annotations

import json
from typing import Any, Optional

import torch
import torch.distributed as dist

from pipeline_ext.runtime._ext import _C
from pipeline_ext.runtime.channel import ChannelError, ChannelTimeout, _ms

__all__ = ["RECEIVERS_TAG", "ReceiverSides"]

#: below the step records' (2**31 - 1) and the transport setup's tags (2**31 - 2, 2**31 - 3)
RECEIVERS_TAG = 2**31 - 4
_BYTES = 8192


class ReceiverSides:
    """This rank's stages' receiving sides, posted to every peer at the first step; every stage's, once gathered.

    ``group``: the group the step records travel on (CPU tensors), ``rank``/``num_ranks``: this rank's place
    in it; ``mine``: ``{stage: receiving_side(...)}`` of this rank's stages. A side too large to post (an
    ``input_args`` of thousands of tensors) goes without its declared inputs: its senders then check the
    meshes only, and the receiver still refuses the rest itself.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], rank: int, num_ranks: int, mine: dict[int, dict],
                 timeout: float) -> None:
        self.group, self.rank, self.num_ranks, self.timeout = group, rank, num_ranks, timeout
        self._mine = mine
        self._sides: dict[int, Optional[dict]] = dict(mine)
        self._posted: Optional[tuple[int, int]] = None  # (step, schedule key) of the post
        self._works: list[tuple[int, Any]] = []
        self._failed: Optional[tuple[int, Exception]] = None
        self._inbox: dict[int, torch.Tensor] = {}

    def post(self, step: int, schedule_key: int) -> None:
        """Send this rank's sides to every peer and post the receives of theirs; once (later calls do nothing)."""
        if self._posted is not None:
            return
        self._posted = (step, schedule_key)
        if self.num_ranks == 1:
            return
        data = _encoded(step, schedule_key, self._mine)
        self._out = torch.zeros(_BYTES, dtype=torch.uint8)
        self._out[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        wire = self.group if self.group is not None else dist.group.WORLD
        self._inbox = {p: torch.zeros(_BYTES, dtype=torch.uint8) for p in range(self.num_ranks) if p != self.rank}
        for peer, buf in self._inbox.items():
            try:
                self._works += [(peer, wire.recv([buf], peer, RECEIVERS_TAG)),
                                (peer, wire.send([self._out], peer, RECEIVERS_TAG))]
            except Exception as exc:  # noqa: BLE001 - a peer already gone: said when a side is asked for
                self._failed = (peer, exc)
                break

    def side(self, stage: int) -> Optional[dict]:
        """Stage ``stage``'s receiving side (None: not known); the first call waits for every peer's."""
        if self._inbox:
            self._gather()
        return self._sides.get(stage)

    def _gather(self) -> None:
        for peer, work in self._works:
            if self._failed is not None:
                break
            try:
                _C.wait_work(work, _ms(self.timeout), f"rank {self.rank}: waiting for rank {peer}'s stages' "
                                                      "receiving sides")
            except ChannelError as exc:
                self._failed = (peer, exc)
        if self._failed is not None:
            peer, exc = self._failed
            raise ChannelTimeout(f"rank {self.rank}: rank {peer}'s description of its stages' inputs (posted at its "
                                 f"schedule's first step) did not come within {self.timeout:g} s (is it running "
                                 f"the same step?): {exc}")
        for buf in self._inbox.values():
            got = json.loads(bytes(buf.numpy()).rstrip(b"\0").decode())
            if (got.get("step"), got.get("schedule")) != self._posted:
                continue  # another step's or schedule's: not this one's to check against
            for stage, side in got["sides"].items():
                self._sides[int(stage)] = side
        self._inbox, self._works = {}, []


def _encoded(step: int, schedule_key: int, mine: dict[int, dict]) -> bytes:
    def text(sides: dict) -> bytes:
        return json.dumps({"step": step, "schedule": schedule_key, "sides": sides}).encode()

    data = text({str(s): side for s, side in mine.items()})
    if len(data) > _BYTES:
        data = text({str(s): {**side, "declared": None} for s, side in mine.items()})
    if len(data) > _BYTES:  # meshes too: the senders check nothing, the receivers refuse as before
        data = text({str(s): None for s in mine})
    return data
