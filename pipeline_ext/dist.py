"""Deprecated old name of :mod:`pipeline_ext.comm`, kept for one release.

The package was renamed because ``dist`` collides with every script's
``import torch.distributed as dist`` and with the build-output folder
``dist/`` that tools and .gitignore templates skip.

Importing this module warns (``DeprecationWarning``) and registers every
submodule of ``pipeline_ext.comm`` under its old name, in ``sys.modules`` and
as an attribute here: ``pipeline_ext.dist.launch`` *is* the module
``pipeline_ext.comm.launch`` (the same functions, classes and module state),
so ``import pipeline_ext.dist.launch`` and ``from pipeline_ext.dist.launch
import spawn`` keep working and give the very same objects. A module file, not
a package: nothing of the library imports it (tests/test_layers.py).
"""
from __future__ import annotations

import importlib
import pkgutil
import sys
import warnings

import pipeline_ext.comm as _comm

warnings.warn("pipeline_ext.dist is now pipeline_ext.comm; import from pipeline_ext.comm "
              "(the old name goes away in the next release)", DeprecationWarning, stacklevel=2)

__all__ = sorted(info.name for info in pkgutil.iter_modules(_comm.__path__))

for _name in __all__:
    _module = importlib.import_module(f"{_comm.__name__}.{_name}")
    sys.modules[f"{__name__}.{_name}"] = _module
    globals()[_name] = _module
del _name, _module
