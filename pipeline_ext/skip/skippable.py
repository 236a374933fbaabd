"""The user-facing skip API, torchgpipe's: ``@skippable``, ``stash``, ``pop``, ``verify_skippables``.

A long skip connection (U-Net, a transformer's first embedding reused at the
end) breaks ``nn.Sequential``'s one-input-one-output chain. torchgpipe's answer,
kept here name for name so its models run unchanged: a layer declares the
skips it stashes and pops, and its ``forward`` is a generator that yields
``stash(name, tensor)`` and receives ``tensor = yield pop(name)``::

    @skippable(stash=["down1"])
    class Down(nn.Module):
        def forward(self, x):
            yield stash("down1", x)
            return self.conv(x)

    @skippable(pop=["down1"])
    class Up(nn.Module):
        def forward(self, x):
            skip = yield pop("down1")
            return self.conv(x) + skip

The model runs as an ordinary ``nn.Sequential`` (the current skip tracker,
``tracker.py``, holds the skip between the two layers); in a pipeline the skip
travels straight from the stashing stage to the popping stage
(``runtime/skips.py``), and its gradient straight back.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, FrozenSet, Generator, Iterable, Iterator, Optional, TypeVar

import torch
from torch import nn

from pipeline_ext.skip.namespace import Namespace, namespace_id
from pipeline_ext.skip.tracker import SkipKey, current_skip_tracker

__all__ = ["Skippable", "skippable", "stash", "pop", "verify_skippables", "has_skippables"]

T = TypeVar("T", bound="Skippable")


class SkipRouteError(ValueError):
    """Stashes and pops of a pipeline's stages do not pair up (names every unmatched skip)."""


class stash:  # noqa: N801 - torchgpipe's spelling: ``yield stash(name, tensor)``
    """The command to stash a skip tensor (``None`` is allowed) under a declared name."""

    __slots__ = ("name", "tensor")

    def __init__(self, name: str, tensor: Optional[torch.Tensor]) -> None:
        self.name = name
        self.tensor = tensor


