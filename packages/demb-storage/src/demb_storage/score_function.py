"""Custom eviction scores (a table's ``score_function``), compiled with numba into victim ranks.

A compound (TIMESTAMP, LFU) table may take ``score_function(scores, cur_timestamp) -> float``:
``scores`` are the key's two score words in the user's tuple order (for ``(TIMESTAMP, LFU)``,
``scores[0]`` the last-access timestamp and ``scores[1]`` the frequency; swapped for
``(LFU, TIMESTAMP)``), ``cur_timestamp`` the batch's timestamp (the table's score argument of
the op). When a bucket is full, the key with the lowest returned score is evicted; a NaN
return is evicted first; ties go to the slot first in the new key's circular order, as the
built-in evictor breaks them.

An op never evicts a key it touched, so every victim candidate keeps its scores for the whole
op: the score of every slot can be computed before the op. :class:`VictimRanker` does that,
into the index's :attr:`~demb_kernels.table.TableIndex.victim_rank`: each score becomes an
int64 whose order is the float order (:func:`float_rank`), which the table kernels compare.
The function is compiled at construction, with numba's CPU JIT (a loop over the slots) and,
for a CUDA index, with numba-cuda (one thread per slot, on torch's current stream, no sync).
Both evaluate it on the int64 words as float64 arithmetic and share the conversion code, so
the same function ranks the same slots alike on either device (up to the devices' own
rounding of math functions such as ``log``, which rarely decides between two keys).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import struct
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import numpy as np
import numpy.typing as npt
import torch
from demb_kernels.table import TableIndex

from demb_storage._errors import TableConfigError
from demb_storage._score_check import ScoreFunction, check_score_function

if TYPE_CHECKING:
    from demb_storage.options import TableConfig

__all__ = [
    "CPU_SIGNATURE",
    "CUDA_SIGNATURE",
    "ScoreFunction",
    "VictimRanker",
    "check_score_function",
    "cuda_rank_function",
    "float_rank",
]

CPU_SIGNATURE = "void(int64[:, ::1], int64[::1], int64, int64, int64, int64, int64)"
"""The signature of the CPU rank kernel (see :func:`_cpu_kernel`)."""
CUDA_SIGNATURE = (
    "void(int64[:, ::1], int64[::1], int64, int64, int64[::1], int64, int64, int64, int64, "
    "int64[::1])"
)
"""The signature of :func:`cuda_rank_function`'s kernel."""

_INT64_MIN = -(2**63)
_LOW_BITS = 0x7FFFFFFFFFFFFFFF
_CUDA_THREADS = 256

Int64s = npt.NDArray[np.int64]


class _CpuKernel(Protocol):
    def __call__(
        self, scores: Int64s, rank: Int64s, lo: int, hi: int, first: int, second: int, now: int
    ) -> None: ...


class _CudaKernel(Protocol):
    def __getitem__(self, launch: tuple[int, int, object]) -> Callable[..., None]: ...


def _order_bits(value: float, bits: int) -> int:
    """The rank of float64 ``value`` from its bit pattern ``bits`` (int64): NaN lowest, both
    zeros 0, else ``bits``, with the low 63 bits flipped for a negative value. Compiled for
    the CPU and for CUDA (one definition of the order)."""
    if math.isnan(value):  # evicted first
        return _INT64_MIN
    if value == 0.0:  # -0.0 ranks as +0.0
        return 0
    if bits < 0:
        return bits ^ _LOW_BITS
    return bits


def float_rank(value: float) -> int:
    """The int64 rank of a float64 score: ``float_rank(a) < float_rank(b)`` iff ``a < b``
    (``-0.0`` and ``0.0`` equal, NaN below everything). What :class:`VictimRanker` writes."""
    bits: int = struct.unpack("<q", struct.pack("<d", float(value)))[0]
    return _order_bits(float(value), bits)


def _compile_error(table: str, function: object, target: str, err: Exception) -> NoReturn:
    name = getattr(function, "__qualname__", repr(function))
    raise TableConfigError(
        "score_function",
        function,
        f"table {table}: numba cannot compile {name} for the {target}: {type(err).__name__}: {err}",
    ) from err


