"""The C kernels (kernels/native/*.c), loaded with ctypes: the FP8 block dequant's gather, its NaN-code
test and its BF16 tables, the same functions and bits as fp8_gather.py's numba kernels.

setup.py builds them at install where a C compiler is found (`pip install -e .` puts the library beside
this file). Loading takes about a millisecond, against the 0.4-0.8 s that importing numba and loading
its cached kernels took at the start of every run (bench/RESULTS.md), and the gather runs 1.4-1.8x
numba's per core. Where the library is missing, or `CKPTTOOL_NATIVE=0` (read on every call, so tests can
flip it), `library()` is None and fp8_gather falls back to numba, then numpy.

The C code checks nothing, so every wrapper here checks dtypes, shapes and strides before calling it.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import os
from pathlib import Path

import numpy as np

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_SIGNATURES = {
    "ckpttool_fp8_gather_u16": ([_P, _I64, _P, _I64, _P, _I64, _I64, _I64, ctypes.c_int32], None),
    "ckpttool_fp8_gather_u32": ([_P, _I64, _P, _I64, _P, _I64, _I64, _I64, ctypes.c_int32], None),
    "ckpttool_fp8_any_over": ([_P, _I64, ctypes.c_uint64], ctypes.c_int32),
    "ckpttool_bf16_tables": ([_P, _I64, _P, _I64, _P], None),
}


def library() -> ctypes.CDLL | None:
    """The loaded C library, or None (not built, or CKPTTOOL_NATIVE=0)."""
    if os.environ.get("CKPTTOOL_NATIVE", "1") == "0":
        return None
    return _load()


@functools.lru_cache(maxsize=None)
def _load() -> ctypes.CDLL | None:
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_native{suffix}"
        if path.is_file():
            lib = ctypes.CDLL(str(path))
            for name, (args, result) in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, result
            return lib
    return None


def _rows(a: np.ndarray, dtype, name: str) -> int:
    """Row stride of a 2-D `a` of `dtype` whose columns are contiguous, in elements."""
    if a.ndim != 2 or a.dtype != dtype or (a.shape[1] > 1 and a.strides[1] != a.itemsize) or a.strides[0] % a.itemsize:
        raise ValueError(f"{name}: a 2-D {np.dtype(dtype)} array with contiguous rows, not {a.dtype} {a.shape} {a.strides}")
    return a.strides[0] // a.itemsize


def gather(codes: np.ndarray, tables: np.ndarray, out: np.ndarray, shift: int) -> None:
    """out[i, j] = tables[i >> shift, ((j >> shift) << 8) + codes[i, j]], as fp8_gather's numba kernel;
    tables and out are both uint16 or both uint32."""
    lib = _load()
    fn = {np.dtype(np.uint16): lib.ckpttool_fp8_gather_u16, np.dtype(np.uint32): lib.ckpttool_fp8_gather_u32}[tables.dtype]
    rows, cols = codes.shape
    if out.shape != codes.shape or not 0 <= shift < 31:
        raise ValueError(f"gather: codes {codes.shape}, out {out.shape}, shift {shift}")
    if rows and cols and (tables.shape[0] <= (rows - 1) >> shift or tables.shape[1] < (((cols - 1) >> shift) + 1) << 8):
        raise ValueError(f"gather: tables {tables.shape} too small for {rows} x {cols} codes in blocks of {1 << shift}")
    fn(codes.ctypes.data, _rows(codes, np.uint8, "codes"), tables.ctypes.data, _rows(tables, tables.dtype, "tables"),
       out.ctypes.data, _rows(out, tables.dtype, "out"), rows, cols, shift)


def any_over(words: np.ndarray, add: np.uint64) -> bool:
    """Whether some byte of the uint64 `words` has (byte & 0x7F) + add's byte >= 0x80 (fp8_gather.nan_row)."""
    if words.dtype != np.uint64 or words.ndim != 1 or (words.size > 1 and words.strides[0] != 8):
        raise ValueError(f"any_over: contiguous uint64 words, not {words.dtype} {words.shape}")
    return bool(_load().ckpttool_fp8_any_over(words.ctypes.data, words.shape[0], int(add)))


def bf16_tables(values: np.ndarray, scales: np.ndarray, out: np.ndarray) -> None:
    """out[i, k] = bf16 bits of float32(values[k] * scales[i]), as fp8_gather's numba table builder."""
    n, m = values.shape[0], scales.shape[0]
    for a, dtype, shape in ((values, np.float32, (n,)), (scales, np.float32, (m,)), (out, np.uint16, (m, n))):
        if a.dtype != dtype or a.shape != shape or not a.flags.c_contiguous:
            raise ValueError(f"bf16_tables: a contiguous {np.dtype(dtype)} {shape}, not {a.dtype} {a.shape}")
    _load().ckpttool_bf16_tables(values.ctypes.data, n, scales.ctypes.data, m, out.ctypes.data)
