"""Build pipeline_ext and its compiled core, ``pipeline_ext._C``.

The extension is ABI-tied to the torch it is compiled against, so the build
uses the torch that is already installed and never downloads one: install torch
first, then ``pip install --no-build-isolation .`` (or ``-e .``).

A CUDAExtension (with the ``.cu`` kernels and ``-DWITH_CUDA``) is built when the
installed torch is a CUDA build and nvcc is found; otherwise a CppExtension.
Set ``PIPELINE_EXT_FORCE_CPU=1`` to build the CPU-only extension regardless.
"""
from __future__ import annotations

import glob
import os
import shutil
import sys

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:  # pragma: no cover - exercised by hand
    sys.exit(
        "pipeline_ext: PyTorch is not installed. Install it first "
        "(e.g. `pip install torch==2.13.0`), then build this package with "
        "`pip install --no-build-isolation .` so that the build uses that torch."
    )

HERE = os.path.dirname(os.path.abspath(__file__))


def _sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, pattern), recursive=True))


def _want_cuda() -> bool:
    if os.environ.get("PIPELINE_EXT_FORCE_CPU") == "1":
        return False
    if torch.version.cuda is None:
        return False
    return cpp_extension.CUDA_HOME is not None or shutil.which("nvcc") is not None


def _openmp() -> bool:
    return sys.platform.startswith("linux") and torch.backends.openmp.is_available()


def _extension():
    cpp = [s for s in _sources("csrc/**/*.cpp") if not s.startswith(os.path.join("csrc", "tests"))]
    cuda_host = [s for s in cpp if s.endswith("_cuda.cpp")]
    # Hidden visibility as pybind11 recommends: only PyInit__C is exported.
    cxx_flags = ["-O3", "-std=c++20", "-fvisibility=hidden"]
    # at::parallel_for is a header template: without -fopenmp it silently runs
    # serially. The resulting libgomp.so.1 dependency resolves to the one torch
    # already loaded, so there is a single OpenMP thread pool.
    link_flags = []
    if _openmp():
        cxx_flags.append("-fopenmp")
        link_flags.append("-fopenmp")
    if _want_cuda():
        return cpp_extension.CUDAExtension(
            "pipeline_ext._C",
            sources=cpp + _sources("csrc/**/*.cu"),
            include_dirs=[os.path.join(HERE, "csrc")],
            define_macros=[("WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++20"]},
            extra_link_args=link_flags,
        )
    return cpp_extension.CppExtension(
        "pipeline_ext._C",
        sources=[s for s in cpp if s not in cuda_host],
        include_dirs=[os.path.join(HERE, "csrc")],
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=link_flags,
    )


TORCH_VERSION = torch.__version__.split("+")[0]

setup(
    name="pipeline_ext",
    version="0.1.0",
    description="Pipeline-parallel training for PyTorch: schedules as data, one executor, C++ runtime.",
    packages=find_packages(include=["pipeline_ext", "pipeline_ext.*"]),
    python_requires=">=3.9",
    # The compiled core is tied to this exact torch release.
    install_requires=[f"torch=={TORCH_VERSION}"],
    extras_require={"png": ["matplotlib"], "demo": ["tqdm", "matplotlib"], "test": ["pytest", "hypothesis"],
                    # examples/llama_pipeline.py (v5 masking API); transformers does not depend on torch, so no other torch is pulled
                    "llama": ["transformers>=5"]},
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)},
    zip_safe=False,
)
