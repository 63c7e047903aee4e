"""Integer codes packed in int32 words with an F16 scale and a zero point per group (GPTQ, AWQ): the tables
and the two gather loops, in C, numba and numpy (the same bits; tests/test_formats_gptq.py runs all three)
and torch on CUDA.

The defining libraries dequantize in fp16: gptqmodel's `scales[g_idx] * (q - zeros[g_idx])`, autoawq's
`(q - z) * scales`, an integer difference times an F16 scale, one fp16 rounding (the fp32 product of an F16
scale and a difference below 2**8 is exact, so fp16(fp32(s) * d) is that rounding), then the cast to the
output dtype: out = round_out(fp16(s * (q - z))). That depends only on the scale and on d = q - z, so each
distinct scale of a chunk gets one table over every d (31 entries for 4 bits, 511 for 8), and each (output
row, group) an offset into it that folds the zero point in: off = table * stride + maxq - z. A code is then
one gather, out[n, k] = tables[off[n, g(k)] + code], wherever the format packs it:

  cols  the codes of output row n along its columns, `per` = 32 / bits to a word, lowest bits first:
        GPTQ's qweight [K / per, N] read transposed (word (r, n) holds columns r * per ..), AWQ GEMV's [N, K / 8]
  rows  the codes of 8 output rows in one word (AWQ GEMM's qweight [K, N / 8]): row c * 8 + m at bits
        shift_of_row[m]; each word loaded once for its 8 rows

g(k) is the group of column k: a group per word where every code of a word shares one (group_of_word),
else one per column (GPTQ's g_idx under desc_act: group_of_col).

Where the C library runs on x86 with AVX2 and F16C (`computed()`), no table is made: the product is computed
eight at a time (VCVTPS2PH is the fp16 rounding), straight from the stored scales and packed zero points, by
`lanes` (GPTQ), `rows8` (AWQ GEMM) and `bcast` (AWQ GEMV): 0.9-1.3x FP8 block per output byte on the 2-core
box where the tables ran 0.15-0.73x (bench/HISTORY.md). The tables serve CKPTTOOL_SIMD < 2, other CPUs, numba
and numpy, and the CUDA path.
"""

from __future__ import annotations

import functools

import numpy as np

from ckpttool.kernels import native, scaled_cpu
from ckpttool.kernels.fp8_cpu import round_to_bf16
from ckpttool.kernels.numba_jit import compiled_on_first_use

_STEP_ELEMENTS = 1 << 20
"""numpy forms: output elements per step (their int64 index temporaries 8 MiB)"""


def carrier(out: str) -> type:
    return np.uint32 if out == "F32" else np.uint16


def stride(bits: int) -> int:
    """Entries a table takes: every d = q - z in [-maxq, maxq], padded to a power of two."""
    return 2 << bits


def tables(scales: np.ndarray, zeros: np.ndarray, bits: int, out: str) -> tuple[np.ndarray, np.ndarray]:
    """(tables, off): one table per distinct F16 scale of `scales` [rows, groups] (uint16 bits), entry
    maxq + d = round_out(fp16(scale * d)), and off [rows, groups] int32 = its table's start + maxq - zero."""
    maxq = (1 << bits) - 1
    values, which = scaled_cpu.distinct(np.ascontiguousarray(scales).view(np.float16))
    d = np.arange(-maxq, maxq + 1, dtype=np.float32)
    width = stride(bits)
    half = np.zeros((values.shape[0], width), dtype=np.float16)
    with np.errstate(over="ignore"):  # beyond fp16's range is +-inf, as in the libraries' fp16 product
        np.multiply(values.astype(np.float32)[:, None], d, out=half[:, : 2 * maxq + 1], casting="same_kind")
    words = from_f16(out)[half.view(np.uint16)]
    off = which.astype(np.int32) * np.int32(width) + (maxq - zeros.astype(np.int32))
    return words.reshape(-1), np.ascontiguousarray(off, dtype=np.int32)


@functools.lru_cache(maxsize=None)
def from_f16(out: str) -> np.ndarray:
    """[65536] output words: each fp16 bit pattern as the output dtype (one rounding for BF16; exact for F16 and
    F32), so a table's fp16 products become output words in one gather."""
    f32 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    if out == "F32":
        lut = f32.view(np.uint32).copy()
    elif out == "F16":
        lut = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    else:
        lut = np.empty(1 << 16, dtype=np.uint16)
        round_to_bf16(f32, lut, np.empty(1 << 16, dtype=np.uint32))
    lut.setflags(write=False)
    return lut


