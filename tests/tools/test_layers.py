"""The package's layers: every import, lazy ones included, points down (or stays in its own package).

    schedules < skip < runtime < comm < pipelining | pipe < training < demo

``runtime`` is one rank's engine and knows nothing about processes; ``comm``
is everything between processes; the two front ends (``pipelining``: torch's
API, ``pipe``: torchgpipe's) sit on them side by side and never import each
other. Read from the source (AST), so an import inside a function counts too.
"""
from __future__ import annotations

import ast
import pathlib

import pytest
from models import ROOT

ROOT = ROOT / "pipeline_ext"
LAYERS = {"schedules": 0, "skip": 1, "seqchunks": 1, "runtime": 2, "comm": 3, "pipelining": 4, "pipe": 4, "training": 5, "demo": 6}
#: modules under every layer, importable from any: the compiled core, and the packages' lazy-name helper
BELOW_ALL = ("_C", "_lazy")


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, imported pipeline_ext package) of every import in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] if node.module != "pipeline_ext" else [f"pipeline_ext.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "pipeline_ext" and len(parts) > 1 and parts[1] not in BELOW_ALL:
                out.append((node.lineno, parts[1]))
    return out


def _package(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).parts[0]


def test_every_file_is_in_a_package_that_names_its_layer():
    loose = sorted(p.name for p in ROOT.glob("*.py") if p.name != "__init__.py" and p.stem not in BELOW_ALL)
    assert loose == [], f"modules outside a layer's package: {loose}"
    for stem in BELOW_ALL:  # below every layer: they import nothing of the package
        path = ROOT / f"{stem}.py"
        assert not path.exists() or _imports(path) == [], f"{path.name} imports pipeline_ext packages"
    packages = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert packages == sorted(LAYERS), packages


@pytest.mark.parametrize("path", sorted(p for p in ROOT.rglob("*.py") if p.parent != ROOT), ids=str)
def test_imports_point_down(path):
    mine = _package(path)
    wrong = []
    for line, target in _imports(path):
        if target not in LAYERS:  # pipeline_ext.ops / .microbatch aliases are for users, not for the package
            wrong.append(f"line {line}: pipeline_ext.{target} is not a package")
        elif target != mine and (LAYERS[target] >= LAYERS[mine]):
            wrong.append(f"line {line}: {mine} (layer {LAYERS[mine]}) imports {target} (layer {LAYERS[target]})")
    assert not wrong, f"{path.relative_to(ROOT)}: " + "; ".join(wrong)
