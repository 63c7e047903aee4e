"""Compiled (numba) loops for the compressed-tensors and ModelOpt CPU kernels: the same bits as their
numpy forms in kernels/scaled_cpu.py and kernels/nvfp4_cpu.py (tests/test_quant_kernels.py runs both),
as kernels/fp8_gather.py does for FP8 blocks, and for the same reason: one pass per element without
the GIL instead of several numpy passes. None where numba is missing or CKPTTOOL_NUMBA=0.

- fp8 rows: a 256-entry table per row (or one for the tensor) of rounded products, then a gather;
- int4: per group, the 16 products q * scale rounded once (bf16: integer rounding of the fp32 bits),
  then each byte's two nibbles gathered from them;
- nvfp4: a gather of two-value words from the tensor's pair table.
Each returns the first row whose output holds a NaN (bits above +-inf), or -1.
"""

from __future__ import annotations

import functools

from ckpttool.kernels import fp8_gather


def kernels():
    """(fp8_rows, int4_bf16, nvfp4) compiled, or None (numba missing or CKPTTOOL_NUMBA=0)."""
    if fp8_gather.kernel() is None:  # the same switch and the same numba as the FP8 block gather
        return None
    return _compiled()


@functools.lru_cache(maxsize=None)
def _compiled():
    import numba
    import numpy as np

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def fp8_rows(codes, tables, per_row, out, mask, inf):  # pragma: no cover - compiled
        rows, cols = codes.shape
        m = out.dtype.type(mask)
        for i in range(rows):
            t = tables[i if per_row else 0]
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
    def int4_bf16(packed, scale, group, out):  # pragma: no cover - compiled
        """out: [rows, width] uint32, each word the two bf16 values of one packed byte."""
        rows, width = packed.shape
        f = np.empty(16, dtype=np.float32)
        u = f.view(np.uint32)
        t = np.empty(16, dtype=np.uint32)
        q8 = np.arange(-8, 8).astype(np.float32)
        half = group // 2
        inf = np.uint32(0x7F80)
        m = np.uint32(0x7FFF)
        for i in range(rows):
            p = packed[i]
            o = out[i]
            for g in range(width // half):
                s = scale[i, g]
                for q in range(16):
                    f[q] = q8[q] * s  # exact: a 4-bit integer times a bf16
                nan = False
                for q in range(16):  # round to nearest even on the bits, as kernels/fp8_cpu.round_to_bf16
                    t[q] = (u[q] + np.uint32(0x7FFF) + ((u[q] >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
                    nan |= (t[q] & m) > inf
                k0 = g * half
                for k in range(k0, k0 + half):
                    b = p[k]
                    o[k] = t[b & 15] | (t[b >> 4] << np.uint32(16))
                if nan:  # refused if a NaN entry was written (NaN scale, or an infinite one times 0)
                    for k in range(k0, k0 + half):
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

    return fp8_rows, int4_bf16, nvfp4
