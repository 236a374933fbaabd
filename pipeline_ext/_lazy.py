"""Imports put off until they are needed, so that importing pipeline_ext (and starting a rank) stays cheap.

``import pipeline_ext.schedules`` must not load torch or the compiled core,
and ``pipeline_ext.training`` must not load torch.distributed.checkpoint until
a checkpoint is saved: each package lists its names and the module each lives
in, and ``lazy_names`` resolves and caches them.

``moved_modules`` keeps a module path that moved importable: ``import
pipeline_ext.microbatch`` gives the module at its new home itself (the same
object, functions and state), warning first where the old path is deprecated.

``when_imported`` runs a function once a module of someone else's is
imported, or at once if it is already: pipeline_ext's schedule classes
register as subclasses of ``torch.distributed.pipelining``'s base class when
(and only if) a program loads torch's pipelining package, which costs a
rank about a second of start-up (dynamo, DTensor) that a program using only
pipeline_ext would otherwise pay.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import threading
import warnings
from types import ModuleType
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


class _Moved(importlib.abc.Loader):
    """Loads an old module path as the module at its new home (``moved_modules``)."""

    def __init__(self, new: str, warning: Optional[str]) -> None:
        self.new, self.warning = new, warning
        self._spec: Any = None

    def create_module(self, spec: Any) -> ModuleType:
        if self.warning:
            # stacklevel 2: the import machinery's frames are skipped, so the warning names the user's import
            warnings.warn(self.warning, DeprecationWarning, stacklevel=2)
        module = importlib.import_module(self.new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system set the old path's spec on the module: it keeps its own (reload, pickling, -m)
        module.__spec__ = self._spec


class _MovedModules(importlib.abc.MetaPathFinder):
    """On ``sys.meta_path``: finds only the old paths it was given, each as its new module."""

    def __init__(self) -> None:
        self.moved: dict[str, tuple[str, Optional[str]]] = {}

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        entry = self.moved.get(name)
        if entry is None:
            if name.rpartition(".")[0] in self.moved:
                # An old module path that names a package now (pipeline_ext.distributed): its modules have
                # their own names; found through its __path__ they would run a second time as new modules
                raise ModuleNotFoundError(f"No module named {name!r} (import it from "
                                          f"{self.moved[name.rpartition('.')[0]][0]})", name=name)
            return None
        return importlib.util.spec_from_loader(name, _Moved(*entry))


_moved_modules = _MovedModules()


def moved_modules(moved: dict[str, str], deprecated: Optional[dict[str, str]] = None) -> None:
    """Make each old module path in ``moved`` (and ``deprecated``, which warns) import its new module.

    ``{"pipeline_ext.microbatch": "pipeline_ext.runtime.microbatch"}``: ``import
    pipeline_ext.microbatch`` and ``from pipeline_ext.microbatch import X`` give
    ``pipeline_ext.runtime.microbatch`` and its ``X``, registered under both
    names in ``sys.modules``. Nothing is imported until an old path is.
    """
    for old, new in moved.items():
        _moved_modules.moved[old] = (new, None)
    for old, new in (deprecated or {}).items():
        _moved_modules.moved[old] = (new, f"{old} is now {new}; import it from there (the old path goes away "
                                          "in the next release)")
    if _moved_modules not in sys.meta_path:
        sys.meta_path.insert(0, _moved_modules)  # before the path finder: no old path is ever a file