def unpack(words: np.ndarray, bits: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """[..., W] int32 words -> [..., W * per] codes (uint8 for 4/8 bits), code i of each word at bits * i, or,
    with `order`, code i of a word at position order[i] of its group of per (AWQ's interleave)."""
    per = 32 // bits
    shifts = np.arange(per, dtype=np.uint32) * np.uint32(bits)
    if order is not None:
        shifts = shifts[np.argsort(order)]
    codes = (words.view(np.uint32)[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return codes.astype(np.uint8).reshape(*words.shape[:-1], words.shape[-1] * per)


# -- cols --------------------------------------------------------------------------------------------------
def cols(words: np.ndarray, transposed: bool, bits: int, off: np.ndarray, group_of_word: np.ndarray | None,
         group_of_col: np.ndarray, table: np.ndarray, out: np.ndarray) -> str:
    """Fill `out` [rows, K] from `words`: [K / per, rows] if `transposed` (GPTQ) else [rows, K / per]. Returns
    which loops ran: "C", "numba" or "numpy"."""
    per = 32 // bits
    rows, n_words = (words.shape[1], words.shape[0]) if transposed else words.shape
    _check_cols(words, rows, n_words, per, off, group_of_word, group_of_col, table, out)
    n_stride, r_stride = (1, words.shape[1]) if transposed else (words.shape[1], 1)
    lib = native.library()
    if lib is not None:
        fn = getattr(lib, f"ckpttool_packed_cols_{_suffix(table)}")
        fn(words.ctypes.data, n_stride, r_stride, rows, n_words, bits, off.ctypes.data, off.shape[1],
           None if group_of_word is None else group_of_word.ctypes.data, group_of_col.ctypes.data,
           table.ctypes.data, out.ctypes.data, out.strides[0] // out.itemsize)
        return "C"
    loop = _numba_loops()
    if loop is not None:
        flat = words.reshape(-1).view(np.uint32)
        loop[0](flat, n_stride, r_stride, rows, n_words, bits, off, group_of_word is not None,
                group_of_word if group_of_word is not None else group_of_col, group_of_col, table, out)
        return "numba"
    _cols_numpy(words, transposed, bits, off, group_of_col, table, out)
    return "numpy"


def _check_cols(words, rows, n_words, per, off, group_of_word, group_of_col, table, out) -> None:
    """What the C loop takes on trust: shapes, contiguity and every offset + code inside the tables."""
    if words.dtype.itemsize != 4 or words.ndim != 2 or not words.flags.c_contiguous:
        raise ValueError(f"words: a C-contiguous 2-D int32 array, not {words.dtype} {words.shape}")
    if out.shape != (rows, n_words * per) or out.strides[1] != out.itemsize or out.dtype != table.dtype:
        raise ValueError(f"out: {out.dtype} {out.shape}, expected {table.dtype} [{rows}, {n_words * per}]")
    _check_off(off, rows, table, per)
    if group_of_col.shape != (n_words * per,) or group_of_col.dtype != np.int32 or not group_of_col.flags.c_contiguous:
        raise ValueError(f"group_of_col: contiguous int32 [{n_words * per}], not {group_of_col.dtype} {group_of_col.shape}")
    _check_groups(group_of_col, off.shape[1])
    if group_of_word is not None:
        if group_of_word.shape != (n_words,) or group_of_word.dtype != np.int32 or not group_of_word.flags.c_contiguous:
            raise ValueError(f"group_of_word: contiguous int32 [{n_words}], not {group_of_word.shape}")
        _check_groups(group_of_word, off.shape[1])


def _check_off(off: np.ndarray, rows: int, table: np.ndarray, per: int) -> None:
    if off.ndim != 2 or off.shape[0] != rows or off.dtype != np.int32 or not off.flags.c_contiguous:
        raise ValueError(f"off: contiguous int32 [{rows}, groups], not {off.dtype} {off.shape}")
    maxq = (1 << (32 // per)) - 1
    if off.size and (int(off.min()) < 0 or int(off.max()) + maxq >= table.shape[0]):
        raise ValueError(f"off: table offsets outside [0, {table.shape[0] - maxq})")
    if table.ndim != 1 or not table.flags.c_contiguous:
        raise ValueError("table: a contiguous 1-D array")


def _check_groups(groups: np.ndarray, count: int) -> None:
    if groups.size and (int(groups.min()) < 0 or int(groups.max()) >= count):
        raise ValueError(f"group indices outside [0, {count})")


def _suffix(table: np.ndarray) -> str:
    return {np.dtype(np.uint16): "u16", np.dtype(np.uint32): "u32"}[table.dtype]


def _cols_numpy(words, transposed, bits, off, group_of_col, table, out) -> None:
    rows, width = out.shape
    step = max(1, _STEP_ELEMENTS // max(width, 1))
    for n0 in range(0, rows, step):
        n1 = min(rows, n0 + step)
        part = words[:, n0:n1].T if transposed else words[n0:n1]
        codes = unpack(np.ascontiguousarray(part), bits)  # [n1 - n0, K]
        idx = off[n0:n1][:, group_of_col].astype(np.int64)
        idx += codes
        np.take(table, idx, out=out[n0:n1])


# -- rows (AWQ GEMM) ---------------------------------------------------------------------------------------
def rows(words: np.ndarray, shift_of_row: np.ndarray, off: np.ndarray, group_of_col: np.ndarray, table: np.ndarray,
         out: np.ndarray) -> str:
    """Fill `out` [8 * C, K] from 4-bit `words` [K, C]: row c * 8 + m is bits [shift_of_row[m], + 4) of column c;
    the groups are contiguous, K / groups columns each (group_of_col says so, checked)."""
    width, word_cols = words.shape
    if words.dtype.itemsize != 4 or not words.flags.c_contiguous:
        raise ValueError(f"words: a C-contiguous 2-D int32 array, not {words.dtype} {words.shape}")
    if out.shape != (word_cols * 8, width) or out.strides[1] != out.itemsize or out.dtype != table.dtype:
        raise ValueError(f"out: {out.dtype} {out.shape}, expected {table.dtype} [{word_cols * 8}, {width}]")
    if shift_of_row.shape != (8,) or shift_of_row.dtype != np.int32 or set(shift_of_row.tolist()) != set(range(0, 32, 4)):
        raise ValueError(f"shift_of_row: a permutation of the 8 nibbles' shifts, not {shift_of_row}")
    _check_off(off, word_cols * 8, table, 8)
    if group_of_col.shape != (width,) or group_of_col.dtype != np.int32 or not group_of_col.flags.c_contiguous:
        raise ValueError(f"group_of_col: contiguous int32 [{width}], not {group_of_col.dtype} {group_of_col.shape}")
    _check_groups(group_of_col, off.shape[1])
    if width % off.shape[1] or not np.array_equal(group_of_col, contiguous_groups(width, width // off.shape[1])):
        raise ValueError(f"group_of_col: {off.shape[1]} contiguous groups of {width} columns")
    lib = native.library()
    if lib is not None:
        fn = getattr(lib, f"ckpttool_packed_rows_{_suffix(table)}")
        fn(words.ctypes.data, word_cols, word_cols, width, shift_of_row.ctypes.data, off.ctypes.data, off.shape[1],
           group_of_col.ctypes.data, table.ctypes.data, out.ctypes.data, out.strides[0] // out.itemsize)
        return "C"
    loop = _numba_loops()
    if loop is not None:
        loop[1](words.view(np.uint32), shift_of_row, off, group_of_col, table, out)
        return "numba"
    shifts = shift_of_row.astype(np.uint32)
    step = max(1, _STEP_ELEMENTS // max(width * 8, 1))
    for c0 in range(0, word_cols, step):
        c1 = min(word_cols, c0 + step)
        codes = (words[:, c0:c1].view(np.uint32).T[:, None, :] >> shifts[None, :, None]) & np.uint32(15)
        idx = off[c0 * 8:c1 * 8][:, group_of_col].astype(np.int64)
        idx += codes.reshape(-1, width)
        np.take(table, idx, out=out[c0 * 8:c1 * 8])


@compiled_on_first_use
def _numba_loops(numba):
    """numba's forms of the two loops (the C file's, element for element), or None without numba."""

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def cols_loop(words, n_stride, r_stride, rows, n_words, bits, off, by_word, group_of_word, group_of_col,
                  table, out):  # pragma: no cover - compiled
        per = 32 // bits
        mask = np.uint32((1 << bits) - 1)
        for n in range(rows):
            o = off[n]
            d = out[n]
            for r in range(n_words):
                w = words[n * n_stride + r * r_stride]
                if by_word:
                    base = np.int64(o[group_of_word[r]])
                    for j in range(per):
                        d[r * per + j] = table[base + np.int64((w >> np.uint32(bits * j)) & mask)]
                else:
                    for j in range(per):
                        k = r * per + j
                        d[k] = table[np.int64(o[group_of_col[k]]) + np.int64((w >> np.uint32(bits * j)) & mask)]

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def rows_loop(words, shift_of_row, off, group_of_col, table, out):  # pragma: no cover - compiled
        width, word_cols = words.shape
        for c in range(word_cols):
            for m in range(8):
                n = c * 8 + m
                s = np.uint32(shift_of_row[m])
                o = off[n]
                d = out[n]
                for k in range(width):
                    d[k] = table[np.int64(o[group_of_col[k]]) + np.int64((words[k, c] >> s) & np.uint32(15))]

    return cols_loop, rows_loop


# -- computed (C with AVX2 and F16C) ---------------------------------------------------------------------
_KIND = {"F16": 0, "BF16": 1, "F32": 2}


def computed() -> bool:
    """Whether the loops that compute fp16(s * (q - z)) per element run here: the C library with AVX2 and F16C,
    vector instructions not capped below AVX2 (CKPTTOOL_SIMD); else the tables and the loops above."""
    lib = native.library()
    return lib is not None and native.simd() >= 2 and bool(lib.ckpttool_packed_f16c_ok())


def _check_out(out: np.ndarray, kind: str, shape: tuple[int, int]) -> None:
    if out.shape != shape or out.strides[1] != out.itemsize or out.dtype != carrier(kind) or kind not in _KIND:
        raise ValueError(f"out: {out.dtype} {out.shape}, expected {kind}'s carrier {list(shape)}")


def _check(a: np.ndarray, itemsize: int, shape: tuple[int, ...], name: str) -> None:
    if a.dtype.itemsize != itemsize or a.shape != shape or not a.flags.c_contiguous:
        raise ValueError(f"{name}: a C-contiguous {8 * itemsize}-bit array {list(shape)}, not {a.dtype} {a.shape}")


def lanes(words: np.ndarray, bits: int, scales: np.ndarray, zeros: np.ndarray, zero_add: int,
          group_of_col: np.ndarray, kind: str, out: np.ndarray) -> None:
    """GPTQ's layout computed: `out` [N, K] from words [K / per, N], F16 scales [G, N], zero words [G, N / per]
    (each plus `zero_add`, wrapping), column k's group group_of_col[k]."""
    per = 32 // bits
    n_words, rows = words.shape
    groups = scales.shape[0]
    if rows % per:
        raise ValueError(f"words: {rows} rows, not whole zero-point words of {per}")
    _check(words, 4, (n_words, rows), "words")
    _check(scales, 2, (groups, rows), "scales")
    _check(zeros, 4, (groups, rows // per), "zeros")
    _check(group_of_col, 4, (n_words * per,), "group_of_col")
    _check_groups(group_of_col, groups)
    _check_out(out, kind, (rows, n_words * per))
    if native.library().ckpttool_packed_lanes(words.ctypes.data, rows, n_words, bits, scales.ctypes.data,
                                              zeros.ctypes.data, zero_add, groups, group_of_col.ctypes.data,
                                              _KIND[kind], out.ctypes.data, out.strides[0] // out.itemsize):
        raise MemoryError(f"{groups} groups' scales and zero points for the GPTQ loop")


def shuffled(words: np.ndarray, scales: np.ndarray, zeros: np.ndarray, zero_add: int, kind: str,
             out: np.ndarray) -> bool:
    """`lanes` for 4-bit codes in contiguous groups of a multiple of 64 columns, F16 or BF16 out: each (row, group)'s
    16 outputs made once, then looked up by byte shuffles. Returns False (nothing done) where that does not apply."""
    n_words, rows = words.shape
    groups = scales.shape[0]
    if kind not in ("F16", "BF16") or groups == 0 or n_words % groups or (n_words // groups) % 8 or rows % 8:
        return False
    _check(words, 4, (n_words, rows), "words")
    _check(scales, 2, (groups, rows), "scales")
    _check(zeros, 4, (groups, rows // 8), "zeros")
    _check_out(out, kind, (rows, n_words * 8))
    native.library().ckpttool_packed_shuffled(words.ctypes.data, rows, n_words, scales.ctypes.data, zeros.ctypes.data,
                                              zero_add, n_words // groups * 8, _KIND[kind], out.ctypes.data,
                                              out.strides[0] // out.itemsize)
    return True


def rows8(words: np.ndarray, shift_of_row: np.ndarray, scales: np.ndarray, zeros: np.ndarray, kind: str,
          out: np.ndarray) -> None:
    """AWQ GEMM's layout computed: `out` [8 C, K] from 4-bit words [K, C] (row 8c + m at shift_of_row[m]), F16
    scales [G, 8 C], zero words [G, C] packed as the codes; G contiguous groups of K / G columns, a multiple of 8
    unless G is 1 (AWQ's group sizes are)."""
    width, word_cols = words.shape
    groups = scales.shape[0]
    if groups == 0 or width % groups or (groups > 1 and width // groups % 8) or \
            sorted(shift_of_row.tolist()) != list(range(0, 32, 4)):
        raise ValueError(f"{groups} groups of {width} columns (whole blocks of 8, or one), shifts {shift_of_row}")
    _check(words, 4, (width, word_cols), "words")
    _check(shift_of_row, 4, (8,), "shift_of_row")
    _check(scales, 2, (groups, 8 * word_cols), "scales")
    _check(zeros, 4, (groups, word_cols), "zeros")
    _check_out(out, kind, (8 * word_cols, width))
    native.library().ckpttool_packed_rows8(words.ctypes.data, width, word_cols, shift_of_row.ctypes.data,
                                           scales.ctypes.data, zeros.ctypes.data, groups, _KIND[kind],
                                           out.ctypes.data, out.strides[0] // out.itemsize)


def bcast(words: np.ndarray, scales: np.ndarray, zeros: np.ndarray, group: int, kind: str, out: np.ndarray) -> None:
    """AWQ GEMV's layout computed: `out` [N, K] from 4-bit words [N, K / 8], F16 scales [N, >= G] and zero words
    [N, >= G / 8] (group g's zero point at nibble g % 8 of word g // 8), groups of `group` columns, whole words."""
    rows, n_words = words.shape
    count = -(-n_words * 8 // group) if group > 0 else 0
    if group <= 0 or group % 8 or scales.shape[1] < count or zeros.shape[1] < -(-count // 8):
        raise ValueError(f"groups of {group}: {count} of them, scales {scales.shape}, zero words {zeros.shape}")
    _check(words, 4, (rows, n_words), "words")
    _check(scales, 2, (rows, scales.shape[1]), "scales")
    _check(zeros, 4, (rows, zeros.shape[1]), "zeros")
    _check_out(out, kind, (rows, n_words * 8))
    native.library().ckpttool_packed_bcast(words.ctypes.data, rows, n_words, scales.ctypes.data, scales.shape[1],
                                           zeros.ctypes.data, zeros.shape[1], group, _KIND[kind], out.ctypes.data,
                                           out.strides[0] // out.itemsize)


# -- CUDA ------------------------------------------------------------------------------------------------
def gather_torch(codes, off, group_of_col, table):
    """out[n, k] = table[off[n, group_of_col[k]] + codes[n, k]] on a torch device: the CPU's tables, the same
    bits by construction. codes [rows, K] (any integer dtype), off [rows, G], table the CPU's words as signed."""
    import torch

    idx = off.to(torch.int64)[:, group_of_col.to(torch.int64)]
    idx += codes.to(torch.int64)
    return table[idx]


def unpack_torch(words, bits: int, order: tuple[int, ...] | None = None):
    """unpack() on a torch device."""
    import torch

    per = 32 // bits
    shifts = torch.arange(per, device=words.device, dtype=torch.int32) * bits
    if order is not None:
        shifts = shifts[torch.as_tensor(np.argsort(order), device=words.device)]
    codes = torch.bitwise_right_shift(words.to(torch.int32)[..., None], shifts) & ((1 << bits) - 1)
    return codes.reshape(*words.shape[:-1], words.shape[-1] * per)


@functools.lru_cache(maxsize=None)
def contiguous_groups(width: int, group: int) -> np.ndarray:
    """[width] int32: column k's group k // group (read-only, shared)."""
    g = (np.arange(width, dtype=np.int32) // np.int32(group)).astype(np.int32)
    g.setflags(write=False)
    return g