_LOCK = threading.Lock()
_CPU_KERNELS: dict[Callable[..., object], _CpuKernel] = {}
_CUDA_KERNELS: dict[Callable[..., object], _CudaKernel] = {}


def _cpu_kernel(function: Callable[..., object]) -> _CpuKernel:
    """``rank(scores, rank, lo, hi, first, second, now)``, compiled (cached per function):
    ``rank[g] = float_rank(function((scores[first, g], scores[second, g]), now))`` for the
    slots ``g`` in ``[lo, hi)``; ``scores`` ``(W, S)`` and ``rank`` ``(S,)`` int64 arrays."""
    with _LOCK:
        cached = _CPU_KERNELS.get(function)
    if cached is not None:
        return cached
    numba: Any = importlib.import_module("numba")
    user = numba.njit(error_model="numpy")(function)
    order = numba.njit(_order_bits)

    def rank_slots(
        scores: Int64s, rank: Int64s, lo: int, hi: int, first: int, second: int, now: int
    ) -> None:
        value = np.empty(1, np.float64)
        bits = value.view(np.int64)
        for g in range(lo, hi):
            value[0] = user((scores[first, g], scores[second, g]), now) * 1.0  # as float64
            rank[g] = order(value[0], bits[0])

    kernel: _CpuKernel = numba.njit(CPU_SIGNATURE, error_model="numpy")(rank_slots)
    with _LOCK:
        _CPU_KERNELS[function] = kernel
    return kernel


def cuda_rank_function(function: Callable[..., object]) -> Callable[..., None]:
    """The Python source of the CUDA twin of :func:`_cpu_kernel`, for ``numba.cuda.jit`` with
    :data:`CUDA_SIGNATURE`: one thread per slot ``g`` of ``[lo, hi)``, the slots of the
    consecutive tables ``[t0, t1)`` (``rank(scores, rank, lo, hi, slot_offsets, t0, t1, first,
    second, score_args)``), each reading ``now`` as ``score_args[t]`` of its table ``t``
    (found in the index's ``slot_offsets``) on the device: one launch ranks every table of a
    run that shares the function and its words. Needs numba-cuda."""
    cuda: Any = importlib.import_module("numba.cuda")
    libdevice: Any = importlib.import_module("numba.cuda.libdevice")
    user = cuda.jit(device=True)(function)
    order = cuda.jit(device=True)(_order_bits)

    def rank_slots(
        scores: Int64s,
        rank: Int64s,
        lo: int,
        hi: int,
        offsets: Int64s,
        t0: int,
        t1: int,
        first: int,
        second: int,
        args: Int64s,
    ) -> None:
        g = lo + cuda.grid(1)
        if g < hi:
            a, b = t0, t1 - 1  # the last table whose first slot is <= g
            while a < b:
                m = (a + b + 1) // 2
                if offsets[m] <= g:
                    a = m
                else:
                    b = m - 1
            value = user((scores[first, g], scores[second, g]), args[a]) * 1.0  # as float64
            rank[g] = order(value, libdevice.double_as_longlong(value))

    return rank_slots


def _cuda_kernel(function: Callable[..., object]) -> _CudaKernel:
    """:func:`cuda_rank_function` compiled for the current GPU (cached per function)."""
    with _LOCK:
        cached = _CUDA_KERNELS.get(function)
    if cached is not None:
        return cached
    cuda: Any = importlib.import_module("numba.cuda")
    kernel: _CudaKernel = cuda.jit(CUDA_SIGNATURE)(cuda_rank_function(function))
    with _LOCK:
        _CUDA_KERNELS[function] = kernel
    return kernel


