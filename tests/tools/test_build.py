"""The build's own invariants, checked on every machine (CI has no GPU to build the CUDA extension).

torch's extension build names each object after its source's stem, so
``copy.cpp`` and ``copy.cu`` both became ``copy.o`` and ninja refused the CUDA
build ("multiple rules generate csrc/kernels/copy.o"): the CPU build never
compiles a ``.cu`` and could not see it. Found by tools/gpu_check.sh.
"""
from __future__ import annotations

import collections
from models import ROOT

CSRC = ROOT / "csrc"


def test_every_extension_source_has_its_own_object_name():
    sources = [p for p in CSRC.rglob("*") if p.suffix in (".cpp", ".cu") and "tests" not in p.relative_to(CSRC).parts]
    assert any(p.suffix == ".cu" for p in sources)
    objects = collections.Counter(p.with_suffix("").relative_to(CSRC) for p in sources)
    assert not [o for o, n in objects.items() if n > 1], f"sources that build the same object: {objects}"


def test_extension_uses_the_shared_libstdcxx():
    """A compiler that links libstdc++ statically (seen: a CXX=/opt/gcc/bin/g++ toolchain on a GPU
    image) gives _C its own copy of the C++ runtime next to torch's shared one; their locale facets
    disagree and the first error message that formats a number segfaults the process."""
    import shutil
    import subprocess
    import sys

    from pipeline_ext.runtime._ext import _C

    if not sys.platform.startswith("linux") or shutil.which("ldd") is None:
        return  # the check reads ELF dependencies; other platforms link their own way
    needed = subprocess.run(["ldd", _C.__file__], capture_output=True, text=True, check=True).stdout
    assert "libstdc++.so" in needed, (
        f"{_C.__file__} does not link libstdc++ dynamically: rebuild with a compiler that does "
        f"(e.g. CXX=c++); ldd says:\n{needed}"
    )
