"""Names a package resolves on first use (PEP 562), so importing it stays cheap.

``import pipeline_ext.schedules`` must not load torch or the compiled core,
and ``pipeline_ext.training`` must not load torch.distributed.checkpoint until
a checkpoint is saved: each package lists its names and the module each lives
in, and this resolves and caches them.
"""
from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Optional


def lazy_names(package: str, names: dict[str, str], public: list[str],
               modules: Optional[dict[str, str]] = None) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``.

    ``names[n]`` is the module attribute ``n`` is read from; ``modules[n]`` a
    module that ``n`` names itself. ``public`` is what ``dir()`` lists (the
    package's ``__all__``); every name resolves, listed or not.
    """
    modules = modules or {}

    def getattr_(name: str) -> Any:
        if name in names:
            value = getattr(importlib.import_module(names[name]), name)
        elif name in modules:
            value = importlib.import_module(modules[name])
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    def dir_() -> list[str]:
        return list(public)

    return getattr_, dir_
