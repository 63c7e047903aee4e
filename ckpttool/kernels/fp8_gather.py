"""The gather of table-driven FP8 dequant (kernels/fp8_cpu.py): out[i, j] = table[i // b, j // b, codes[i, j]].

Three implementations of the same function, the same bits: C (kernels/native.py: built at install where
a compiler is found, loaded in about a millisecond), numba (one compiled loop per chunk, run without the
GIL; its import and cached kernels took 0.4-0.8 s at the start of each run), and numpy (`np.take` over
int64 indices built in one pass, ~3x slower than numba). `kernel()`, `any_over()` and `bf16_tables()`
give the first that is there: `CKPTTOOL_NATIVE=0` skips C, `CKPTTOOL_NUMBA=0` numba. NaN codes are
refused: the compiled paths test the codes before the gather (`nan_row`: with finite scales a NaN
output comes only from a NaN code, and fp8_cpu.dequant tests the output where a scale is not), the
numpy path the output's bits. tests/test_convert.py runs all three against torch.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ckpttool.kernels import native, numba_jit
from ckpttool.kernels.numba_jit import compiled_on_first_use

_STEP_ELEMENTS = 1 << 20
"""numpy path: elements per step, bounding its int64 index temporary to 8 MiB"""


def cpu_loops() -> str:
    """Which form the CPU dequant's loops take in this process: "C", "numba" or "numpy" (neither built:
    about 3x slower than numba). Where C is built, numba is never imported; no kernel is built to tell."""
    if native.library() is not None:
        return "C"
    return "numba" if numba_jit.in_use() else "numpy"


def kernel() -> Callable[[np.ndarray, np.ndarray, np.ndarray, int], None] | None:
    """The compiled gather `(codes, tables, out, shift)`, C or numba, or None (then gather_numpy)."""
    return native.gather if native.library() is not None else _numba_gather()


@compiled_on_first_use
def _numba_gather(numba):
    """numba's gather, or None where numba is missing or disabled (CKPTTOOL_NUMBA=0). It finds no
    NaN: `nan_row` looks at the codes first. Each full block's 2^shift columns are one loop over
    slices of fixed length, the last partial block a loop of its own: on the H100 machine's Xeon the
    loop that also bounded each block by the row's end and folded every output into a NaN test ran
    0.9 GB/s of output per core, about what a 16-worker conversion's transform time showed
    (bench/HISTORY.md)."""

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def gather(codes, tables, out, shift):  # pragma: no cover - compiled
        rows, cols = codes.shape
        blk = 1 << shift
        full = cols >> shift
        for i in range(rows):
            t = tables[i >> shift]
            c = codes[i]
            o = out[i]
            for b in range(full):  # one block's 256-entry table at a time
                tb = t[b << 8:(b << 8) + 256]
                cb = c[b << shift:(b + 1) << shift]
                ob = o[b << shift:(b + 1) << shift]
                for j in range(blk):
                    ob[j] = tb[cb[j]]
            for j in range(full << shift, cols):
                o[j] = t[((j >> shift) << 8) + c[j]]

    return gather


def any_over() -> Callable[[np.ndarray, np.uint64], bool] | None:
    """The compiled test for NaN codes, eight at a time (`nan_row`): C or numba, or None."""
    return native.any_over if native.library() is not None else _numba_any_over()


@compiled_on_first_use
def _numba_any_over(numba):
    """numba's test for NaN codes, or None."""

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def any_over(words, add):  # pragma: no cover - compiled
        acc = np.uint64(0)
        low = np.uint64(0x7F7F7F7F7F7F7F7F)
        for k in range(words.shape[0]):
            acc |= (words[k] & low) + add
        return (acc & np.uint64(0x8080808080808080)) != 0

    return any_over


