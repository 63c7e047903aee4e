"""compressed-tensors' INT4 (`pack-quantized`) and FP8 (`float-quantized`) dequant on the CPU, in numpy.
No torch import; the Triton kernels (kernels/scaled_triton.py) do the same IEEE operations.

Both are `out = round(fp32(q) * fp32(scale))`: the code's exact value, one fp32 multiply by its
group's (or row's, or tensor's) scale, one round to nearest even into the output dtype. That is
compressed-tensors' own decompression (`dequantize`: `x_q.to(scale.dtype) * scale`, in bf16 for its
bf16 scales: torch multiplies bf16 in fp32 and rounds once), because every INT4 and e4m3 value and
every bf16 scale is exact in fp32 and their product is too (at most 4 + 8 significant bits).

INT4 storage (`pack_to_int32`, num_bits 4): `weight_packed` int32 [M, N/8]; value j of a row is bits
4*(j % 8) .. +3 of word j // 8, stored as q + 8 (so 0..15 is -8..7). On a little-endian host the
uint8 view of the words holds values 2k (low nibble) and 2k+1 (high nibble) in byte k.

Tables: a tensor's BF16 scales take few distinct values (`distinct`), so each distinct scale's outputs
are computed once (kernels/fp8_cpu.value_tables: the product, then the rounding) and every element is a
gather: 256 codes per FP8 scale, and for INT4 256 bytes (two values, one two-element output word) per
scale, so numpy INT4 is one add and one np.take per output word.
"""

from __future__ import annotations

import functools

import numpy as np

from ckpttool.dtypes import CARRIERS
from ckpttool.kernels import native, scaled_numba
from ckpttool.kernels.fp8_gather import first_nan_row, nan_row
from ckpttool.kernels.fp8_cpu import INF_BITS, NAN_ABOVE, NaNCodes, dequant_scaled, fp8_library_tables, \
    round_to_bf16, value_tables
from ckpttool.kernels.mxfp4_cpu import gather_words, pair_words

_STEP_ELEMENTS = 1 << 20  # output elements per step: temporaries of 4 MiB, in L2 (as kernels/fp8_cpu.py)


@functools.lru_cache(maxsize=None)
def _int4_pairs() -> np.ndarray:
    """[256] uint64: byte b -> fp32 bits of (b & 15) - 8, then (b >> 4) - 8."""
    b = np.arange(256)
    lo = ((b & 15) - 8).astype(np.float32).view(np.uint32).astype(np.uint64)
    hi = ((b >> 4) - 8).astype(np.float32).view(np.uint32).astype(np.uint64)
    return lo | (hi << np.uint64(32))


def compiled() -> scaled_numba.Kernels | None:
    """The compiled loops: C where setup.py built them (kernels/native.py), else numba's, else None (numpy).
    CKPTTOOL_NATIVE=0 and CKPTTOOL_NUMBA=0 skip either."""
    return native.SCALED if native.library() is not None else scaled_numba.kernels()


