"""Value rows split between device memory and host memory under one address range (a hybrid
table): the first rows live in the GPU's memory, the others in host memory that the GPU reads
and writes over the bus, and every kernel addresses them as one CUDA tensor, a row's place
following its slot.

On CUDA the buffer is CUDA managed memory (``cudaMallocManaged``) whose first ``device_rows``
rows are advised to live on the device and the rest on the host, mapped for the device
(``cudaMemAdviseSetPreferredLocation`` and ``cudaMemAdviseSetAccessedBy``), the way FBGEMM's
UVM tables are placed. The CUDA runtime is reached through ``ctypes`` (the library torch
loaded). On the CPU there is one kind of memory: the rows are an ordinary tensor
(:func:`demb_kernels.memory.full`).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from demb_kernels.memory import full

__all__ = ["hybrid_zeros"]

_ATTACH_GLOBAL = 1
_ADVISE_PREFERRED_LOCATION = 3
_ADVISE_ACCESSED_BY = 5
_LOCATION_DEVICE = 1
_LOCATION_HOST = 2
_CPU_DEVICE_ID = -1  # cudaCpuDeviceId, for the runtime's older int-location signature


class _Location(ctypes.Structure):
    """``struct cudaMemLocation`` (CUDA 12.2+)."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


@functools.cache
def _cudart() -> ctypes.CDLL:
    """The CUDA runtime library torch uses (already loaded: found by its name)."""
    version = torch.version.cuda
    if version is None:
        raise RuntimeError("hybrid rows need a CUDA build of torch")
    major = version.split(".")[0]
    for name in (f"libcudart.so.{major}", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError(f"hybrid rows: the CUDA runtime (libcudart.so.{major}) cannot be loaded")


def _check(code: int, what: str) -> None:
    if code != 0:
        lib = _cudart()
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        message = lib.cudaGetErrorString(code).decode()
        raise RuntimeError(f"hybrid rows: {what} failed: {message} ({code})")


def _runtime_version() -> int:
    out = ctypes.c_int(0)
    _check(_cudart().cudaRuntimeGetVersion(ctypes.byref(out)), "cudaRuntimeGetVersion")
    return out.value


def _advise(pointer: int, count: int, advice: int, device: int | None) -> None:
    """``cudaMemAdvise`` of ``count`` bytes at ``pointer`` for ``device`` (None: the host), in
    the signature of the loaded runtime: a ``cudaMemLocation`` from CUDA 13 on (and as
    ``cudaMemAdvise_v2`` in 12.2+), the device number before."""
    if count <= 0:
        return
    lib = _cudart()
    where = _Location(_LOCATION_HOST, 0) if device is None else _Location(_LOCATION_DEVICE, device)
    if _runtime_version() >= 13000:
        fn = lib.cudaMemAdvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, _Location]
        _check(fn(pointer, count, advice, where), "cudaMemAdvise")
    elif hasattr(lib, "cudaMemAdvise_v2"):
        fn = lib.cudaMemAdvise_v2
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, _Location]
        _check(fn(pointer, count, advice, where), "cudaMemAdvise_v2")
    else:
        fn = lib.cudaMemAdvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
        number = _CPU_DEVICE_ID if device is None else device
        _check(fn(pointer, count, advice, number), "cudaMemAdvise")


class _ManagedRows:
    """A managed allocation exposed through ``__cuda_array_interface__``; freed when the last
    tensor over it goes."""

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype, device: int) -> None:
        self.shape = shape
        self.dtype = dtype
        self.nbytes = shape[0] * shape[1] * dtype.itemsize
        pointer = ctypes.c_void_p()
        lib = _cudart()
        lib.cudaMallocManaged.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_size_t,
            ctypes.c_uint,
        ]
        _check(
            lib.cudaMallocManaged(ctypes.byref(pointer), max(self.nbytes, 1), _ATTACH_GLOBAL),
            "cudaMallocManaged",
        )
        self.pointer = int(pointer.value or 0)
        self.device = device

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        typestr = {torch.float32: "<f4", torch.float16: "<f2"}
        return {
            "shape": self.shape,
            "typestr": typestr[self.dtype],
            "data": (self.pointer, False),
            "version": 3,
            "strides": None,
        }

    def __del__(self) -> None:
        if getattr(self, "pointer", 0):
            lib = _cudart()
            lib.cudaFree.argtypes = [ctypes.c_void_p]
            lib.cudaFree(self.pointer)
            self.pointer = 0


def hybrid_zeros(
    rows: int, width: int, dtype: torch.dtype, device: torch.device, device_rows: int
) -> torch.Tensor:
    """``(rows, width)`` zeros of ``dtype`` on ``device`` whose first ``device_rows`` rows live
    in the device's memory and the others in host memory (CUDA; on the CPU an ordinary
    tensor: there the device's memory is the host's).

    Raises:
        RuntimeError: the CUDA runtime cannot be reached or refuses the allocation.
    """
    if device.type != "cuda":
        return full((rows, width), 0, dtype=dtype, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    store = _ManagedRows((rows, width), torch.float16 if dtype == torch.bfloat16 else dtype, index)
    row_bytes = width * dtype.itemsize
    on_device = min(rows, max(device_rows, 0)) * row_bytes
    _advise(store.pointer, on_device, _ADVISE_PREFERRED_LOCATION, index)
    _advise(store.pointer + on_device, store.nbytes - on_device, _ADVISE_PREFERRED_LOCATION, None)
    _advise(store.pointer + on_device, store.nbytes - on_device, _ADVISE_ACCESSED_BY, index)
    with torch.cuda.device(index):
        out = torch.as_tensor(store, device=device)
    if dtype == torch.bfloat16:  # the interface has no bfloat16 type string: same bytes
        out = out.view(torch.bfloat16)
    return out.zero_()