class VictimRanker:
    """The victim ranks of the tables with a ``score_function``, computed before each op.

    Args:
        configs: the tables' configs (table ``t`` is ``configs[t]``).
        device: the index's device: the functions are compiled here for the CPU and, on
            CUDA, for the current GPU.
        names: the tables' names, for errors (default: their numbers).

    Raises:
        TableConfigError: a function numba cannot compile (naming the table and numba's
            message), or a CUDA device without numba-cuda installed.
    """

    def __init__(
        self,
        configs: Sequence[TableConfig],
        device: torch.device,
        names: Sequence[str] | None = None,
    ) -> None:
        self.device = device
        self._cpu: list[tuple[int, int, int, _CpuKernel]] = []
        """Per ranked table: ``(t, first, second, kernel)``, ``first`` and ``second`` the index
        words of its user columns."""
        self._cuda: list[tuple[int, int, int, int, _CudaKernel]] = []
        """Runs of consecutive ranked tables sharing a function and its index words, with the
        CUDA kernel (a CUDA index): ``(t0, t1, first, second, kernel)``, one launch each."""
        for t, config in enumerate(configs):
            function = config.score_function
            if function is None:
                continue
            label = str(t) if names is None else repr(names[t])
            check_score_function(function)
            first, second = config.score_layout.index_words
            try:
                self._cpu.append((t, first, second, _cpu_kernel(function)))
            except Exception as err:  # numba's typing and lowering errors share no base
                _compile_error(label, function, "CPU", err)
            if device.type != "cuda":
                continue
            kernel = self._compile_cuda(label, function)
            last = self._cuda[-1] if self._cuda else None
            if last is not None and last[1] == t and last[2:] == (first, second, kernel):
                self._cuda[-1] = (last[0], t + 1, first, second, kernel)
            else:
                self._cuda.append((t, t + 1, first, second, kernel))

    @staticmethod
    def _compile_cuda(table: str, function: Callable[..., object]) -> _CudaKernel:
        if importlib.util.find_spec("numba_cuda") is None:  # numba's own CUDA target is retired
            raise TableConfigError(
                "score_function",
                function,
                f"table {table}: a CUDA table needs numba-cuda (install demb-storage[cuda])",
            )
        try:
            return _cuda_kernel(function)
        except Exception as err:
            _compile_error(table, function, "GPU", err)

    @staticmethod
    def ranked(configs: Sequence[TableConfig]) -> list[bool] | None:
        """Per table, whether it has a ``score_function``; None when none has one (the
        ``ranked`` argument of :meth:`demb_kernels.table.TableIndex.create`)."""
        flags = [c.score_function is not None for c in configs]
        return flags if any(flags) else None

    def refresh(self, index: TableIndex, score_args: torch.Tensor) -> None:
        """Write the victim ranks of every ranked table's slots into ``index.victim_rank``
        (the ranks of empty slots are whatever the function gives their zero words).

        Args:
            index: the tables' index, with ``(S,)`` int64 victim ranks.
            score_args: ``(T,)`` int64 on the index's device, the op's score per table: the
                ``cur_timestamp`` each table's function gets. On CUDA it is read on the device
                (no sync) and the ranks are queued on torch's current stream.
        """
        if index.device.type == "cuda":
            self._refresh_cuda(index, score_args)
            return
        scores = index.scores.numpy()
        rank = index.victim_rank.numpy()
        args = score_args.tolist()
        for t, first, second, kernel in self._cpu:
            lo, hi = index.slot_range(t)
            kernel(scores, rank, lo, hi, first, second, int(args[t]))

    def _refresh_cuda(self, index: TableIndex, score_args: torch.Tensor) -> None:
        cuda: Any = importlib.import_module("numba.cuda")
        errors: Any = importlib.import_module("numba.core.errors")
        device = index.device
        with cuda.gpus[device.index or 0], warnings.catch_warnings():
            # small tables under-fill the GPU: expected
            warnings.simplefilter("ignore", errors.NumbaPerformanceWarning)
            stream = cuda.external_stream(torch.cuda.current_stream(device).cuda_stream)
            scores = cuda.as_cuda_array(index.scores, sync=False)
            rank = cuda.as_cuda_array(index.victim_rank, sync=False)
            offsets = cuda.as_cuda_array(index.slot_offsets, sync=False)
            args = cuda.as_cuda_array(score_args.contiguous(), sync=False)
            for t0, t1, first, second, kernel in self._cuda:
                lo, hi = index.slot_range(t0)[0], index.slot_range(t1 - 1)[1]
                blocks = math.ceil((hi - lo) / _CUDA_THREADS)
                kernel[blocks, _CUDA_THREADS, stream](
                    scores, rank, lo, hi, offsets, t0, t1, first, second, args
                )