def distinct(scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(each distinct value of `scale` once, in its dtype; int32 [*scale.shape]: each element's index
    into them). 16-bit scales go through a 64 Ki-entry map, two linear passes and no sort. A tensor's
    BF16 scales hold a few hundred to a few thousand distinct values, so one table per distinct value
    is far fewer tables than one per row or group. Compiled where C or numba is (distinct16: numba's took
    0.3 ms against numpy's 2.3 for a [7168, 64] scale on the 2-core box), the same result."""
    if scale.dtype.itemsize == 2 and (loops := compiled()) is not None:
        bits = np.ascontiguousarray(scale).view(np.uint16).reshape(-1)
        values = np.empty(1 << 16, dtype=np.uint16)
        which = np.empty(bits.shape[0], dtype=np.int32)
        count = loops.distinct16(bits, values, which)
        return values[:count].copy().view(scale.dtype), which.reshape(scale.shape)
    if scale.dtype.itemsize != 2:
        values, where = np.unique(scale.view(f"u{scale.dtype.itemsize}"), return_inverse=True)
        return values.view(scale.dtype), where.astype(np.int32).reshape(scale.shape)
    bits = scale.view(np.uint16)
    seen = np.zeros(1 << 16, dtype=bool)
    seen[bits] = True
    values = np.flatnonzero(seen).astype(np.uint16)
    where = np.empty(1 << 16, dtype=np.int32)
    where[values] = np.arange(len(values), dtype=np.int32)
    return values.view(scale.dtype), where[bits]


def scale_f32(scale: np.ndarray, dtype: str) -> np.ndarray:
    """A scale's values as fp32 (exact for BF16, F16 and F32)."""
    if dtype == "BF16":
        return (scale.astype(np.uint32) << 16).view(np.float32)
    return scale.astype(np.float32)


def _scaled(rows: int, cols: int, groups: int, decode, scale: np.ndarray, out: str, *,
            may_nan: bool = True) -> np.ndarray:
    """out[r, c] = round_out(value[r, c] * scale[r, c // (cols // groups)]), in steps of rows:
    decode(r0, r1, f32 view [r1 - r0, cols]) writes the values. A NaN result is refused (NaNCodes);
    may_nan=False (the caller has ruled NaN out) skips that check, two passes over the output."""
    result = np.empty((rows, cols), dtype=CARRIERS[out])
    sub = max(1, min(rows, _STEP_ELEMENTS // max(cols, 1)))
    x = np.empty((sub, cols), dtype=np.float32)
    tmp = np.empty((sub, cols), dtype=np.uint32) if out == "BF16" else None
    for r0 in range(0, rows, sub):
        r1 = min(rows, r0 + sub)
        xv = x[: r1 - r0]
        decode(r0, r1, xv)
        s = scale[r0:r1] if scale.shape[0] == rows else np.broadcast_to(scale, (r1 - r0, groups))
        with np.errstate(over="ignore", invalid="ignore"):  # inf as torch gives it; NaN refused below
            xv.reshape(r1 - r0, groups, cols // groups)[...] *= s[:, :, None]
        if may_nan and np.isnan(xv).any():  # a NaN code or scale (or an infinite scale times zero)
            raise NaNCodes(int(np.flatnonzero(np.isnan(xv).any(axis=1))[0]) + r0)
        if tmp is not None:
            round_to_bf16(xv, result[r0:r1], tmp[: r1 - r0])
        else:
            with np.errstate(over="ignore"):
                np.copyto(result[r0:r1], xv, casting="unsafe")
    return result


def lookup_int4_bf16(nibbles: np.ndarray, s32: np.ndarray, zeros, group: int, f16: bool) -> np.ndarray | None:
    """BF16 words [rows, 2 * width] of 4-bit codes `nibbles` [rows, width] (low first) in groups of `group` (a multiple
    of 32) by a 16-entry lookup per group (native.int4_lut_bf16, AVX2 + F16C): float32 scales `s32` [rows, groups]
    (rows may be broadcast), offset-binary zero codes broadcast to them. None where it does not run (no C loops,
    CKPTTOOL_SIMD below 2, a scale not finite, a zero code outside 0-15): the caller takes its tables."""
    if native.library() is None or native.simd() < 2 or not np.isfinite(s32).all():
        return None
    zeros = np.broadcast_to(np.asarray(zeros, dtype=np.int32), s32.shape)
    if zeros.shape[1] > 1 and zeros.strides[1] != 4:  # one zero code for every group: rows of them
        zeros = np.ascontiguousarray(zeros)
    if zeros.size and not 0 <= zeros.min() <= zeros.max() <= 15:
        return None
    result = np.empty((nibbles.shape[0], 2 * nibbles.shape[1]), dtype=np.uint16)
    return result if native.int4_lut_bf16(nibbles, s32, zeros, group, f16, result) else None


def dequant_int4(packed: np.ndarray, scale: np.ndarray, scale_dtype: str, out: str) -> np.ndarray:
    """int32 packed [M, N/8] and group scales [M, G] -> [M, N] in out's carrier (groups of N / G)."""
    rows = packed.shape[0]
    cols = packed.shape[1] * 8
    nibbles = packed.view(np.uint8).reshape(rows, cols // 2)
    group = cols // scale.shape[1] if scale.shape[1] else 0
    if out == "BF16" and rows and group and group % 32 == 0 and scale.shape[0] == rows:  # 1.3x FP8 block in groups of 32
        s = np.ascontiguousarray(scale_f32(scale, scale_dtype))
        result = lookup_int4_bf16(nibbles, s, np.full((1, s.shape[1]), 8, np.int32), group, scale_dtype == "F16")
        if result is not None:
            return result
    loops = compiled()
    few = None  # (distinct scales as fp32, each group's index) where a table per distinct scale pays
    if scale.dtype.itemsize == 2 and scale.shape[0] == rows and group % 2 == 0 and group * scale.shape[1] == cols \
            and rows:
        values, which = distinct(scale)
        s = scale_f32(values, scale_dtype)
        # finite scales make no NaN (int4 values are finite); the tables cost at most 1/8 of the output
        if np.isfinite(s).all() and len(values) * 256 <= max(rows * cols // 8, 1 << 16):
            few = s, which
    if loops is not None and out == "BF16" and rows and cols and group % 8 == 0:
        result = np.empty((rows, cols), dtype=np.uint16)
        if few is not None:  # one lookup per byte: 1.67x the loop below per output byte on the 2-core box
            pairs = np.empty(len(few[0]) * 256, dtype=np.uint32)
            loops.int4_bf16_pairs(np.ascontiguousarray(few[0], dtype=np.float32), pairs)
            loops.int4_by_pairs(nibbles, pairs, few[1], group // 2, result.view(np.uint32))
            return result
        bad = loops.int4_bf16(packed.view(np.uint32), np.ascontiguousarray(scale_f32(scale, scale_dtype)), group,
                                 result.view(np.uint32))
        if bad >= 0:
            raise NaNCodes(int(bad))
        return result
    if few is not None:
        return _int4_numpy(nibbles, few[0], few[1], out, group)
    table = _int4_pairs()

    def decode(r0: int, r1: int, xv: np.ndarray) -> None:
        np.take(table, nibbles[r0:r1], out=xv.view(np.uint64))

    s = scale_f32(scale, scale_dtype)  # int4 values are finite: only a NaN or infinite scale makes a NaN
    return _scaled(rows, cols, scale.shape[1], decode, s, out, may_nan=not np.isfinite(s).all())


def _int4_numpy(nibbles: np.ndarray, scales: np.ndarray, which: np.ndarray, out: str, group: int) -> np.ndarray:
    """dequant_int4 in numpy for finite scales of few distinct values (fp32 `scales`, `which` indexing
    them per group): each scale's 256 outputs of a byte (two values, one output word of two elements,
    mxfp4_cpu.pair_words), then the same word gather as MXFP4 and NVFP4 (mxfp4_cpu.gather_words). The
    bits of every entry are value_tables', as in the numba loop."""
    rows, half = nibbles.shape
    pairs = pair_words(value_tables(np.arange(-8, 8, dtype=np.float32), scales, out))
    words = gather_words(pairs, nibbles.reshape(rows, half // (group // 2), group // 2), which)
    return words.view(CARRIERS[out]).reshape(rows, half * 2)


def dequant_fp8_rows(codes: np.ndarray, scale: np.ndarray, fmt: str, scale_dtype: str, out: str) -> np.ndarray:
    """uint8 FP8 codes [M, N] and a per-row scale [M, 1] (or one [1] for the tensor) -> [M, N]: each
    distinct scale's 256 outputs computed once (kernels/fp8_cpu's own tables: the fp32 product, then
    the rounding), then each row gathered by code from its scale's table, by a compiled loop or by numpy."""
    rows, cols = codes.shape
    if out == "BF16" and scale_dtype != "F16" and rows and cols:  # computed per element: one lookup per row
        result = np.empty((rows, cols), dtype=np.uint16)
        per_row = scale.size == rows
        if dequant_scaled(codes, scale_f32(scale.reshape(-1, 1), scale_dtype), fmt, scale_dtype, out, result,
                          b0=1 if per_row else rows, group=cols):
            return result
    values, which = distinct(scale.reshape(-1))
    distinct_f32 = scale_f32(values, scale_dtype)
    # the library's product: in fp16 first for F16 scales (fp8_cpu.library_tables)
    tables = np.ascontiguousarray(fp8_library_tables(fmt, distinct_f32, scale_dtype, out)).reshape(-1, 256)
    which = np.broadcast_to(which, (rows,)) if which.shape[0] != rows else which
    result = np.empty((rows, cols), dtype=CARRIERS[out])
    if rows and cols:
        loops = compiled()
        which = np.ascontiguousarray(which)
        if loops is not None and np.isfinite(distinct_f32).all():
            # finite scales: an output is NaN exactly where its code is, so the codes are tested (C: in the gather)
            if loops is native.SCALED:
                bad = native.fp8_rows_checked(codes, tables, which, result.view(tables.dtype), NAN_ABOVE[fmt])
            else:
                bad = nan_row(codes, NAN_ABOVE[fmt])
                if bad < 0:
                    loops.fp8_rows_plain(codes, tables, which, result.view(tables.dtype))
        else:
            gather = loops.fp8_rows if loops is not None else fp8_rows_numpy
            bad = gather(codes, tables, which, result.view(tables.dtype), *INF_BITS[out])
        if bad >= 0:
            raise NaNCodes(int(bad))
    return result


def fp8_rows_numpy(codes: np.ndarray, tables: np.ndarray, which: np.ndarray, out: np.ndarray, mask: int,
                   inf: int) -> int:
    """scaled_numba's fp8_rows in numpy: out[i, j] = tables[which[i], codes[i, j]]; the first row holding
    a NaN (bits above +inf), or -1. One np.take per step of rows, over int64 indices into the rows'
    tables (or over the codes themselves where there is one table). Measured per output byte on the
    2-core box: 0.93-1.02x FP8 block's numpy gather, from 0.59-0.70x with one table per row
    (bench/HISTORY.md); the same bits."""
    rows, cols = codes.shape
    flat = tables.reshape(-1)
    sub = max(1, min(rows, _STEP_ELEMENTS // max(cols, 1)))
    idx = np.empty((sub, cols), dtype=np.intp) if len(tables) > 1 else None
    base = which.astype(np.intp) << 8
    worst = np.empty((sub, cols), dtype=out.dtype)
    for r0 in range(0, rows, sub):
        r1 = min(rows, r0 + sub)
        if idx is not None:
            ix = idx[: r1 - r0]
            np.add(codes[r0:r1], base[r0:r1, None], out=ix)
            np.take(flat, ix, out=out[r0:r1], mode="clip")
        else:
            np.take(flat, codes[r0:r1], out=out[r0:r1], mode="clip")
        bad = first_nan_row(out[r0:r1], mask, inf, worst[: r1 - r0])
        if bad >= 0:
            return r0 + bad
    return -1
