"""The C kernels (kernels/native/*.c), loaded with ctypes: the FP8 block dequant's gather, its NaN-code
test and its BF16 tables (fp8_gather.py), and the compressed-tensors and ModelOpt loops (scaled_numba.py's
`Kernels`): the same functions and bits as the numba kernels there.

setup.py builds them at install where a C compiler is found (`pip install -e .` puts the library beside
this file). Loading takes about a millisecond, against the 0.4-0.8 s that importing numba and loading
its cached kernels took at the start of every run (bench/HISTORY.md), and the gather runs 1.4-1.8x
numba's per core. Where the library is missing, or `CKPTTOOL_NATIVE=0` (read on every call, so tests can
flip it), `library()` is None and fp8_gather falls back to numba, then numpy.

The C code checks nothing, so every wrapper here checks dtypes, shapes and strides before calling it.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
from pathlib import Path

import numpy as np

from ckpttool import settings
from ckpttool.kernels.scaled_numba import Kernels

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_SIGNATURES = {
    "ckpttool_fp8_gather_u16": ([_P, _I64, _P, _I64, _P, _I64, _I64, _I64, ctypes.c_int32], None),
    "ckpttool_fp8_gather_u32": ([_P, _I64, _P, _I64, _P, _I64, _I64, _I64, ctypes.c_int32], None),
    "ckpttool_fp8_any_over": ([_P, _I64, ctypes.c_uint64], ctypes.c_int32),
    "ckpttool_bf16_tables": ([_P, _I64, _P, _I64, _P], None),
    **{f"ckpttool_fp8_rows_{t}": ([_P, _I64, _P, _P, _P, _I64, _I64, _I64, ctypes.c_uint64, ctypes.c_uint64], _I64)
       for t in ("u16", "u32")},
    **{f"ckpttool_fp8_rows_{t}_plain": ([_P, _I64, _P, _P, _P, _I64, _I64, _I64], None) for t in ("u16", "u32")},
    **{f"ckpttool_fp8_rows_{t}_checked": ([_P, _I64, _P, _P, _P, _I64, _I64, _I64, ctypes.c_uint64], _I64)
       for t in ("u16", "u32")},
    "ckpttool_int4_bf16": ([_P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _P, _I64, _P], _I64),
    "ckpttool_int4_bf16_pairs": ([_P, _I64, _P], None),
    "ckpttool_int4_by_pairs": ([_P, _I64, _P, _P, _I64, _I64, _I64, _I64, _P, _I64], None),
    "ckpttool_distinct16": ([_P, _I64, _P, _P, _P], _I64),
    "ckpttool_f16_tables": ([_P, _I64, _P, _I64, _P, ctypes.c_int32, ctypes.c_int32], None),
    **{f"ckpttool_mxfp4_transposed_{t}": ([_P, _P, _P, _P, _I64, _I64, _I64], None) for t in ("u16", "u32")},
    "ckpttool_mxfp4_transposed_u16_lut": ([_P, _P, _P, _P, _I64, _I64, _I64], ctypes.c_int32),
    **{f"ckpttool_nvfp4_{t}": ([_P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64], None) for t in ("u32", "u64")},
    **{f"ckpttool_grouped_{t}_{w}": ([_P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _I64], None)
       for t in ("u16", "u32", "u64") for w in ("u8", "i32")},
    **{f"ckpttool_grouped_{t}_i32_checked": ([_P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, ctypes.c_uint64], _I64)
       for t in ("u16", "u32")},
    **{f"ckpttool_window_{kind}_{t}": ([_P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _I64], None)
       for t in ("u16", "u32") for kind in ("bytes", "int8", "nibbles")},
    **{f"ckpttool_window_{kind}_gidx_{t}": ([_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _I64], None)
       for t in ("u16", "u32") for kind in ("bytes", "int8", "nibbles")},
    **{f"ckpttool_packed_cols_{t}": ([_P, _I64, _I64, _I64, _I64, ctypes.c_int32, _P, _I64, _P, _P, _P, _P, _I64], None)
       for t in ("u16", "u32")},  # kernels/packed.py (GPTQ, AWQ), which checks their arguments
    **{f"ckpttool_packed_rows_{t}": ([_P, _I64, _I64, _I64, _P, _P, _I64, _P, _P, _P, _I64], None) for t in ("u16", "u32")},
    "ckpttool_fp8_scaled": ([_P, _I64, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, ctypes.c_int32], _I64),
    "ckpttool_int4_lut_bf16": ([_P, _I64, _P, _I64, _P, _I64, _I64, _I64, _I64, ctypes.c_int32, _P, _I64], _I64),
    "ckpttool_simd_level": ([], ctypes.c_int32),
    "ckpttool_ct_gidx": ([_P, _I64, _I64, _I64, ctypes.c_int32, ctypes.c_int32, _P, _I64, _P, _I64, _I64, _P,
                          ctypes.c_int32, ctypes.c_int32, _P, _I64], ctypes.c_int32),
    "ckpttool_packed_f16c_ok": ([], ctypes.c_int32),  # kernels/packed.py's computed loops, which check their arguments
    "ckpttool_packed_lanes": ([_P, _I64, _I64, ctypes.c_int32, _P, _P, ctypes.c_uint32, _I64, _P, ctypes.c_int32, _P,
                               _I64], ctypes.c_int32),
    "ckpttool_packed_shuffled": ([_P, _I64, _I64, _P, _P, ctypes.c_uint32, _I64, ctypes.c_int32, _P, _I64], None),
    "ckpttool_packed_rows8": ([_P, _I64, _I64, _P, _P, _P, _I64, ctypes.c_int32, _P, _I64], None),
    "ckpttool_packed_bcast": ([_P, _I64, _I64, _P, _I64, _P, _I64, _I64, ctypes.c_int32, _P, _I64], None),
    "ckpttool_bnb4_u16": ([_P, _I64, _P, _P, _I64, ctypes.c_int32, ctypes.c_int32, _P], None),
    "ckpttool_bnb4_u32": ([_P, _I64, _P, _P, _I64, _P], None),
    "ckpttool_bnb8": ([_P, _I64, _P, _I64, _I64, ctypes.c_int32, ctypes.c_int32, _P, _I64], None),
    # the quantize stage's compressed-tensors loops (kernels/quant_native.py checks their arguments)
    "ckpttool_quant_int_bf16": ([_P, _I64, _I64, _I64, _I64, ctypes.c_int32, ctypes.c_int32, _P, _I64, _P, _I64, _P,
                                 _I64], _I64),
    "ckpttool_quant_fp4_bf16": ([_P, _I64, _I64, _I64, ctypes.c_int32, ctypes.c_float, _P, _I64, _P, _I64], None),
    "ckpttool_repack_mxfp4_fp8": ([_P, _P, _I64, _I64, _I64, _I64, _P, _P], _I64),  # kernels/repack.py checks
}
_SUFFIX = {np.dtype(np.uint16): "u16", np.dtype(np.uint32): "u32", np.dtype(np.uint64): "u64"}


def library() -> ctypes.CDLL | None:
    """The loaded C library, or None (not built, or CKPTTOOL_NATIVE=0)."""
    if not settings.get("CKPTTOOL_NATIVE"):
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


def _rows(a: np.ndarray, dtype, name: str, shape: tuple[int, int] | None = None) -> int:
    """Row stride of a 2-D `a` of `dtype` (and `shape`, where given) whose columns are contiguous, in elements."""
    if a.ndim != 2 or a.dtype != dtype or (a.shape[1] > 1 and a.strides[1] != a.itemsize) or a.strides[0] % a.itemsize \
            or (shape is not None and a.shape != shape):
        raise ValueError(f"{name}: a 2-D {np.dtype(dtype)} array {shape or ''} with contiguous rows, not "
                         f"{a.dtype} {a.shape} {a.strides}")
    return a.strides[0] // a.itemsize


def _flat(a: np.ndarray, dtype, name: str, size: int | None = None) -> None:
    if a.ndim != 1 or a.dtype != dtype or not a.flags.c_contiguous or (size is not None and a.shape[0] < size):
        raise ValueError(f"{name}: a contiguous 1-D {np.dtype(dtype)} array of at least {size} elements, not "
                         f"{a.dtype} {a.shape}")


def gather(codes: np.ndarray, tables: np.ndarray, out: np.ndarray, shift: int) -> None:
    """out[i, j] = tables[i >> shift, ((j >> shift) << 8) + codes[i, j]], as fp8_gather's numba kernel;
    tables and out are both uint16 or both uint32."""
    fn = getattr(_load(), f"ckpttool_fp8_gather_{_SUFFIX[tables.dtype]}")
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


def f16_tables(values: np.ndarray, scales: np.ndarray, out: np.ndarray, kind: str) -> None:
    """out[i, k] = the fp16 product values[k] * scales[i] in `kind`'s bits (fp8_gather.f16_tables)."""
    n, m = values.shape[0], scales.shape[0]
    word = np.uint32 if kind == "F32" else np.uint16
    for a, dtype, shape in ((values, np.float32, (n,)), (scales, np.float32, (m,)), (out, word, (m, n))):
        if a.dtype != dtype or a.shape != shape or not a.flags.c_contiguous:
            raise ValueError(f"f16_tables: a contiguous {np.dtype(dtype)} {shape}, not {a.dtype} {a.shape}")
    _load().ckpttool_f16_tables(values.ctypes.data, n, scales.ctypes.data, m, out.ctypes.data,
                                {"F16": 0, "BF16": 1, "F32": 2}[kind], simd())