def nan_row(codes: np.ndarray, nan_above: int) -> int:
    """The first row of uint8 `codes` [M, N] holding a NaN code, or -1. An FP8 format's NaN codes are
    those whose magnitude (code & 0x7F) is above `nan_above` (fp8_cpu.NAN_ABOVE), so adding 0x7F -
    nan_above sets a NaN byte's top bit and no other's: compiled, eight codes per 64-bit word (40 GB/s
    of codes on one core of the 2-core box), then numpy finds the row only if one is there."""
    add = 0x7F - nan_above
    flat = codes.reshape(-1) if codes.flags.c_contiguous else None
    test = any_over() if flat is not None else None
    if test is not None:
        head = min(flat.size, -flat.ctypes.data % 8)
        words = (flat.size - head) // 8
        body = flat[head: head + 8 * words].view(np.uint64)
        rest = np.concatenate((flat[:head], flat[head + 8 * words:]))
        if not test(body, np.uint64(add * 0x0101010101010101)) and not ((rest & 0x7F) > nan_above).any():
            return -1
    bad = ((codes & 0x7F) > nan_above).any(axis=1)
    return int(np.flatnonzero(bad)[0]) if bad.any() else -1


def bf16_tables() -> Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None:
    """The compiled BF16 table builder `(values, scales, out)`, C or numba, or None (then numpy)."""
    if native.library() is not None:
        return native.bf16_tables
    tables = _numba_bf16_tables()
    if tables is None:
        return None
    return lambda values, scales, out: tables(values, scales, np.empty(len(values), dtype=np.float32), out)


@compiled_on_first_use
def _numba_bf16_tables(numba):
    """numba's BF16 table builder (fp8_cpu.value_tables' numpy steps in one loop per scale, no
    temporaries), or None where numba is missing or disabled. Each entry is the same fp32 product of value
    and scale, rounded to nearest even by the same integer arithmetic as fp8_cpu.round_to_bf16 (a NaN
    kept a NaN), so the same bits. On the H100 machine numpy's seven passes (and their temporaries' page
    faults) took 13% of the workers' samples in a 16-worker conversion; with this loop a 32 MiB chunk's
    tables take 36 us against 283 us on the 2-core box, and a conversion RAM to RAM there takes 0.90x the time
    (0.90-1.02x on the H100 machine: bench/HISTORY.md)."""

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def tables(values, scales, prod, out):  # pragma: no cover - compiled
        n = values.shape[0]
        bits = prod.view(np.uint32)
        for i in range(scales.shape[0]):
            s = scales[i]
            for k in range(n):
                prod[k] = values[k] * s  # float32 * float32: one fp32 multiply, as numpy's
            for k in range(n):
                u = np.uint64(bits[k])
                if (u & np.uint64(0x7FFFFFFF)) > np.uint64(0x7F800000):  # NaN stays NaN (round_to_bf16)
                    out[i, k] = np.uint16((u >> np.uint64(16)) | np.uint64(0x40))
                else:
                    out[i, k] = np.uint16((u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16))

    return tables


F16_KINDS = {"F16": 0, "BF16": 1, "F32": 2}


def f16_tables() -> Callable[[np.ndarray, np.ndarray, np.ndarray, str], None] | None:
    """The compiled builder of fp16-product tables `(values, scales, out, out dtype)` (fp8_cpu.library_tables: a
    library that multiplies in fp16), C or numba, or None (then numpy, whose float16 casts took 13 ms for a
    [1024, 256] table on the 2-core box)."""
    if native.library() is not None:
        return native.f16_tables
    tables = _numba_f16_tables()
    return None if tables is None else (lambda values, scales, out, kind: tables(values, scales, out.view(np.uint16)
                                                                                 if kind != "F32" else out, F16_KINDS[kind]))