class pop:  # noqa: N801 - torchgpipe's spelling: ``x = yield pop(name)``
    """The command to pop the skip tensor an earlier layer stashed under a declared name."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class Skippable(nn.Module):
    """A module with declared skips; made by :func:`skippable`, not subclassed directly.

    The user's module is ``self.module`` (so state-dict keys are torchgpipe's,
    ``<layer>.module.<param>``), and ``namespaces`` isolates names (``isolate``).
    """

    module_cls: ClassVar[type]
    stashable_names: ClassVar[FrozenSet[str]]
    poppable_names: ClassVar[FrozenSet[str]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.module = self.module_cls(*args, **kwargs)
        self.namespaces: dict[str, Namespace] = {}

    def __repr__(self) -> str:
        return f"@skippable({self.module})"

    def key(self, name: str) -> SkipKey:
        """The key a declared name is matched by: its namespace (if isolated) and the name."""
        return SkipKey(namespace_id(self.namespaces.get(name)), name)

    def stashable(self) -> Iterator[tuple[Optional[Namespace], str]]:
        """(namespace, name) of every declared stash (torchgpipe's API)."""
        return ((self.namespaces.get(n), n) for n in sorted(self.stashable_names))

    def poppable(self) -> Iterator[tuple[Optional[Namespace], str]]:
        """(namespace, name) of every declared pop (torchgpipe's API)."""
        return ((self.namespaces.get(n), n) for n in sorted(self.poppable_names))

    def isolate(self: T, ns: Namespace, *, only: Optional[Iterable[str]] = None) -> T:
        """Put this module's skip names (all, or ``only`` these) in namespace ``ns``; returns self."""
        if not isinstance(ns, Namespace):
            raise TypeError(f"isolate() needs a Namespace, got {type(ns).__name__}")
        declared = self.stashable_names | self.poppable_names
        names = declared if only is None else set(only)
        unknown = sorted(set(names) - declared)
        if unknown:
            raise ValueError(f"isolate(only=...) names {unknown} that {type(self).__name__} does not declare")
        for name in names:
            self.namespaces[name] = ns
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Run the wrapped forward, serving its ``stash``/``pop`` commands from the current tracker."""
        tracker = current_skip_tracker()
        poppable: dict[str, Optional[torch.Tensor]] = {}
        for name in sorted(self.poppable_names):
            try:
                poppable[name] = tracker.load(self.key(name))
            except KeyError:
                raise RuntimeError(f"{type(self).__name__}: skip {self.key(name)} has not been stashed "
                                   "(no earlier layer of this forward stashed it)") from None
        stashed: dict[str, Optional[torch.Tensor]] = {}

        def on_stash(name: str, tensor: Optional[torch.Tensor]) -> None:
            if name not in self.stashable_names:
                raise RuntimeError(f"{type(self).__name__}: '{name}' has not been declared as stashable")
            if tensor is not None and not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{type(self).__name__}: stash('{name}', ...) takes a tensor or None, "
                                f"got {type(tensor).__name__}")
            stashed[name] = tensor

        def on_pop(name: str) -> Optional[torch.Tensor]:
            if name not in self.poppable_names:
                raise RuntimeError(f"{type(self).__name__}: '{name}' has not been declared as poppable")
            if name not in poppable:
                raise RuntimeError(f"{type(self).__name__}: '{name}' was popped twice")
            return poppable.pop(name)

        output = _dispatch(self.module(*args, **kwargs), on_stash, on_pop)
        missing = sorted(self.stashable_names - stashed.keys())
        if missing:
            raise RuntimeError(f"{type(self).__name__}: {', '.join(repr(n) for n in missing)} must be stashed "
                               "but have not")
        if poppable:
            raise RuntimeError(f"{type(self).__name__}: {', '.join(repr(n) for n in sorted(poppable))} must be "
                               "popped but have not")
        for name, tensor in stashed.items():
            tracker.save(self.key(name), tensor)
        return output


def _dispatch(result: Any, on_stash: Callable[[str, Optional[torch.Tensor]], None],
              on_pop: Callable[[str], Optional[torch.Tensor]]) -> Any:
    """Drive a generator forward to its return value; a plain return value is the output itself."""
    if not isinstance(result, Generator):
        return result
    try:
        command = next(result)
        while True:
            if isinstance(command, stash):
                on_stash(command.name, command.tensor)
                command = next(result)
            elif isinstance(command, pop):
                command = result.send(on_pop(command.name))
            else:
                raise TypeError(f"{command!r} is not a command from @skippable (yield stash(...) or pop(...))")
    except StopIteration as stop:
        return stop.value


def skippable(stash: Iterable[str] = (), pop: Iterable[str] = ()) -> Callable[[type], type]:
    """Class decorator: the module stashes the names in ``stash`` and pops those in ``pop``.

    The decorated class is a :class:`Skippable` whose instances wrap an
    instance of the original class (constructor arguments are passed on).
    """
    stash_names, pop_names = frozenset(stash), frozenset(pop)
    for name in stash_names | pop_names:
        if not isinstance(name, str):
            raise TypeError(f"skip names are str, got {name!r}")

    def extend(module_cls: type) -> type:
        if not (isinstance(module_cls, type) and issubclass(module_cls, nn.Module)):
            raise TypeError(f"@skippable decorates an nn.Module class, got {module_cls!r}")
        attrs = {"module_cls": module_cls, "stashable_names": stash_names, "poppable_names": pop_names,
                 "__doc__": module_cls.__doc__, "__module__": module_cls.__module__,
                 "__qualname__": module_cls.__qualname__}
        return type(module_cls.__name__, (Skippable,), attrs)

    return extend


def verify_skippables(module: nn.Sequential) -> None:
    """Raise ``TypeError`` listing every skip without exactly one stash followed by one pop.

    The same name used twice must be isolated by namespaces (``isolate``).
    ``Pipe`` runs this on construction, as torchgpipe's ``GPipe`` does.
    """
    stashed: set[SkipKey] = set()
    popped: set[SkipKey] = set()
    problems: list[str] = []
    for layer_name, layer in module.named_children():
        if not isinstance(layer, Skippable):
            continue
        for name in sorted(layer.stashable_names & layer.poppable_names):
            problems.append(f"'{layer_name}' declared '{name}' both as stashable and as poppable")
        for name in sorted(layer.stashable_names - layer.poppable_names):
            key = layer.key(name)
            if key in stashed:
                problems.append(f"'{layer_name}' redeclared '{name}' as stashable but not isolated by namespace")
            stashed.add(key)
        for name in sorted(layer.poppable_names - layer.stashable_names):
            key = layer.key(name)
            if key in popped:
                problems.append(f"'{layer_name}' redeclared '{name}' as poppable but not isolated by namespace")
            elif key not in stashed:
                problems.append(f"'{layer_name}' declared '{name}' as poppable but it was not stashed")
            popped.add(key)
    for key in sorted(stashed - popped, key=lambda k: k.order):
        problems.append(f"no module declared '{key.name}' as poppable but stashed")
    if problems:
        raise TypeError("one or more pairs of stash and pop do not match:\n\n" + "\n".join(f"* {p}" for p in problems))


def has_skippables(module: nn.Module) -> bool:
    """Whether any submodule stashes or pops: a stage without one needs no tracker of its own."""
    return any(isinstance(m, Skippable) for m in module.modules())