def mxfp4_transposed(blocks: np.ndarray, scales: np.ndarray, table: np.ndarray, out: np.ndarray) -> None:
    """mxfp4_cpu.dequant_transposed in C: blocks uint8 [E, R, G, 16], scales uint8 [E, R, G], the pair table (uint32
    words for 16-bit outputs, uint64 for F32), out [E, G * 32, R] of half a word, all contiguous."""
    experts, rows, groups = scales.shape
    half = {np.dtype(np.uint32): np.uint16, np.dtype(np.uint64): np.uint32}.get(table.dtype)
    for a, dtype, shape in ((blocks, np.uint8, (experts, rows, groups, 16)),
                            (scales, np.uint8, (experts, rows, groups)), (table, table.dtype, (256 * 256,)),
                            (out, half, (experts, groups * 32, rows))):
        if half is None or a.dtype != dtype or a.shape != shape or not a.flags.c_contiguous:
            raise ValueError(f"mxfp4_transposed: a contiguous {dtype} {shape}, not {a.dtype} {a.shape}")
    args = (blocks.ctypes.data, scales.ctypes.data, table.ctypes.data, out.ctypes.data, experts, rows, groups)
    if half is np.uint16 and simd() >= 2 and _load().ckpttool_mxfp4_transposed_u16_lut(*args) == 0:
        return  # 16-bit outputs by byte shuffles (AVX2), the same bits
    getattr(_load(), f"ckpttool_mxfp4_transposed_{_SUFFIX[np.dtype(half)]}")(*args)