@compiled_on_first_use
def _numba_f16_tables(numba):
    """numba's fp16-product tables: kernels/native/window.c's ckpttool_f16_tables, the same integer steps."""

    @numba.njit(inline="always")
    def f16_bits(u):  # pragma: no cover - compiled
        sign = (u >> np.uint32(16)) & np.uint32(0x8000)
        ax = u & np.uint32(0x7FFFFFFF)
        if ax > np.uint32(0x7F800000):
            return sign | np.uint32(0x7E00) | ((ax >> np.uint32(13)) & np.uint32(0x3FF))
        if ax >= np.uint32(0x477FF000):
            return sign | np.uint32(0x7C00)
        if ax >= np.uint32(0x38800000):
            r = ax - np.uint32(0x38000000)
            return sign | ((r + np.uint32(0xFFF) + ((r >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13))
        if ax <= np.uint32(0x33000000):
            return sign
        shift = np.uint32(126) - (ax >> np.uint32(23))
        m = (ax & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
        rem = m & ((np.uint32(1) << shift) - np.uint32(1))
        half = np.uint32(1) << (shift - np.uint32(1))
        q = m >> shift
        if rem > half or (rem == half and (q & np.uint32(1))):
            q += np.uint32(1)
        return sign | q

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def tables(values, scales, out, kind):  # pragma: no cover - compiled
        n = values.shape[0]
        prod = np.empty(1, dtype=np.float32)
        bits = prod.view(np.uint32)
        for i in range(scales.shape[0]):
            for k in range(n):
                prod[0] = values[k] * scales[i]
                h = f16_bits(bits[0])
                if kind == 0:
                    out[i, k] = np.uint16(h)
                    continue
                sign, e, m = (h & np.uint32(0x8000)) << np.uint32(16), (h >> np.uint32(10)) & np.uint32(0x1F), \
                    h & np.uint32(0x3FF)
                if e == np.uint32(0x1F):
                    bits[0] = sign | np.uint32(0x7F800000) | (m << np.uint32(13))
                elif e:
                    bits[0] = sign | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13))
                else:  # a subnormal: m * 2**-24, exact
                    prod[0] = np.float32(m) * np.float32(5.9604644775390625e-08)
                    bits[0] |= sign
                if kind == 2:
                    out[i, k] = bits[0]
                    continue
                u = np.uint64(bits[0])
                if (u & np.uint64(0x7FFFFFFF)) > np.uint64(0x7F800000):
                    out[i, k] = np.uint16((u >> np.uint64(16)) | np.uint64(0x40))
                else:
                    out[i, k] = np.uint16((u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16))

    return tables


def gather_numpy(codes: np.ndarray, tables: np.ndarray, out: np.ndarray, block: int, mask: int, inf: int) -> int:
    rows, cols = codes.shape
    base = (np.arange(cols, dtype=np.intp) // block) * 256
    sub = max(1, min(rows, _STEP_ELEMENTS // max(cols, 1)))
    idx = np.empty((sub, cols), dtype=np.intp)
    worst = np.empty((sub, cols), dtype=out.dtype)
    for r0 in range(0, rows, sub):
        r1 = min(rows, r0 + sub)
        n = r1 - r0
        b0 = r0
        while b0 < r1:  # one table per 128-row block
            b1 = min(r1, (b0 // block + 1) * block)
            ix = idx[b0 - r0: b1 - r0]
            np.add(codes[b0:b1], base, out=ix)
            np.take(tables[b0 // block].reshape(-1), ix, out=out[b0:b1], mode="clip")
            b0 = b1
        bad = first_nan_row(out[r0:r1], mask, inf, worst[:n])
        if bad >= 0:
            return r0 + bad
    return -1


def first_nan_row(out: np.ndarray, mask: int, inf: int, worst: np.ndarray) -> int:
    """The first row of `out` (output carrier bits) holding a NaN: bits whose masked value is above
    +inf's; -1 if none. `worst` is scratch of out's shape and dtype."""
    np.bitwise_and(out, mask, out=worst)
    if worst.max() <= inf:
        return -1
    return int(np.flatnonzero((worst > inf).any(axis=1))[0])
