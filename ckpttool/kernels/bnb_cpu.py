"""bitsandbytes' dequantization on the CPU (formats/bnb.py): 4-bit NF4 / FP4 blocks, and LLM.int8() rows.

4-bit, `bitsandbytes.functional.dequantize_4bit` (0.50): the weight, flattened, is cut into blocks of
`blocksize` values that share one fp32 `absmax`; each byte holds two 4-bit codes, the HIGH nibble first.
    out = round(fp32(CODE[q] * absmax[i // blocksize]))
CODE is the library's 16-entry table (`get_4bit_type`: NF4's, or FP4's divided by 12 in fp32; `NF4`, `FP4`
below), one fp32 multiply, one rounding into the output dtype. With double quant (`compress_statistics`) the
absmax is stored as 8-bit codes and rebuilt first, as `dequantize_blockwise` then `absmax += offset` do it:
    absmax[b] = fp32(fp32(nested_quant_map[q8[b]] * nested_absmax[b // nested_blocksize]) + nested_offset)
LLM.int8(), `int8_vectorwise_dequant` (`A * SCB.view(-1, 1) * 7.874015718698502e-3` in torch): per row,
    out = round(fp32(fp32(q * SCB[row]) * fp32(1/127)))
(two fp32 products in that order, the Python constant rounded to fp32 as torch does), then one rounding.

Roundings: BF16 to nearest even (fp8_cpu.round_to_bf16), F16 to nearest even with IEEE subnormals (numpy's
astype), F32 none. bitsandbytes' own kernels disagree with each other in three corners; we follow its table and
its flat blocks: FP4's code 8 is +0.0 in its table and on its AVX-512 path, -0.0 on its scalar path (and, by its
source, in CUDA), times the absmax; its AVX-512-BF16 path flushes a BF16 result below 2**-126 to zero (its torch
and CUDA paths round it, as we do); and where a row is not whole blocks its AVX-512 path reads the absmax of the
wrong block (it indexes absmax per row; its quantizer and its other paths count blocks over the flat weight).

Three forms, the same bits (tests/test_formats_bnb.py runs each against bitsandbytes): C (kernels/native/bnb.c),
numba, numpy. Each 4-bit block's 16 outputs are made once and every byte is two table loads.
"""

from __future__ import annotations

import numpy as np

from ckpttool.kernels import native
from ckpttool.kernels.fp8_cpu import round_to_bf16, value_tables
from ckpttool.kernels.numba_jit import compiled_on_first_use

NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], dtype=np.float32)
FP4 = np.array([0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0],
               dtype=np.float32) / np.float32(12.0)
"""bitsandbytes' get_4bit_type tables (FP4's code 8 is +0.0: `-0` is the integer zero there)"""
CODES = {"nf4": NF4, "fp4": FP4}
INV127 = np.float32(7.874015718698502e-3)
_KIND = {"BF16": 0, "F16": 1, "F32": 2}
_WORD = {"BF16": np.uint16, "F16": np.uint16, "F32": np.uint32}
_STEP = 1 << 20
"""numpy form: output elements per step (its index temporaries 8 MiB)"""


