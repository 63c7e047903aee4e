"""The grouped table gather: out[i, j] = tables[(which[i, j // group] << 8) | codes[i, j]].

Most published formats are this one loop once their arithmetic is put in tables. An output element depends
only on its code byte and on its group's scale (and zero point), so each distinct scale's 256 outputs are
computed once, exactly as the defining library computes them (kernels/fp8_cpu.value_tables: the product in
fp32, then one rounding), and every element is a gather: FP8 codes with one table per distinct block scale
(FP8 blocks of any size, MXFP8's E8M0 scales, which index their tables directly), or bytes of two 4-bit
codes with a table of value pairs per scale (MXFP4 experts, where the E8M0 exponent is the table index).
Tables stay in L1/L2 (256 entries each), and the loop is one load and one store per element.

Three forms, the same bits (tests/test_quant_formats.py runs all three): C where setup.py built it
(kernels/native/grouped.c), numba where numba is installed, numpy (one np.take over built indices) else.
`which` is uint8 (an E8M0 or FP8 scale code: the tables are indexed by code) or int32 (an index into the
distinct scales).
"""

from __future__ import annotations

import numpy as np

from ckpttool.kernels import native
from ckpttool.kernels.numba_jit import compiled_on_first_use

_STEP_ELEMENTS = 1 << 20
"""numpy form: elements per step, its int32 index temporary 4 MiB (as kernels/mxfp4_cpu.py)"""


def gather(codes: np.ndarray, which: np.ndarray, tables: np.ndarray, group: int, out: np.ndarray) -> str:
    """Fill `out` [rows, width] (the tables' word dtype) from uint8 `codes` [rows, width]; `which` is
    [rows, ceil(width / group)]. Returns which loops ran: "C", "numba" or "numpy"."""
    if native.library() is not None:
        native.grouped(codes, which, tables, group, out)
        return "C"
    loop = _numba_grouped()
    if loop is not None:
        loop(codes, which, tables, group, out)
        return "numba"
    _numpy(codes, which, tables, group, out)
    return "numpy"


def gather_fp8(codes: np.ndarray, which: np.ndarray, tables: np.ndarray, group: int, out: np.ndarray,
               nan_above: int) -> int:
    """gather for FP8 codes with finite tables (int32 `which`): the first row holding a NaN code (magnitude above
    nan_above, fp8_cpu.NAN_ABOVE), or -1 with `out` filled. C tests the codes inside its loop; the other forms in a
    pass first (fp8_gather.nan_row)."""
    if native.library() is not None and which.dtype == np.int32 and tables.dtype != np.uint64:
        return native.grouped(codes, which, tables, group, out, nan_above)
    from ckpttool.kernels.fp8_gather import nan_row

    bad = nan_row(codes, nan_above)
    if bad < 0:
        gather(codes, which, tables, group, out)
    return bad


def _numpy(codes: np.ndarray, which: np.ndarray, tables: np.ndarray, group: int, out: np.ndarray) -> None:
    rows, width = codes.shape
    step = max(1, _STEP_ELEMENTS // max(width, 1))
    group_of = np.arange(width) // group
    idx = np.empty((min(rows, step), width), dtype=np.int64)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        i = idx[: r1 - r0]
        np.left_shift(which[r0:r1][:, group_of], 8, out=i, dtype=np.int64)
        i |= codes[r0:r1]
        np.take(tables, i, out=out[r0:r1], mode="clip")


@compiled_on_first_use
def _numba_grouped(numba):
    """numba's form of the loop, or None where numba is missing or disabled (CKPTTOOL_NUMBA=0)."""

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def grouped(codes, which, tables, group, out):  # pragma: no cover - compiled
        rows, width = codes.shape
        full = width // group
        for i in range(rows):
            w = which[i]
            c = codes[i]
            o = out[i]
            for g in range(full):
                base = np.int64(w[g]) << 8
                for j in range(g * group, (g + 1) * group):
                    o[j] = tables[base | np.int64(c[j])]
            for j in range(full * group, width):
                o[j] = tables[(np.int64(w[full]) << 8) | np.int64(c[j])]

    return grouped


def gather_torch(codes, which, tables, group: int):
    """The same gather on a torch device (CUDA): one indexing of the tables, the same bits as the CPU's
    (an integer gather from the same tables). codes uint8 [rows, width], which uint8/int32, tables the
    CPU's words viewed as signed (torch indexes those everywhere). Returns [rows, width] words."""
    import torch

    rows, width = codes.shape
    groups = which.to(torch.int64).repeat_interleave(group, dim=1)[:, :width]
    return tables[(groups << 8) | codes.to(torch.int64)]
