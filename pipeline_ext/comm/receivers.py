"""Every stage's receiving side, exchanged once per schedule: what a sender checks a DTensor output against.

A stage's receiving side (``dtensor_wire.receiving_side``: the meshes it
rebuilds DTensor inputs on, whether it has a ``get_mesh`` callback, its
declared ``input_args``) is fixed when its schedule is built. Each rank posts
its stages' sides to every peer then (Gloo point to point on the step records'
host group, one fixed-size JSON message per peer, so every wait is bounded),
and the first sender that needs the next stage's side waits for them, once
(``side``). A rank that never sends a DTensor never waits. Nothing travels per
step. See [Note: DTensors between stages] in runtime/dtensor_wire.py.
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
    """This rank's stages' receiving sides, posted to every peer; every stage's, once gathered.

    ``group``: the group the step records travel on (CPU tensors), ``rank``/``num_ranks``: this rank's place
    in it; ``mine``: ``{stage: receiving_side(...)}`` of this rank's stages. A side too large to post (an
    ``input_args`` of thousands of tensors) goes without its declared inputs: its senders then check the
    meshes only, and the receiver still refuses the rest itself.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], rank: int, num_ranks: int, mine: dict[int, dict],
                 timeout: float) -> None:
        self.rank, self.timeout = rank, timeout
        self._sides: dict[int, Optional[dict]] = dict(mine)
        self._works: list[tuple[int, Any]] = []
        self._failed: Optional[tuple[int, Exception]] = None
        self._inbox: dict[int, torch.Tensor] = {}
        if num_ranks == 1:
            return
        data = _encoded(mine)
        self._out = torch.zeros(_BYTES, dtype=torch.uint8)
        self._out[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        wire = group if group is not None else dist.group.WORLD
        self._inbox = {p: torch.zeros(_BYTES, dtype=torch.uint8) for p in range(num_ranks) if p != rank}
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
            raise ChannelTimeout(f"rank {self.rank}: rank {peer}'s description of its stages' inputs (posted when "
                                 f"it builds its schedule) did not come within {self.timeout:g} s (has it built "
                                 f"its schedule?): {exc}")
        for buf in self._inbox.values():
            for stage, side in json.loads(bytes(buf.numpy()).rstrip(b"\0").decode()).items():
                self._sides[int(stage)] = side
        self._inbox, self._works = {}, []


def _encoded(mine: dict[int, dict]) -> bytes:
    data = json.dumps({str(s): side for s, side in mine.items()}).encode()
    if len(data) > _BYTES:
        data = json.dumps({str(s): {**side, "declared": None} for s, side in mine.items()}).encode()
    if len(data) > _BYTES:  # meshes too: the senders check nothing, the receivers refuse as before
        data = json.dumps({str(s): None for s in mine}).encode()
    return data
