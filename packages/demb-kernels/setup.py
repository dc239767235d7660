"""Build of demb-kernels' native library `demb_kernels._C`.

C++ CPU kernels are always built. CUDA kernels are built when DEMB_CUDA=1, or when DEMB_CUDA is
unset (or empty) and torch sees a GPU at build time; DEMB_CUDA=0 never builds them.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

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
    """Headers torch's CUDA headers need (cusparse.h, ...) when the CUDA toolkit at CUDA_HOME
    lacks them: then take them from PyPI's CUDA wheels (nvidia/cu<major>/include) that the
    locked torch depends on, matching torch's CUDA major version."""
    toolkit = Path(CUDA_HOME or "/usr/local/cuda") / "include"
    if (toolkit / "cusparse.h").exists() or torch.version.cuda is None:
        return []
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    major = torch.version.cuda.split(".")[0]
    found = [Path(root) / f"cu{major}" / "include" for root in spec.submodule_search_locations]
    return [str(p) for p in found if (p / "cusparse.h").exists()]


def _sources(pattern: str) -> list[str]:
    return sorted(str(p.relative_to(HERE)) for p in CSRC.glob(pattern))


# Link the C++ runtime as the shared library the process already has. On the H200 image the
# default link left a private copy of libstdc++ inside _C (about 4,000 exported std:: symbols;
# where the linker found it was not established), which crashed as soon as an error message
# formatted a number. Naming the shared object explicitly resolves every std:: symbol to it.
LINK_ARGS = ["-l:libstdc++.so.6"] if sys.platform.startswith("linux") else []

# OpenMP, as PyTorch's own CPU kernels use it: at::parallel_for is an inline template, so the
# CPU kernels' parallel_for loops run on torch's threads only when compiled with -fopenmp (the
# process loads torch's libgomp.so.1 first; the extension's reference to that soname resolves
# to it, one OpenMP runtime). On Linux only (Apple's clang has no -fopenmp).
# 2026-12-01, 2-vCPU VM (AMD EPYC), `demb bench module --device cpu --optimizer sgd --pooling
# sum`, builds alternating: with it train 0.86-0.95x TorchRec's and eval 1.03-1.18x over four
# runs, without it 1.15-1.38x and 1.43-1.67x. (On the earlier 2-vCPU VM, 2026-11-30, the SUM
# train ratio spread over 1.19-1.65x with it against 1.31-1.33x without, and it was left out.)
OPENMP = ["-fopenmp"] if sys.platform.startswith("linux") else []


def _extension() -> CppExtension:
    # -ffp-contract=off (and nvcc --fmad=false below): no multiply-add contraction, so float
    # updates round the same on the CPU and the GPU. -fno-math-errno lets sqrtf vectorize (no
    # code here reads errno).
    cxx = ["-O3", "-Wall", "-Wextra", "-Wno-unused-parameter", "-ffp-contract=off"]
    cxx += ["-fno-math-errno", *OPENMP]
    include_dirs = [str(CSRC)]
    if _want_cuda():
        # --fmad=false: no multiply-add contraction, so float updates round as on the CPU.
        nvcc = ["-O3", "--expt-relaxed-constexpr", "-lineinfo", "--fmad=false"]
        return CUDAExtension(
            "demb_kernels._C",
            sources=_sources("*.cpp") + _sources("cpu/*.cpp") + _sources("cuda/*.cu"),
            include_dirs=include_dirs + _pip_cuda_includes(),
            define_macros=[("DEMB_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
            extra_link_args=LINK_ARGS + OPENMP,
        )
    return CppExtension(
        "demb_kernels._C",
        sources=_sources("*.cpp") + _sources("cpu/*.cpp"),
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx},
        extra_link_args=LINK_ARGS + OPENMP,
    )


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
