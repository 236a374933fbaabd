"""Which step a message belongs to, across processes, and hashes every process computes alike.

[Note: step numbering]
Step numbers belong to the process group, not to a schedule (:class:`GroupSteps`):
every schedule built on a group (a training and an eval schedule, a schedule
built anew after a failure) draws its steps from one counter, so two steps on a
group never share a number, and every rank draws the same numbers as long as
every rank calls the same steps. On the wire:

- Shared memory stamps every message with the full step number and drops, at
  the start of each step, whatever an earlier step left in the inbox (a failed
  step's sends nobody received), and anything of an earlier step that arrives
  later: a message is only ever taken by the step that sent it
  (``ShmChannel::begin_step``).
- Gloo completes a send only into a posted receive, and a send nobody receives
  times out on its sender, which closes the connection: a failed step's message
  is never delivered to another step. The step bits of the tag keep steps
  apart besides.
- NCCL matches by order on one communicator per direction (``comm/groups.py``).

The step number (modulo 1024) is also part of every message's tag
(``runtime/tags.py``, [Note: message tags]).
"""
from __future__ import annotations

import hashlib
import itertools
import weakref
from typing import Any

__all__ = ["GroupSteps", "stable_hash"]


def stable_hash(text: str) -> int:
    """62 bits of blake2b over ``text``: the same in every process (unlike ``hash``), fits an int64 word.

    What ranks compare to know they mean the same thing: step signatures,
    schedules, plan caches.
    """
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


class GroupSteps:
    """The step numbers of one process group in this process: every schedule on the group draws from it.

    Keyed by the group object (weakly): a group destroyed and made again, even
    under the same name, starts a new count, as it gets a new transport.
    """

    _counters: "weakref.WeakKeyDictionary[Any, itertools.count]" = weakref.WeakKeyDictionary()

    @classmethod
    def next(cls, group: Any) -> int:
        """The number of the next step on ``group`` (0, 1, 2, ...; every call, failed steps included)."""
        counter = cls._counters.get(group)
        if counter is None:
            counter = cls._counters[group] = itertools.count()
        return next(counter)
