"""FP8 128x128 block dequant on the CPU, in numpy: the executor's CPU path, with no torch import.

Out = round(float32(code) * scale[i // 128, j // 128]): the code's exact float32 value (a table
gather), one float32 multiply, one round to nearest even into the output dtype. Those are the IEEE
operations the Triton kernel does, so both devices give the same bits (tests/test_convert.py).
bf16 has no numpy dtype: it is carried as uint16 and rounded with integer arithmetic.

Speed: a gather of two codes at a time from a 65536-entry table, then a few in-place passes over
runs of ~1M elements: 250 Melem/s on one core of the benchmark machine (torch's own fp8 -> fp32
cast alone: 123), 2.1 Gelem/s on 16 threads. The executor runs one chunk per worker thread; numpy
releases the GIL inside each call.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ckpttool.errors import InputError
from ckpttool.dtypes import CARRIERS

BLOCK = 128
OUT_DTYPES = ("BF16", "F16", "F32")
"""the output dtype codes the dequant kernels write (in dtypes.CARRIERS: bf16 as uint16)"""
_STEP_ELEMENTS = 1 << 20
"""elements per step (128 rows of 7168): fewer, larger numpy calls. Every call takes the GIL back,
and with 16-row steps (448 KiB temporaries, in L2) 8 threads ran at 613 Melem/s on the 16-core
benchmark machine against 266 for one; 128-row steps: 249 for one, 1313 for 8, 2098 for 16."""

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


@functools.lru_cache(maxsize=None)
def _pair_values(fmt: str) -> np.ndarray:
    """[65536] uint64: entry (hi << 8 | lo) is the float32 bits of codes lo then hi, so one gather
    of a little-endian uint16 yields two adjacent float32 values."""
    bits = fp8_values(fmt).view(np.uint32).astype(np.uint64)
    i = np.arange(65536)
    return bits[i & 0xFF] | (bits[i >> 8] << np.uint64(32))


def round_to_bf16(x: np.ndarray, out: np.ndarray, tmp: np.ndarray) -> None:
    """float32 -> bfloat16 bits (uint16), round to nearest even: the rounding of torch and of CUDA's
    cvt.rn.bf16.f32. The caller has ruled NaN out (it would need a canonical payload)."""
    u = x.view(np.uint32)
    np.right_shift(u, 16, out=tmp)
    tmp &= 1
    tmp += 0x7FFF
    tmp += u
    tmp >>= 16
    np.copyto(out, tmp, casting="unsafe")


def dequant(codes: np.ndarray, scale: np.ndarray, fmt: str, out_dtype: str, *, block: int = BLOCK) -> np.ndarray:
    """uint8 codes [M, N] and float32 scale [ceil(M/b), ceil(N/b)] -> [M, N] in out_dtype (one of
    OUT_DTYPES). The scale's shape and values are the caller's to check."""
    rows, cols = codes.shape
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"FP8 dequant writes one of {OUT_DTYPES}, not {out_dtype!r}")
    out = np.empty((rows, cols), dtype=CARRIERS[out_dtype])
    pairs = cols % 2 == 0 and codes.strides[1] == 1
    table = _pair_values(fmt) if pairs else fp8_values(fmt)
    sub = max(1, min(rows, max(16, _STEP_ELEMENTS // max(cols, 1))))
    x = np.empty((sub, cols), dtype=np.float32)
    tmp = np.empty((sub, cols), dtype=np.uint32) if out_dtype == "BF16" else None
    whole_blocks = cols % block == 0
    for r0 in range(0, rows, sub):
        r1 = min(rows, r0 + sub)
        n = r1 - r0
        xv = x[:n]
        if pairs:
            np.take(table, codes[r0:r1].view(np.uint16), out=xv.view(np.uint64))
        else:
            np.take(table, codes[r0:r1], out=xv)
        b0 = r0
        while b0 < r1:  # the scale row of each 128-row block in this run
            b1 = min(r1, (b0 // block + 1) * block)
            s = scale[b0 // block]
            part = xv[b0 - r0: b1 - r0]
            if whole_blocks:
                part.reshape(b1 - b0, cols // block, block)[...] *= s[:, None]
            else:
                part *= np.repeat(s, block)[:cols]
            b0 = b1
        if np.isnan(xv).any():
            bad = int(np.flatnonzero(np.isnan(xv).any(axis=1))[0]) + r0
            raise NaNCodes(bad)
        if tmp is not None:
            round_to_bf16(xv, out[r0:r1], tmp[:n])
        else:
            with np.errstate(over="ignore"):  # beyond fp16's range is +-inf, as on the GPU
                np.copyto(out[r0:r1], xv, casting="unsafe")
    return out