def nested_absmax(q8: np.ndarray, nested_map: np.ndarray, nested: np.ndarray, nested_blocksize: int,
                  offset: np.float32) -> np.ndarray:
    """The fp32 absmax of blocks [0, len(q8)) of a span that starts at a nested block's first block."""
    n = q8.shape[0]
    out = np.take(nested_map, q8)
    full = n // nested_blocksize * nested_blocksize
    whole = out[:full].reshape(-1, nested_blocksize)
    np.multiply(whole, nested[: full // nested_blocksize, None], out=whole)
    if full < n:
        np.multiply(out[full:], nested[full // nested_blocksize], out=out[full:])
    out += np.float32(offset)
    return out


def nested_absmax_finite(q8: np.ndarray, nested_map: np.ndarray, nested: np.ndarray, nested_blocksize: int,
                         offset: np.float32) -> int | None:
    """The first block of the span whose nested_absmax is not finite, or None. Rounding is monotonic, so where
    max|map| * max|nested| + |offset| is finite in fp32 every block's is: only then is nothing computed."""
    with np.errstate(over="ignore", invalid="ignore"):
        bound = np.float32(np.abs(nested_map).max(initial=0) * np.abs(nested).max(initial=0)) + np.abs(np.float32(offset))
        if np.isfinite(bound):
            return None
        bad = np.flatnonzero(~np.isfinite(nested_absmax(q8, nested_map, nested, nested_blocksize, offset)))
    return int(bad[0]) if bad.size else None


def dequant_4bit(packed: np.ndarray, absmax: np.ndarray, code: np.ndarray, blocksize: int, out_dtype: str,
                 into: np.ndarray | None = None) -> np.ndarray:
    """uint8 `packed` [B] (the run's bytes, starting at a block's first) -> [2B] words of `out_dtype`."""
    packed = packed.reshape(-1)
    out = np.empty(2 * packed.shape[0], dtype=_WORD[out_dtype]) if into is None \
        else into.view(_WORD[out_dtype]).reshape(-1)[: 2 * packed.shape[0]]
    absmax = np.ascontiguousarray(absmax, dtype=np.float32)
    if native.library() is not None:
        native.bnb4(packed, absmax, code, blocksize, out_dtype, out)
    elif (loops := _numba()) is not None:
        loops[0](packed, absmax, code, blocksize, _KIND[out_dtype], out, np.empty(16, dtype=out.dtype), _scratch())
    else:
        _numpy_4bit(packed, absmax, code, blocksize, out_dtype, out)
    return out


def dequant_int8(codes: np.ndarray, scb: np.ndarray, out_dtype: str, into: np.ndarray | None = None) -> np.ndarray:
    """int8 `codes` [rows, K] and fp32 `scb` [rows] -> [rows, K] words of `out_dtype`."""
    rows, width = codes.shape
    out = np.empty((rows, width), dtype=_WORD[out_dtype]) if into is None \
        else into.view(_WORD[out_dtype]).reshape(-1)[: rows * width].reshape(rows, width)
    scb = np.ascontiguousarray(scb, dtype=np.float32).reshape(-1)
    if native.library() is not None:
        native.bnb8(codes, scb, out_dtype, out)
    elif (loops := _numba()) is not None:
        loops[1](codes, scb, _KIND[out_dtype], out, np.empty(width, dtype=np.float32), _scratch())
    else:
        _numpy_int8(codes, scb, out_dtype, out)
    return out


def int8_tables(scb: np.ndarray, out_dtype: str) -> np.ndarray:
    """[rows * 256] words: row r's output for code byte b (int8 b), as dequant_int8 computes it (the CUDA form
    gathers these)."""
    codes = np.arange(256, dtype=np.uint8).view(np.int8)
    with np.errstate(over="ignore"):
        prod = np.multiply(codes[None, :], scb.reshape(-1, 1), dtype=np.float32)
        prod *= INV127
    return _round(prod, out_dtype).reshape(-1)


def _round(prod: np.ndarray, out_dtype: str) -> np.ndarray:
    """fp32 products -> output words: the numpy form of every rounding here."""
    if out_dtype == "BF16":
        out = np.empty(prod.shape, dtype=np.uint16)
        round_to_bf16(prod, out, np.empty(prod.shape, dtype=np.uint32))
        return out
    if out_dtype == "F16":
        with np.errstate(over="ignore"):
            return prod.astype(np.float16).view(np.uint16)
    return prod.view(np.uint32)


def _numpy_4bit(packed, absmax, code, blocksize, out_dtype, out) -> None:
    half = blocksize // 2
    step = max(1, _STEP // blocksize) * half  # bytes per step: whole blocks
    for j0 in range(0, packed.shape[0], step):
        p = packed[j0: j0 + step]
        b0 = j0 // half
        tables = value_tables(code, absmax[b0: b0 + -(-p.shape[0] // half)], out_dtype).reshape(-1)
        base = (np.arange(p.shape[0]) // half) * 16
        o = out[2 * j0: 2 * (j0 + p.shape[0])]
        np.take(tables, base + (p >> 4), out=o[0::2], mode="clip")
        np.take(tables, base + (p & 15), out=o[1::2], mode="clip")


def _numpy_int8(codes, scb, out_dtype, out) -> None:
    rows, width = codes.shape
    step = max(1, _STEP // max(width, 1))
    for r0 in range(0, rows, step):
        with np.errstate(over="ignore"):  # beyond fp32 is inf, as in torch
            prod = np.multiply(codes[r0: r0 + step], scb[r0: r0 + step, None], dtype=np.float32)
            prod *= INV127
        out[r0: r0 + step] = _round(prod, out_dtype)


_MAGIC = np.array([((127 - 15) + (23 - 10) + 1) << 23], dtype=np.uint32).view(np.float32)[0]


def _scratch() -> np.ndarray:
    """numba form, one per call (threads run it at once): [0] a float32 cell to view as bits, [1] F16's
    subnormal magic (its rounding is one fp32 addition, as bnb.c's), [2] 1/127 in fp32."""
    return np.array([0.0, _MAGIC, INV127], dtype=np.float32)


@compiled_on_first_use
def _numba(numba):
    """numba's (4-bit, int8) loops, or None where numba is missing or disabled (CKPTTOOL_NUMBA=0)."""

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def word(x, kind, scratch):  # pragma: no cover - compiled; fp32 -> output bits, as bnb.c's roundings
        cell = scratch[0:1]
        bits = cell.view(np.uint32)
        cell[0] = x
        u = np.uint64(bits[0])
        if kind == 2:
            return u
        if kind == 0:
            if (u & np.uint64(0x7FFFFFFF)) > np.uint64(0x7F800000):
                return (u >> np.uint64(16)) | np.uint64(0x40)
            return (u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
        sign = u & np.uint64(0x80000000)
        u = u ^ sign
        if u >= np.uint64(143 << 23):
            o = np.uint64(0x7E00) if u > np.uint64(255 << 23) else np.uint64(0x7C00)
        elif u < np.uint64(113 << 23):
            magic_bits = np.uint64(126 << 23)
            bits[0] = np.uint32(u)
            cell[0] = cell[0] + scratch[1]  # float32 + float32: the rounding is the addition's
            o = np.uint64(bits[0]) - magic_bits
        else:
            o = (u - np.uint64(112 << 23) + np.uint64(0xFFF) + ((u >> np.uint64(13)) & np.uint64(1))) >> np.uint64(13)
        return o | (sign >> np.uint64(16))

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def bnb4(packed, absmax, code, blocksize, kind, out, table, scratch):  # pragma: no cover - compiled
        half = blocksize // 2
        n = packed.shape[0]
        b = 0
        for j0 in range(0, n, half):
            s = absmax[b]
            for k in range(16):
                table[k] = word(code[k] * s, kind, scratch)
            for j in range(j0, min(j0 + half, n)):
                v = packed[j]
                out[2 * j] = table[v >> 4]
                out[2 * j + 1] = table[v & 15]
            b += 1

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def bnb8(codes, scb, kind, out, prod, scratch):  # pragma: no cover - compiled
        rows, width = codes.shape
        inv = scratch[2]
        for i in range(rows):
            s = scb[i]
            for j in range(width):
                prod[j] = np.float32(codes[i, j]) * s
            for j in range(width):
                out[i, j] = word(prod[j] * inv, kind, scratch)

    return bnb4, bnb8
