"""Compiled (numba) loops for the compressed-tensors and ModelOpt CPU kernels: the same bits as their
numpy forms in kernels/scaled_cpu.py and kernels/nvfp4_cpu.py (tests/test_quant_formats.py runs both),
as kernels/fp8_gather.py does for FP8 blocks, and for the same reason: one pass per element without
the GIL instead of several numpy passes. None where numba is missing or CKPTTOOL_NUMBA=0.

- fp8 rows: a 256-entry table of rounded products per distinct scale, then each row's gather from its
  scale's table (fp8_rows_plain, with no NaN test, where every scale is finite and the caller has tested
  the codes: kernels/scaled_cpu.dequant_fp8_rows);
- int4: per row, each group's 16 products q * scale rounded once (bf16: integer rounding of the fp32
  bits), then each int32 word's 8 nibbles gathered from its group's 16 (groups are whole words);
- nvfp4: a gather of two-value words from the tensor's pair table.
The others return the first row whose output holds a NaN (bits above +-inf), or -1.
"""

from __future__ import annotations

import numpy as np

from ckpttool.kernels.numba_jit import compiled_on_first_use


@compiled_on_first_use
def kernels(numba):
    """(fp8_rows, int4_bf16, nvfp4, fp8_rows_plain) compiled, or None (numba missing or CKPTTOOL_NUMBA=0)."""

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
                t[k] = (u[k] + np.uint32(0x7FFF) + ((u[k] >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
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
    def nvfp4(packed, codes, table, out):  # pragma: no cover - compiled
        rows, width = packed.shape
        for i in range(rows):
            p = packed[i]
            c = codes[i]
            o = out[i]
            for k in range(width):
                o[k] = table[(np.int32(c[k >> 3]) << 8) | np.int32(p[k])]
        return -1

    return fp8_rows, int4_bf16, nvfp4, fp8_rows_plain
