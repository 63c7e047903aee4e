"""Compiled (numba) loops for the compressed-tensors and ModelOpt CPU kernels: the same bits as their
numpy forms in kernels/scaled_cpu.py and kernels/nvfp4_cpu.py and their C forms in kernels/native/scaled.c,
which come first where setup.py built them (scaled_cpu.compiled; tests/test_quant_formats.py runs all three),
as kernels/fp8_gather.py does for FP8 blocks, and for the same reason: one pass per element without
the GIL instead of several numpy passes. None where numba is missing or CKPTTOOL_NUMBA=0.

- fp8 rows: a 256-entry table of rounded products per distinct scale, then each row's gather from its
  scale's table (fp8_rows_plain, with no NaN test, where every scale is finite and the caller has tested
  the codes: kernels/scaled_cpu.dequant_fp8_rows);
- int4: per row, each group's 16 products q * scale rounded once (bf16: integer rounding of the fp32
  bits), then each int32 word's 8 nibbles gathered from its group's 16 (groups are whole words); or,
  where the scales are finite and few distinct, a 256-entry table of value pairs per distinct scale
  and one lookup per byte (int4_bf16_pairs, int4_by_pairs: kernels/scaled_cpu.dequant_int4);
- nvfp4: a gather of two-value words from the tensor's pair table.
The others return the first row whose output holds a NaN (bits above +-inf), or -1.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from ckpttool.kernels.numba_jit import compiled_on_first_use


class Kernels(NamedTuple):
    fp8_rows: Callable
    int4_bf16: Callable
    nvfp4: Callable
    fp8_rows_plain: Callable
    int4_bf16_pairs: Callable
    int4_by_pairs: Callable
    distinct16: Callable


@compiled_on_first_use
def kernels(numba):
    """The Kernels compiled, or None (numba missing or CKPTTOOL_NUMBA=0)."""

    @numba.njit(inline="always")
    def bf16(u):  # pragma: no cover - compiled
        """fp32 bits -> bf16 bits as kernels/fp8_cpu.round_to_bf16: to nearest even, a NaN kept a NaN."""
        if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
            return (u >> np.uint32(16)) | np.uint32(0x40)
        return (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def fp8_rows(codes, tables, which, out, mask, inf):  # pragma: no cover - compiled
        rows, cols = codes.shape
        m = out.dtype.type(mask)
        for i in range(rows):
            t = tables[which[i]]
            c = codes[i]
            o = out[i]
            worst = out.dtype.type(0)
            for j in range(cols):
                v = t[c[j]]
                o[j] = v
                worst = max(worst, v & m)
            if worst > inf:
                return i
        return -1

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def fp8_rows_plain(codes, tables, which, out):  # pragma: no cover - compiled
        """fp8_rows where the caller has ruled NaN out (finite scales, no NaN code: fp8_gather.nan_row):
        a plain gather, as kernels/fp8_gather.py does for blocks (FP8 per channel on one core of the H100
        machine: 3.52 GB/s of BF16 with it, 2.09-2.46 the session before; 1.06x on the 2-core box)."""
        rows, cols = codes.shape
        for i in range(rows):
            t = tables[which[i]]
            c = codes[i]
            o = out[i]
            for j in range(cols):
                o[j] = t[c[j]]

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def int4_bf16(packed, scale, group, out):  # pragma: no cover - compiled
        """packed: [rows, cols / 8] uint32 words; out: [rows, cols / 2] uint32, each two bf16 values."""
        rows, width = packed.shape
        groups = scale.shape[1]
        f = np.empty(groups * 16, dtype=np.float32)
        u = f.view(np.uint32)
        t = np.empty(groups * 16, dtype=np.uint32)
        words = group // 8
        inf = np.uint32(0x7F80)
        m = np.uint32(0x7FFF)
        for i in range(rows):
            s = scale[i]
            for g in range(groups):  # the row's tables first, in one loop LLVM vectorizes
                for q in range(16):
                    f[g * 16 + q] = np.float32(q - 8) * s[g]  # exact: a 4-bit integer times a bf16
            nan = False
            for k in range(groups * 16):  # round to nearest even on the bits, as kernels/fp8_cpu.round_to_bf16
                t[k] = bf16(u[k])
                nan |= (t[k] & m) > inf
            p = packed[i]
            o = out[i]
            for g in range(groups):
                tg = t[g * 16:g * 16 + 16]
                for k in range(g * words, g * words + words):  # a word's 8 nibbles: 4 output words
                    w = p[k]
                    o[4 * k] = tg[w & 15] | (tg[(w >> 4) & 15] << np.uint32(16))
                    o[4 * k + 1] = tg[(w >> 8) & 15] | (tg[(w >> 12) & 15] << np.uint32(16))
                    o[4 * k + 2] = tg[(w >> 16) & 15] | (tg[(w >> 20) & 15] << np.uint32(16))
                    o[4 * k + 3] = tg[(w >> 24) & 15] | (tg[w >> 28] << np.uint32(16))
            if nan:  # refused if a NaN entry was written (NaN scale, or an infinite one times 0)
                for k in range(width * 4):
                    if (o[k] & m) > inf or ((o[k] >> np.uint32(16)) & m) > inf:
                        return i
        return -1

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def int4_bf16_pairs(scales, out):  # pragma: no cover - compiled
        """Finite fp32 scales [D] -> out [D * 256] uint32: entry (d << 8 | byte) holds the byte's two values
        (low nibble first) times scale d in bf16, each product and rounding exactly as int4_bf16's."""
        f = np.empty(16, dtype=np.float32)
        u = f.view(np.uint32)
        t = np.empty(16, dtype=np.uint32)
        for d in range(scales.shape[0]):
            for q in range(16):
                f[q] = np.float32(q - 8) * scales[d]
            for q in range(16):
                t[q] = bf16(u[q])
            base = d << 8
            for b in range(256):
                out[base + b] = t[b & 15] | (t[b >> 4] << np.uint32(16))

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def int4_by_pairs(nibbles, pairs, which, half_group, out):  # pragma: no cover - compiled
        """nibbles [M, N/2] bytes, `which` [M, G]: each group's distinct scale -> out [M, N/2] uint32, one
        lookup per byte in that scale's pair table (int4_bf16_pairs)."""
        rows = nibbles.shape[0]
        groups = which.shape[1]
        for i in range(rows):
            p = nibbles[i]
            o = out[i]
            w = which[i]
            for g in range(groups):
                tb = pairs[np.int64(w[g]) << 8:(np.int64(w[g]) << 8) + 256]
                pb = p[g * half_group:(g + 1) * half_group]
                ob = o[g * half_group:(g + 1) * half_group]
                for j in range(half_group):
                    ob[j] = tb[pb[j]]

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def distinct16(bits, values, which):  # pragma: no cover - compiled
        """scaled_cpu.distinct for 16-bit scales in one compiled pass each way: the distinct values into
        `values` (ascending), each element's index into them into `which`; returns how many."""
        seen = np.zeros(1 << 16, dtype=np.int32)
        for k in range(bits.shape[0]):
            seen[bits[k]] = 1
        count = 0
        for v in range(1 << 16):
            if seen[v]:
                values[count] = v
                seen[v] = count
                count += 1
        for k in range(bits.shape[0]):
            which[k] = seen[bits[k]]
        return count

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def nvfp4(packed, codes, table, out):  # pragma: no cover - compiled
        rows, width = packed.shape
        for i in range(rows):
            p = packed[i]
            c = codes[i]
            o = out[i]
            for k in range(width):
                o[k] = table[(np.int32(c[k >> 3]) << 8) | np.int32(p[k])]
        return -1

    return Kernels(fp8_rows, int4_bf16, nvfp4, fp8_rows_plain, int4_bf16_pairs, int4_by_pairs, distinct16)