# -- scaled_numba.Kernels in C: the same signatures, so kernels/scaled_cpu.py and nvfp4_cpu.py call either --

def _tables_for(which: np.ndarray, count: int) -> None:
    """Every entry of `which` indexes one of `count` tables."""
    if which.size and not (0 <= int(which.min()) and int(which.max()) < count):
        raise ValueError(f"which: table indices outside [0, {count})")


def _fp8_rows_args(codes: np.ndarray, tables: np.ndarray, which: np.ndarray, out: np.ndarray) -> tuple:
    """The arguments fp8_rows and fp8_rows_plain share, checked."""
    rows, cols = codes.shape
    _rows(tables, tables.dtype, "tables", (tables.shape[0], 256))
    _flat(which, np.int32, "which", rows)
    _tables_for(which[:rows], tables.shape[0])
    return (codes.ctypes.data, _rows(codes, np.uint8, "codes"), tables.ctypes.data, which.ctypes.data, out.ctypes.data,
            _rows(out, tables.dtype, "out", (rows, cols)), rows, cols)


def fp8_rows(codes: np.ndarray, tables: np.ndarray, which: np.ndarray, out: np.ndarray, mask: int, inf: int) -> int:
    fn = getattr(_load(), f"ckpttool_fp8_rows_{_SUFFIX[tables.dtype]}")
    return fn(*_fp8_rows_args(codes, tables, which, out), mask, inf)


def fp8_rows_plain(codes: np.ndarray, tables: np.ndarray, which: np.ndarray, out: np.ndarray) -> None:
    getattr(_load(), f"ckpttool_fp8_rows_{_SUFFIX[tables.dtype]}_plain")(*_fp8_rows_args(codes, tables, which, out))


