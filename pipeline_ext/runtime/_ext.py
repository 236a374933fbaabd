"""Loads the compiled core, ``pipeline_ext._C``, with one clear error if it is missing.

Every Python module that needs the C++ runtime imports ``_C`` from here, so the
message a user sees when the extension was never built is the same everywhere.
torch is imported first because ``_C`` links against torch's shared libraries.
"""
from __future__ import annotations

import torch  # noqa: F401  (loads libc10/libtorch before the extension)

try:
    from pipeline_ext import _C  # noqa: F401  (re-exported)
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "pipeline_ext's compiled core (pipeline_ext._C) is not built: run "
        "`pip install --no-build-isolation -e .` in the source tree (install torch first)."
    ) from exc
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "pipeline_ext._C was built but does not load, usually because it was compiled against "
        f"another torch than torch {torch.__version__}: rebuild with "
        f"`pip install --no-build-isolation -e .` ({exc})"
    ) from exc

__all__ = ["_C"]
