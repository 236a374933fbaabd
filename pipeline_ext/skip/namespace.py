"""Namespaces: the same skip name used twice in one model, kept apart.

A skip is matched by ``(namespace, name)``. Reusing a skippable block (two
U-Net levels built from one class) needs one namespace per use, or both uses
would stash under the same key (``Skippable.isolate``).

Why a namespace can be given a name: in a multi-process pipeline every rank
builds its own part of the model, and the ranks match skips by key. A random
id (torchgpipe's, and ours without a name) differs from process to process, so
a skip that crosses processes needs ``Namespace("encoder1")``; the route
check says so when it meets an unmatched random one.
"""
from __future__ import annotations

import uuid
from functools import total_ordering
from typing import Any, Optional

__all__ = ["Namespace", "namespace_id"]


@total_ordering
class Namespace:
    """A namespace for skip names. Equal namespaces are the same namespace (copies compare equal)."""

    __slots__ = ("id", "named")

    def __init__(self, name: Optional[str] = None) -> None:
        if name is not None and (not isinstance(name, str) or not name):
            raise TypeError(f"a Namespace name must be a non-empty str, got {name!r}")
        self.named = name is not None
        self.id: str = name if name is not None else uuid.uuid4().hex

    def __repr__(self) -> str:
        return f"<Namespace {self.id!r}>"

    def __hash__(self) -> int:
        return hash(self.id)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Namespace) and other.id == self.id

    def __lt__(self, other: Any) -> bool:
        if not isinstance(other, Namespace):
            return NotImplemented
        return self.id < other.id

    def __copy__(self) -> "Namespace":
        twin = Namespace.__new__(Namespace)
        twin.id, twin.named = self.id, self.named
        return twin

    def __deepcopy__(self, memo: dict) -> "Namespace":
        return self.__copy__()


def namespace_id(ns: Optional[Namespace]) -> Optional[str]:
    """What travels between processes for a namespace: its id (None: the default namespace)."""
    return None if ns is None else ns.id