def fp8_rows_checked(codes: np.ndarray, tables: np.ndarray, which: np.ndarray, out: np.ndarray, nan_above: int) -> int:
    """fp8_rows_plain that also finds NaN codes (magnitude above `nan_above`, fp8_cpu.NAN_ABOVE): the first row
    holding one, or -1."""
    fn = getattr(_load(), f"ckpttool_fp8_rows_{_SUFFIX[tables.dtype]}_checked")
    return fn(*_fp8_rows_args(codes, tables, which, out), (0x7F - nan_above) * 0x0101010101010101)


def fp8_scaled(codes: np.ndarray, scales: np.ndarray, out: np.ndarray, b0: int, group: int, kind: int) -> int:
    """fp8_cpu.dequant_scaled in C (native/fp8_scaled.c): e4m3 codes [rows, cols] times float32 scales
    [ceil(rows / b0), ceil(cols / group)] per element into out's words (kind 0-1 uint16, 2-3 uint32). Returns the
    first row holding a NaN code, -1 if none, -2 where the CPU has no AVX2 and F16C (nothing written)."""
    rows, cols = codes.shape
    if b0 < 1 or group < 1 or kind not in (0, 1, 2, 3):
        raise ValueError(f"fp8_scaled: b0 {b0}, group {group}, kind {kind}")
    word = np.uint32 if kind >= 2 else np.uint16
    s_stride = _rows(scales, np.float32, "scales", (-(-rows // b0), -(-cols // group)))
    return _load().ckpttool_fp8_scaled(codes.ctypes.data, _rows(codes, np.uint8, "codes"), scales.ctypes.data, s_stride,
                                       out.ctypes.data, _rows(out, word, "out", (rows, cols)), rows, cols, b0, group,
                                       kind)


def _broadcast_rows(a: np.ndarray, dtype, name: str, shape: tuple[int, int]) -> int:
    """Row stride (elements) of a 2-D `a` of `dtype` and `shape` whose rows may be one row broadcast (stride 0)."""
    if a.dtype != dtype or a.shape != shape or (shape[1] > 1 and a.strides[1] != a.itemsize) or a.strides[0] % a.itemsize:
        raise ValueError(f"{name}: a {np.dtype(dtype)} {shape} array with contiguous rows, not {a.dtype} {a.shape}")
    return a.strides[0] // a.itemsize


def int4_lut_bf16(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, group: int, f16: bool,
                  out: np.ndarray) -> bool:
    """window.dequant's 4-bit rows to BF16 in C (native/fp8_scaled.c): codes [rows, width] bytes, float32 scales and
    int32 offset-binary zero codes [rows, groups] (rows may be broadcast), groups of `group` values (a multiple of
    32) -> out uint16 [rows, 2 * width]. False where the CPU has no AVX2 and F16C (nothing written)."""
    rows, width = codes.shape
    if group < 32 or group % 32 or width * 2 % group:
        raise ValueError(f"int4_lut_bf16: {width} bytes a row in groups of {group}")
    shape = (rows, width * 2 // group)
    s_stride = _broadcast_rows(scales, np.float32, "scales", shape)
    z_stride = _broadcast_rows(zeros, np.int32, "zeros", shape)
    return _load().ckpttool_int4_lut_bf16(codes.ctypes.data, _rows(codes, np.uint8, "codes"), scales.ctypes.data,
                                          s_stride, zeros.ctypes.data, z_stride, rows, shape[1], group, int(f16),
                                          out.ctypes.data, _rows(out, np.uint16, "out", (rows, width * 2))) == 0


def int4_bf16(packed: np.ndarray, scale: np.ndarray, group: int, out: np.ndarray) -> int:
    rows, width = packed.shape
    groups = scale.shape[1] if scale.ndim == 2 else -1
    if groups < 0 or group % 8 or groups * group != width * 8:
        raise ValueError(f"int4_bf16: {groups} groups of {group} for {width} words a row")
    scratch = np.empty(max(groups, 1) * 16, dtype=np.uint32)
    return _load().ckpttool_int4_bf16(packed.ctypes.data, _rows(packed, np.uint32, "packed"), scale.ctypes.data,
                                      _rows(scale, np.float32, "scale", (rows, groups)), rows, width, groups, group,
                                      out.ctypes.data, _rows(out, np.uint32, "out", (rows, width * 4)), scratch.ctypes.data)


def int4_bf16_pairs(scales: np.ndarray, out: np.ndarray) -> None:
    _flat(scales, np.float32, "scales")
    _flat(out, np.uint32, "out", scales.shape[0] * 256)
    _load().ckpttool_int4_bf16_pairs(scales.ctypes.data, scales.shape[0], out.ctypes.data)


def int4_by_pairs(nibbles: np.ndarray, pairs: np.ndarray, which: np.ndarray, half_group: int, out: np.ndarray) -> None:
    rows, half = nibbles.shape
    groups = which.shape[1] if which.ndim == 2 else -1
    if groups < 0 or groups * half_group != half:
        raise ValueError(f"int4_by_pairs: {groups} groups of {half_group} bytes for {half} bytes a row")
    _flat(pairs, np.uint32, "pairs")
    which_stride = _rows(which, np.int32, "which", (rows, groups))
    _tables_for(which, pairs.shape[0] // 256)
    _load().ckpttool_int4_by_pairs(nibbles.ctypes.data, _rows(nibbles, np.uint8, "nibbles"), pairs.ctypes.data,
                                   which.ctypes.data, which_stride, rows, groups, half_group, out.ctypes.data,
                                   _rows(out, np.uint32, "out", (rows, half)))


def distinct16(bits: np.ndarray, values: np.ndarray, which: np.ndarray) -> int:
    _flat(bits, np.uint16, "bits")
    _flat(values, np.uint16, "values", 1 << 16)
    _flat(which, np.int32, "which", bits.shape[0])
    seen = np.empty(1 << 16, dtype=np.int32)
    return _load().ckpttool_distinct16(bits.ctypes.data, bits.shape[0], values.ctypes.data, which.ctypes.data,
                                       seen.ctypes.data)


def nvfp4(packed: np.ndarray, codes: np.ndarray, table: np.ndarray, out: np.ndarray) -> int:
    rows, width = packed.shape
    _flat(table, table.dtype, "table", 256 * 256)
    fn = getattr(_load(), f"ckpttool_nvfp4_{_SUFFIX[table.dtype]}")
    fn(packed.ctypes.data, _rows(packed, np.uint8, "packed"), codes.ctypes.data,
       _rows(codes, np.uint8, "codes", (rows, -(-width // 8))), table.ctypes.data, out.ctypes.data,
       _rows(out, table.dtype, "out", (rows, width)), rows, width)
    return -1


def grouped(codes: np.ndarray, which: np.ndarray, tables: np.ndarray, group: int, out: np.ndarray,
            nan_above: int | None = None) -> int:
    """kernels/grouped.gather in C; which is uint8 or int32 [rows, ceil(width / group)], each entry below
    the number of 256-entry tables (checked here: the C code reads where it is told)."""
    rows, width = codes.shape
    if group < 1:
        raise ValueError(f"group {group}")
    kind = {np.dtype(np.uint8): "u8", np.dtype(np.int32): "i32"}.get(which.dtype)
    if kind is None:
        raise ValueError(f"which: uint8 or int32, not {which.dtype}")
    which_stride = _rows(which, which.dtype, "which", (rows, -(-width // group)))
    _flat(tables, tables.dtype, "tables", 256)
    if which.size and (int(which.max()) >= tables.shape[0] // 256 or int(which.min()) < 0):
        raise ValueError(f"which: indices in [0, {tables.shape[0] // 256})")
    args = (codes.ctypes.data, _rows(codes, np.uint8, "codes"), which.ctypes.data, which_stride, tables.ctypes.data,
            out.ctypes.data, _rows(out, tables.dtype, "out", (rows, width)), rows, width, group)
    if nan_above is not None:  # FP8 codes tested for NaN in the loop: the first row holding one, or -1
        if kind != "i32" or tables.dtype == np.uint64:
            raise ValueError("grouped: NaN codes are tested with int32 `which` and 16- or 32-bit tables")
        return getattr(_load(), f"ckpttool_grouped_{_SUFFIX[tables.dtype]}_i32_checked")(
            *args, (0x7F - nan_above) * 0x0101010101010101)
    getattr(_load(), f"ckpttool_grouped_{_SUFFIX[tables.dtype]}_{kind}")(*args)
    return -1


_BNB_KIND = {"BF16": (0, np.uint16), "F16": (1, np.uint16), "F32": (2, np.uint32)}


def simd() -> int:
    """The instruction sets bnb.c may use: the CPU's (0 none, 1 SSSE3, 2 AVX2), capped by CKPTTOOL_SIMD (read on
    every call, so the tests run each level)."""
    return min(int(_load().ckpttool_simd_level()), settings.get("CKPTTOOL_SIMD"))


def bnb4(packed: np.ndarray, absmax: np.ndarray, code: np.ndarray, blocksize: int, out_dtype: str,
         out: np.ndarray) -> None:
    """kernels/bnb_cpu.dequant_4bit in C: packed [B] bytes -> out [2B] words; absmax covers every block."""
    kind, word = _BNB_KIND[out_dtype]
    _flat(packed, np.uint8, "packed")
    _flat(code, np.float32, "code", 16)
    _flat(out, word, "out", 2 * packed.shape[0])
    if blocksize < 2 or blocksize % 2:
        raise ValueError(f"bnb4: blocksize {blocksize} is not even")
    _flat(absmax, np.float32, "absmax", -(-2 * packed.shape[0] // blocksize))
    args = (packed.ctypes.data, packed.shape[0], absmax.ctypes.data, code.ctypes.data, blocksize)
    if kind == 2:
        _load().ckpttool_bnb4_u32(*args, out.ctypes.data)
    else:
        _load().ckpttool_bnb4_u16(*args, kind, simd(), out.ctypes.data)


def bnb8(codes: np.ndarray, scb: np.ndarray, out_dtype: str, out: np.ndarray) -> None:
    """kernels/bnb_cpu.dequant_int8 in C: int8 codes [rows, K] and scb [rows] -> out [rows, K] words."""
    kind, word = _BNB_KIND[out_dtype]
    rows, width = codes.shape
    _flat(scb, np.float32, "scb", rows)
    _load().ckpttool_bnb8(codes.ctypes.data, _rows(codes, np.int8, "codes"), scb.ctypes.data, rows, width, kind, simd(),
                          out.ctypes.data, _rows(out, word, "out", (rows, width)))


def window(codes: np.ndarray, offsets: np.ndarray, tables: np.ndarray, out: np.ndarray, *, group: int, nibbles: bool,
           flip: int, gidx: np.ndarray | None) -> None:
    """kernels/window.gather in C, every argument checked here (the C code reads where it is told): codes
    uint8 [rows, width], out [rows, width * (2 if nibbles else 1)] of the tables' words, offsets int32
    [rows, groups] whose every entry plus the largest code stays inside the tables, gidx (or None) int32
    [cols] of group indices below `groups`."""
    rows, width = codes.shape
    cols = width * 2 if nibbles else width
    suffix = _SUFFIX.get(tables.dtype)
    if suffix not in ("u16", "u32") or group < 1 or (nibbles and group % 2) or flip not in (0, 0x80) \
            or (nibbles and flip):
        raise ValueError(f"window: tables {tables.dtype}, group {group}, nibbles {nibbles}, flip {flip}")
    _flat(tables, tables.dtype, "tables")
    groups = offsets.shape[1] if offsets.ndim == 2 else -1
    off_stride = _rows(offsets, np.int32, "offsets", (rows, groups))
    if gidx is None and groups != -(-cols // group):
        raise ValueError(f"window: {groups} offsets a row for {cols} columns in groups of {group}")
    if offsets.size and (int(offsets.min()) < 0 or int(offsets.max()) + (15 if nibbles else 255) >= tables.shape[0]):
        raise ValueError(f"window: offsets outside the {tables.shape[0]}-entry tables")
    code_stride, out_stride = _rows(codes, np.uint8, "codes"), _rows(out, tables.dtype, "out", (rows, cols))
    head = (codes.ctypes.data, code_stride, offsets.ctypes.data, off_stride)
    kind = "nibbles" if nibbles else "int8" if flip else "bytes"
    if gidx is not None:
        _flat(gidx, np.int32, "gidx", cols)
        if cols and (int(gidx[:cols].min()) < 0 or int(gidx[:cols].max()) >= groups):
            raise ValueError(f"window: group indices outside [0, {groups})")
        getattr(_load(), f"ckpttool_window_{kind}_gidx_{suffix}")(
            *head, gidx.ctypes.data, tables.ctypes.data, out.ctypes.data, out_stride, rows, width)
        return
    getattr(_load(), f"ckpttool_window_{kind}_{suffix}")(
        *head, tables.ctypes.data, out.ctypes.data, out_stride, rows, width, group)


SCALED = Kernels(fp8_rows, int4_bf16, nvfp4, fp8_rows_plain, int4_bf16_pairs, int4_by_pairs, distinct16)
"""scaled_numba.Kernels in C (the library must be loaded: check `library()` first)"""
