"""Imports put off until they are needed, so that importing pipeline_ext (and starting a rank) stays cheap.

``import pipeline_ext.schedules`` must not load torch or the compiled core,
and ``pipeline_ext.training`` must not load torch.distributed.checkpoint until
a checkpoint is saved: each package lists its names and the module each lives
in, and ``lazy_names`` resolves and caches them.

``exports`` reads a package's table of names from its modules' ``__all__``
without importing them; ``lazy_names`` also lends names from a module that is
costly to import (torch's pipelining, for the twins of its modules) and
refuses, with the reason, the names torch has and pipeline_ext does not.

``module_aliases`` gives a module a second name: ``import
pipeline_ext.microbatch`` gives the module at its home itself (the same
object, functions and state).

``when_imported`` runs a function once a module of someone else's is
imported, or at once if it is already: pipeline_ext's schedule classes
register as subclasses of ``torch.distributed.pipelining``'s base class when
(and only if) a program loads torch's pipelining package, which costs a
rank about a second of start-up (dynamo, DTensor) that a program using only
pipeline_ext would otherwise pay.
"""
from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import pathlib
import re
import sys
import threading
from types import ModuleType
from typing import Any, Callable, Optional, Sequence


class NotProvidedError(ImportError):
    """A name torch's pipelining module has that pipeline_ext does not provide, with the reason.

    An ``ImportError``, so that ``from pipeline_ext.pipelining.schedules import
    _batch_p2p`` says why (an ``AttributeError`` raised by a module's
    ``__getattr__`` reaches the importer as a bare "cannot import name").
    """


def lazy_names(package: str, names: dict[str, str], public: Optional[list[str]] = None,
               modules: Optional[dict[str, str]] = None, search: Sequence[str] = (),
               gaps: Optional[dict[str, str]] = None) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package`` (a package or a module).

    ``names[n]`` is the module attribute ``n`` is read from; ``modules[n]`` a
    module that ``n`` names itself; ``search``: packages whose ``__all__`` is
    looked through, in order, for any other name (each imported only when the
    name is not found in the ones before it); ``gaps[n]``: why ``n`` is not
    provided, raised as ``NotProvidedError``. ``public`` is what ``dir()``
    lists (a package's ``__all__``); None: the module's own globals and the
    lazy names. Every name resolves, listed or not.
    """
    modules = modules or {}
    gaps = gaps or {}

    def getattr_(name: str) -> Any:
        if name in names:
            value = getattr(importlib.import_module(names[name]), name)
        elif name in modules:
            value = importlib.import_module(modules[name])
        elif name in gaps:
            raise NotProvidedError(f"{package} does not provide {name}: {gaps[name]}", name=package)
        else:
            # not a module of the package's own (``from pipeline_ext import _C`` asks here first): the import
            # system imports that one when this raises, and the search must not import subpackages meanwhile
            own = search and importlib.machinery.PathFinder.find_spec(f"{package}.{name}",
                                                                      sys.modules[package].__path__)
            for home in () if name.startswith("__") or own else search:
                found = importlib.import_module(home)
                if name in found.__all__:
                    value = getattr(found, name)
                    break
            else:
                raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    def dir_() -> list[str]:
        if public is not None:
            return list(public)
        return sorted({*vars(sys.modules[package]), *names, *modules})

    return getattr_, dir_


def exports(package: str, modules: Sequence[str]) -> dict[str, str]:
    """``{name: module}`` for every name in the ``__all__`` of each of ``package``'s ``modules``, none imported.

    So a package's table of names is its modules' ``__all__`` and nothing
    kept by hand: each module's ``__all__`` is read from its source (a literal
    list or tuple of strings at the start of a line), which costs well under a
    millisecond where importing the module would load torch. A name listed by
    two modules is an error, as is a module without such an ``__all__``.
    """
    folder = pathlib.Path(sys.modules[package].__file__).parent
    table: dict[str, str] = {}
    for module in modules:
        path = folder / f"{module}.py"
        source = path.read_text()
        found = re.search(r"^__all__\s*=\s*[\[(]", source, re.M)
        names = None
        if found is not None:
            opening, closing = found.end() - 1, ("]" if source[found.end() - 1] == "[" else ")")
            end = source.find(closing, opening)
            while names is None and end != -1:  # the first closing bracket that ends a literal (comments allowed)
                with contextlib.suppress(SyntaxError, ValueError):
                    names = ast.literal_eval(source[opening:end + 1])
                end = source.find(closing, end + 1)
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise ImportError(f"{path}: __all__ must be a literal list of names ({package} reads it unimported)")
        for name in names:
            if name in table:
                raise ImportError(f"{package}: {name!r} is in the __all__ of both {table[name]} and {module}")
            table[name] = f"{package}.{module}"
    return table


class _Loader(importlib.abc.Loader):
    """A module's own loader, then the functions waiting for that module."""

    def __init__(self, loader: Any, after: list[Callable[[ModuleType], None]]):
        self._loader, self._after = loader, after

    def create_module(self, spec: Any) -> Optional[ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        module.__loader__ = module.__spec__.loader = self._loader  # the module keeps its own loader, not this one
        for fn in self._after:
            fn(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ...: the module's own loader answers
        return getattr(self._loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``; finds nothing itself, only wraps the loader of a module someone waits for."""

    def __init__(self) -> None:
        self.waiting: dict[str, list[Callable[[ModuleType], None]]] = {}
        self.lock = threading.Lock()

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        with self.lock:
            after = self.waiting.pop(name, None)
        if after is None:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self or not hasattr(finder, "find_spec") else finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, after)
                return spec
        return None


_after_import = _AfterImport()


def when_imported(module: str, fn: Callable[[ModuleType], None]) -> None:
    """Call ``fn(module)`` once ``module`` is imported: now if it is already, else right after its import runs."""
    loaded = sys.modules.get(module)
    if loaded is not None:
        fn(loaded)
        return
    with _after_import.lock:
        _after_import.waiting.setdefault(module, []).append(fn)
        if _after_import not in sys.meta_path:
            sys.meta_path.insert(0, _after_import)


class _Alias(importlib.abc.Loader):
    """Loads a second name of a module as the module itself (``module_aliases``)."""

    def __init__(self, home: str) -> None:
        self.home = home
        self._spec: Any = None

    def create_module(self, spec: Any) -> ModuleType:
        module = importlib.import_module(self.home)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system set the alias's spec on the module: it keeps its own (reload, pickling, -m)
        module.__spec__ = self._spec


class _Aliases(importlib.abc.MetaPathFinder):
    """On ``sys.meta_path``: finds only the names it was given, each as the module at its home."""

    def __init__(self) -> None:
        self.homes: dict[str, str] = {}

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        home = self.homes.get(name)
        return None if home is None else importlib.util.spec_from_loader(name, _Alias(home))


_aliases = _Aliases()


def module_aliases(aliases: dict[str, str]) -> None:
    """Make each module name in ``aliases`` import the module at its home, the very same object.

    ``{"pipeline_ext.microbatch": "pipeline_ext.runtime.microbatch"}``: ``import
    pipeline_ext.microbatch`` and ``from pipeline_ext.microbatch import X`` give
    ``pipeline_ext.runtime.microbatch`` and its ``X`` (one module, its functions
    and state), registered under both names in ``sys.modules``. Nothing is
    imported until an alias is.
    """
    _aliases.homes.update(aliases)
    if _aliases not in sys.meta_path:
        sys.meta_path.insert(0, _aliases)  # before the path finder: no alias is ever a file
