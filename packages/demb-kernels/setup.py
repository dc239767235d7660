"""Build of demb-kernels' native library `demb_kernels._C`.

C++ CPU kernels are always built. CUDA kernels are built when DEMB_CUDA=1, or when DEMB_CUDA is
unset (or empty) and torch sees a GPU at build time; DEMB_CUDA=0 never builds them.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

HERE = Path(__file__).parent.resolve()
CSRC = HERE / "csrc"


def _want_cuda() -> bool:
    flag = os.environ.get("DEMB_CUDA", "")
    if flag == "1":
        return True
    if flag == "0":
        return False
    if flag:
        raise SystemExit(f"DEMB_CUDA={flag!r}: expected '1', '0' or unset")
    return torch.cuda.is_available()


def _pip_cuda_includes() -> list[str]:
    """Headers of the pip CUDA wheels (nvidia/cu13/include) torch's CUDA headers need, when the
    build uses PyPI's CUDA torch rather than a system CUDA toolkit with all its libraries."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    found = []
    for root in spec.submodule_search_locations:
        found += [str(p) for p in sorted(Path(root).glob("cu*/include")) if p.is_dir()]
    return found


def _sources(pattern: str) -> list[str]:
    return sorted(str(p.relative_to(HERE)) for p in CSRC.glob(pattern))


def _extension() -> CppExtension:
    cxx = ["-O3", "-Wall", "-Wextra", "-Wno-unused-parameter"]
    include_dirs = [str(CSRC)]
    if _want_cuda():
        nvcc = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]
        return CUDAExtension(
            "demb_kernels._C",
            sources=_sources("*.cpp") + _sources("cpu/*.cpp") + _sources("cuda/*.cu"),
            include_dirs=include_dirs + _pip_cuda_includes(),
            define_macros=[("DEMB_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        )
    return CppExtension(
        "demb_kernels._C",
        sources=_sources("*.cpp") + _sources("cpu/*.cpp"),
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx},
    )


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
