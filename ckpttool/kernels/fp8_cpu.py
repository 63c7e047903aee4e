"""FP8 128x128 block dequant on the CPU: the executor's CPU path, with no torch import.

Out = round(float32(code) * scale[i // 128, j // 128]): the code's exact float32 value, one float32
multiply, one round to nearest even into the output dtype. Those are the IEEE operations the Triton
kernel does, so both devices give the same bits (tests/test_convert.py). bf16 has no numpy dtype: it
is carried as uint16 and rounded with integer arithmetic.

An FP8 code has 256 values and a block one scale, so each 128x128 block's outputs are a 256-entry
table: the multiply and the rounding run once per (block, code) (for BF16 in one compiled loop,
fp8_gather.bf16_tables, else in numpy), and each element is one gather from a table that stays in
L1. The gather is compiled (kernels/fp8_gather.py: one call per chunk, without the GIL): C where setup.py
built it at install, else numba, else numpy (`np.take` over precomputed indices, about 3x slower than
numba). NaN codes are refused: the compiled paths test the codes first, eight per 64-bit word
(fp8_gather.nan_row); numpy tests the output's bits.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ckpttool.errors import InputError
from ckpttool.dtypes import CARRIERS
from ckpttool.kernels import fp8_gather, native

BLOCK = 128
OUT_DTYPES = ("BF16", "F16", "F32")
"""the output dtype codes the dequant kernels write (in dtypes.CARRIERS: bf16 as uint16)"""

# code -> (exponent bits, mantissa bits, exponent bias, has infinities): OCP FP8 formats
_FORMATS = {"F8_E4M3": (4, 3, 7, False), "F8_E5M2": (5, 2, 15, True)}


class NaNCodes(InputError):
    """An FP8 weight holds NaN codes: a corrupt checkpoint (on either device; the executor adds the
    file and tensor, and turns `row` into the tensor's row). Rejected rather than passed on, as no
    two devices agree on a NaN's bits."""

    def __init__(self, row: int | None = None, **context):
        self.row = row
        where = "" if row is None else f" (first in row {row})"
        super().__init__(f"FP8 weight holds NaN codes{where}", fix="the checkpoint is corrupt; re-download it",
                         **context)


@functools.lru_cache(maxsize=None)
def fp8_values(fmt: str) -> np.ndarray:
    """The float32 value of each of the 256 codes of an FP8 format (exact: every FP8 value is an
    fp32 value). e4m3fn has no infinities: S.1111.111 is NaN; e5m2 follows IEEE."""
    ebits, mbits, bias, has_inf = _FORMATS[fmt]
    top = (1 << ebits) - 1
    values = np.empty(256, dtype=np.float32)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        e, m = (code >> mbits) & top, code & ((1 << mbits) - 1)
        if e == top and (has_inf or m == (1 << mbits) - 1):
            v = (math.inf if m == 0 else math.nan) if has_inf else math.nan
        elif e == 0:
            v = math.ldexp(m, 1 - bias - mbits)
        else:
            v = math.ldexp((1 << mbits) + m, e - bias - mbits)
        values[code] = sign * v
    return values


def round_to_bf16(x: np.ndarray, out: np.ndarray, tmp: np.ndarray) -> None:
    """float32 -> bfloat16 bits (uint16), round to nearest even: the rounding of torch and of CUDA's
    cvt.rn.bf16.f32 for every number. A NaN stays a NaN (sign and top payload bits, made quiet; torch
    would give its canonical one, but every NaN is refused downstream): the 32-bit sum would wrap a NaN
    whose low bits are high (0xFFFF8001 and up, an F16 scale 0xFFFF times anything) to +0.0, which
    nothing could then refuse."""
    u = x.view(np.uint32)
    np.right_shift(u, 16, out=tmp)
    tmp &= 1
    tmp += 0x7FFF
    tmp += u
    tmp >>= 16
    np.copyto(out, tmp, casting="unsafe")
    nan = np.isnan(x)
    if nan.any():
        np.copyto(out, (u >> 16) | 0x40, where=nan, casting="unsafe")


def code_tables(scale: np.ndarray, fmt: str, out_dtype: str) -> np.ndarray:
    """[S0, S1, 256] for scales [S0, S1] (a 128x128 block's each here, a row's in kernels/scaled_cpu.py):
    each scale's 256 outputs in the carrier's bits (uint16 or uint32)."""
    return value_tables(fp8_values(fmt), scale, out_dtype)


def value_tables(values: np.ndarray, scale: np.ndarray, out_dtype: str) -> np.ndarray:
    """[*scale.shape, len(values)]: each fp32 value times each scale in the output carrier's bits,
    computed exactly as the elementwise kernels would: one fp32 product, then the rounding."""
    compiled = fp8_gather.bf16_tables() if out_dtype == "BF16" else None
    if compiled is not None:
        flat = np.ascontiguousarray(scale, dtype=np.float32).reshape(-1)
        out = np.empty((flat.shape[0], len(values)), dtype=np.uint16)
        compiled(np.ascontiguousarray(values, dtype=np.float32), flat, out)
        return out.reshape(*scale.shape, len(values))
    with np.errstate(over="ignore", invalid="ignore"):  # a NaN product is found in the output
        prod = np.multiply(values, scale.astype(np.float32, copy=False)[..., None], dtype=np.float32)
    if out_dtype == "BF16":
        out = np.empty(prod.shape, dtype=np.uint16)
        round_to_bf16(prod, out, np.empty(prod.shape, dtype=np.uint32))
        return out
    if out_dtype == "F16":
        with np.errstate(over="ignore"):  # beyond fp16's range is +-inf, as on the GPU
            return prod.astype(np.float16).view(np.uint16)
    return prod.view(np.uint32)


def library_tables(values: np.ndarray, scale: np.ndarray, scale_dtype: str, out_dtype: str) -> np.ndarray:
    """value_tables as a library that multiplies in its scale's dtype computes them: for F16 scales the fp32
    product (exact for every format here: at most 9 significant bits times 11) is rounded to fp16 first, as
    torch's fp16 multiply does, then cast to the output dtype (a second rounding for BF16). BF16 and F32 scales
    keep the one rounding of value_tables (for a BF16 output that is torch's bf16 multiply; issue 16's rows
    give F16 and F32 outputs the product rounded once, and these rows keep that). Compiled where C or numba is
    (fp8_gather.f16_tables: the same bits)."""
    if scale_dtype != "F16":
        return value_tables(values, scale, out_dtype)
    compiled = fp8_gather.f16_tables()
    if compiled is not None:
        flat = np.ascontiguousarray(scale, dtype=np.float32).reshape(-1)
        out = np.empty((flat.shape[0], len(values)), dtype=np.uint32 if out_dtype == "F32" else np.uint16)
        compiled(np.ascontiguousarray(values, dtype=np.float32), flat, out, out_dtype)
        return out.reshape(*scale.shape, len(values))
    if out_dtype == "F16":
        return value_tables(values, scale, out_dtype)
    f32 = value_tables(values, scale, "F16").view(np.float16).astype(np.float32)
    if out_dtype == "F32":
        return f32.view(np.uint32)
    bits = np.empty(f32.shape, dtype=np.uint16)
    round_to_bf16(f32, bits, np.empty(f32.shape, dtype=np.uint32))
    return bits


def fp8_library_tables(fmt: str, scale: np.ndarray, scale_dtype: str, out_dtype: str) -> np.ndarray:
    """library_tables of an FP8 format's 256 codes times each scale [S] -> [S, 256]. For F16 scales only the 128
    codes without the sign bit are multiplied, rounded twice and turned into output bits: the others are their
    negations, whose products and roundings (to nearest even, overflow included) are the same with the sign flipped,
    so their bits differ in the sign bit alone. Halves the fp16 tables a per-channel scale makes per row."""
    if scale_dtype != "F16":
        return library_tables(fp8_values(fmt), scale, scale_dtype, out_dtype)
    half = np.ascontiguousarray(library_tables(fp8_values(fmt)[:128], scale, scale_dtype, out_dtype))
    sign = half.dtype.type(1 << (8 * half.dtype.itemsize - 1))
    return np.concatenate([half, half ^ sign], axis=-1)


def dequant_scaled(codes: np.ndarray, scale: np.ndarray, fmt: str, scale_dtype: str, out_dtype: str, out: np.ndarray,
                   *, b0: int, group: int) -> bool:
    """Fill `out` [rows, cols] (out_dtype's carrier) with FP8 `codes` times float32 `scale` [ceil(rows / b0),
    ceil(cols / group)] computed per element, each product and rounding as library_tables makes a table entry
    (scale_dtype says the library's multiply), NaN codes refused (NaNCodes) in the same pass: native/fp8_scaled.c's
    AVX2 loops. For BF16 out with BF16/F32/E8M0 scales a lookup of 16 entries per group, about 2x the table gather
    of FP8 block per output byte; else float32 lanes, which beat the tables only where each 1x128 or 1x32 group has
    its own F32 scale. False where it does not run (no C loops, CKPTTOOL_SIMD below 2, no AVX2 and F16C, not e4m3,
    an F16 output, a scale not finite): the caller gathers from tables."""
    if fmt != "F8_E4M3" or out_dtype not in ("BF16", "F32") or native.library() is None or native.simd() < 2 \
            or not codes.size or not np.isfinite(scale).all():
        return False
    kind = (0 if out_dtype == "BF16" else 2) + (scale_dtype == "F16")
    bad = native.fp8_scaled(codes, np.ascontiguousarray(scale, dtype=np.float32), out, b0, group, kind)
    if bad >= 0:
        raise NaNCodes(int(bad))
    return bad == -1


def _nan_above(fmt: str) -> int:
    """The largest code magnitude (code & 0x7F) that is not NaN: every code above it is NaN, in both signs."""
    nan = np.isnan(fp8_values(fmt))
    above = int(np.flatnonzero(nan[:128])[0]) - 1
    assert (nan[:128] == (np.arange(128) > above)).all() and (nan[128:] == nan[:128]).all(), fmt
    return above


NAN_ABOVE = {fmt: _nan_above(fmt) for fmt in _FORMATS}
"""per FP8 format: codes whose magnitude is above this are NaN (e4m3fn: 0x7E; e5m2: 0x7C)"""

INF_BITS = {"BF16": (0x7FFF, 0x7F80), "F16": (0x7FFF, 0x7C00), "F32": (0x7FFFFFFF, 0x7F800000)}
"""(sign mask, bits of +inf) per output dtype: carrier bits whose masked value is above +inf's are a NaN"""


def dequant(codes: np.ndarray, scale: np.ndarray, fmt: str, out_dtype: str, *, block: int = BLOCK,
            out: np.ndarray | None = None) -> np.ndarray:
    """uint8 codes [M, N] and float32 scale [ceil(M/b), ceil(N/b)] -> [M, N] in out_dtype (one of
    OUT_DTYPES), written into `out` (a contiguous uint8 buffer of M * N * itemsize bytes) when given.
    The scale's shape and values are the caller's to check."""
    rows, cols = codes.shape
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"FP8 dequant writes one of {OUT_DTYPES}, not {out_dtype!r}")
    out = (np.empty((rows, cols), dtype=CARRIERS[out_dtype]) if out is None
           else out.view(CARRIERS[out_dtype]).reshape(rows, cols))
    if not out.size:
        return out
    tables = code_tables(scale[: -(-rows // block), : -(-cols // block)], fmt, out_dtype)
    bits = out.view(tables.dtype)
    mask, inf = INF_BITS[out_dtype]
    gather = fp8_gather.kernel() if block & (block - 1) == 0 else None
    if gather is not None:
        bad = fp8_gather.nan_row(codes, NAN_ABOVE[fmt])
        if bad < 0:
            gather(codes, tables.reshape(tables.shape[0], -1), bits, block.bit_length() - 1)
            if not np.isfinite(scale).all():  # an infinite scale times a zero code is NaN too
                bad = fp8_gather.first_nan_row(bits, mask, inf, np.empty_like(bits))
    else:
        bad = fp8_gather.gather_numpy(codes, tables, bits, block, mask, inf)
    if bad >= 0:
        raise NaNCodes(int(bad))
    return out
