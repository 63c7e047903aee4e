"""Integer codes with per-group scales and zero points (compressed-tensors' INT4 and INT8 with zero points,
8-bit packing, int-quantized INT8, GPTQ's act-order group index): out = (q - z) * s, rounded as the library
rounds it (kernels/fp8_cpu.library_tables), gathered from tables.

q and z are b-bit integers, so q - z takes 2^(b+1) - 1 values (-15..15 for INT4, -255..255 for INT8): each
distinct scale gets one table of every (q - z) times it, and a group (one scale, one zero point) reads the
window of that table where code c lands on q - z: `offsets[i, g]` = scale's table + 2^b - 1 - zero code, and
out[i, j] = tables[offsets[i, g] + code[i, j]]. Codes are offset binary (q + 2^(b-1), as compressed-tensors packs
them; an int8 byte is made so by `flip` = 0x80) and so are zero codes; a symmetric row's zero code is 2^(b-1). A
tensor's scales take few distinct values, so the tables are small beside its output, and each element is one
gather, as kernels/grouped.py's FP8 loop: bytes (8-bit codes) or nibbles (two 4-bit codes a byte, low first).
With a group index (`gidx`, one group per column: act-order) the group of column j is gidx[j]. F16 and BF16 outputs
of those, and of every 8-bit row (whose tables, 256 or 511 words a scale, leave L1), are computed per element instead
where C runs with AVX2 and F16C (`computed_gidx`, native/ct_gidx.c: eight rows a vector, so that a column's group is
one load for eight outputs; contiguous groups as the index j // group), the same bits.

Three forms, the same bits (tests run all three through the `cpu_kernels` fixture): C where setup.py built it
(kernels/native/window.c), numba where numba is installed, numpy (np.take over built indices) else; and torch on
CUDA (`gather_torch`: the CPU's tables, gathered there).
"""

from __future__ import annotations

import numpy as np

from ckpttool.dtypes import CARRIERS
from ckpttool.kernels import grouped, native
from ckpttool.kernels.fp8_cpu import library_tables
from ckpttool.kernels.numba_jit import compiled_on_first_use

_STEP_ELEMENTS = 1 << 20
"""numpy form: output elements per step (its int64 index temporary 8 MiB)"""


def width(bits: int) -> int:
    """Entries of one scale's table: every q - z of two b-bit integers."""
    return (1 << (bits + 1)) - 1


def tables(scales: np.ndarray, scale_dtype: str, bits: int, out: str) -> np.ndarray:
    """[len(scales) * width(bits)] output words: entry (k * width + d + 2^b - 1) is d * scales[k] (float32
    values of the distinct scales), as the library computes it in `scale_dtype`, in out's carrier."""
    span = (1 << bits) - 1
    diffs = np.arange(-span, span + 1, dtype=np.float32)
    return np.ascontiguousarray(library_tables(diffs, scales.astype(np.float32), scale_dtype, out)).reshape(-1)


def offsets(which: np.ndarray, zero_codes: np.ndarray | int, bits: int) -> np.ndarray:
    """int32 offsets of each group's window: `which` indexes the distinct scales, zero codes are offset binary
    (z + 2^(b-1)), an int for every group or an array broadcast against `which`."""
    base = which.astype(np.int32) * np.int32(width(bits)) + np.int32((1 << bits) - 1)
    return np.ascontiguousarray(base - np.asarray(zero_codes, dtype=np.int32))


def dequant(codes: np.ndarray, scale: np.ndarray, scale_dtype: str, zero_codes: np.ndarray | None, *, bits: int,
            group: int, out: str, flip: int = 0, gidx: np.ndarray | None = None) -> np.ndarray:
    """uint8 codes [rows, width] (bytes, or two 4-bit codes a byte, low first) with scales [rows or 1, groups] (in
    their dtype's carrier) and offset-binary zero codes (broadcast like the scales; None: symmetric) -> [rows, cols]
    in out's carrier. Scales are the caller's to check (finite: bad_row); `gidx` int32 [cols] or None."""
    from ckpttool.kernels.scaled_cpu import distinct, lookup_int4_bf16, scale_f32  # (its INT4 rows need not this)

    rows, cols = codes.shape[0], codes.shape[1] * (2 if bits == 4 else 1)
    if bits == 4 and gidx is None and out == "BF16" and group % 32 == 0 and cols % group == 0 and rows:
        s32 = np.broadcast_to(scale_f32(np.ascontiguousarray(scale), scale_dtype), (rows, cols // group))
        result = lookup_int4_bf16(codes, s32, 8 if zero_codes is None else zero_codes, group, scale_dtype == "F16")
        if result is not None:
            return result.view(CARRIERS[out])
    if (gidx is not None or (bits == 8 and cols and -(-cols // group) == scale.shape[-1])) and out in ("F16", "BF16") and rows \
            and native.library() is not None and native.simd() >= 2:  # 8-bit codes' tables: 256 or 511 words a scale
        gidx = gidx if gidx is not None else (np.arange(cols, dtype=np.int32) // np.int32(group))
        s32 = np.ascontiguousarray(scale_f32(np.ascontiguousarray(scale), scale_dtype))
        zeros = None if zero_codes is None else np.ascontiguousarray(np.broadcast_to(zero_codes, s32.shape), np.int32)
        result = np.empty((rows, cols), dtype=np.uint16)
        if np.isfinite(s32).all() and computed_gidx(codes, bits, flip, s32, zeros, gidx, out, scale_dtype == "F16",
                                                    result):
            return result.view(CARRIERS[out])
    values, which = distinct(np.ascontiguousarray(scale))
    s32 = scale_f32(values, scale_dtype)
    which = np.ascontiguousarray(np.broadcast_to(which, (rows, which.shape[-1])))
    if zero_codes is None and bits == 8:  # one 256-entry table per scale indexed by the byte itself: the FP8 loop
        byte_values = ((np.arange(256) ^ flip) - 128).astype(np.float32)
        table = np.ascontiguousarray(library_tables(byte_values, s32, scale_dtype, out)).reshape(-1)
        result = np.empty((rows, cols), dtype=table.dtype)
        if gidx is None:
            grouped.gather(codes, which, table, group, result)
            return result.view(CARRIERS[out])
        offs, flip = which * np.int32(256), 0
    else:
        table = tables(s32, scale_dtype, bits, out)
        offs = offsets(which, (1 << (bits - 1)) if zero_codes is None else zero_codes, bits)
        result = np.empty((rows, cols), dtype=table.dtype)
    gather(codes, offs, table, result, group=group, nibbles=bits == 4, flip=flip, gidx=gidx)
    return result.view(CARRIERS[out])


def computed_gidx(codes: np.ndarray, bits: int, flip: int, scales: np.ndarray, zeros: np.ndarray | None,
                  gidx: np.ndarray, out: str, f16: bool, result: np.ndarray) -> bool:
    """An act-order row computed per element in C (native/ct_gidx.c), F16 or BF16 out: uint8 codes [rows, width],
    float32 scales and int32 zero codes (or None) [rows or 1, groups], gidx int32 [cols] -> uint16 `result` [rows,
    cols], the bits of the tables. False where the CPU lacks AVX2 and F16C (nothing written)."""
    rows, cols = result.shape
    groups = scales.shape[-1]
    for a, dtype in ((scales, np.float32), (zeros, np.int32)):
        if a is not None and (a.dtype != dtype or a.ndim != 2 or a.shape[0] not in (1, rows) or a.shape[1] != groups
                              or not a.flags.c_contiguous):
            raise ValueError(f"computed_gidx: {a.dtype} {a.shape}, expected {np.dtype(dtype)} [{rows} or 1, {groups}]")
    if codes.dtype != np.uint8 or codes.shape != (rows, cols // 2 if bits == 4 else cols) or codes.strides[1] != 1 \
            or (bits == 4 and (flip or cols % 2)) or bits not in (4, 8) or flip not in (0, 0x80) \
            or result.dtype != np.uint16 or result.strides[1] != 2 or out not in ("F16", "BF16"):
        raise ValueError(f"computed_gidx: codes {codes.dtype} {codes.shape}, bits {bits}, flip {flip}, {out} out")
    gidx = np.ascontiguousarray(gidx, dtype=np.int32)
    if gidx.shape != (cols,) or (cols and not 0 <= int(gidx.min()) <= int(gidx.max()) < groups):
        raise ValueError(f"computed_gidx: group indices {gidx.shape} outside [0, {groups})")
    return native.library().ckpttool_ct_gidx(
        codes.ctypes.data, codes.strides[0], rows, cols, bits, flip, scales.ctypes.data,
        scales.shape[1] if scales.shape[0] > 1 else 0, None if zeros is None else zeros.ctypes.data,
        zeros.shape[1] if zeros is not None and zeros.shape[0] > 1 else 0, groups, gidx.ctypes.data,
        int(out == "BF16"), int(f16), result.ctypes.data, result.strides[0] // 2) == 0


def gather(codes: np.ndarray, offs: np.ndarray, table: np.ndarray, out: np.ndarray, *, group: int, nibbles: bool,
           flip: int = 0, gidx: np.ndarray | None = None) -> str:
    """Fill `out` [rows, cols] (the tables' words) from uint8 `codes` [rows, width] (cols = width, or 2 * width of
    nibbles, low first), int32 `offs` [rows, ceil(cols / group)] (or [rows, groups] indexed by int32 `gidx`
    [cols]). Returns which loops ran: "C", "numba" or "numpy"."""
    if native.library() is not None:
        native.window(codes, offs, table, out, group=group, nibbles=nibbles, flip=flip, gidx=gidx)
        return "C"
    loops = _numba_window()
    if loops is not None:
        if gidx is None:
            (loops[1] if nibbles else loops[0])(codes, offs, table, out, group, np.uint8(flip))
        else:
            (loops[3] if nibbles else loops[2])(codes, offs, gidx, table, out, np.uint8(flip))
        return "numba"
    _numpy(codes, offs, table, out, group, nibbles, flip, gidx)
    return "numpy"


def _numpy(codes, offs, table, out, group: int, nibbles: bool, flip: int, gidx) -> None:
    rows, cols = out.shape
    column_group = gidx if gidx is not None else np.arange(cols) // group
    step = max(1, _STEP_ELEMENTS // max(cols, 1))
    idx = np.empty((min(rows, step), cols), dtype=np.int64)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        i = idx[: r1 - r0]
        np.copyto(i, offs[r0:r1][:, column_group])
        c = codes[r0:r1]
        if nibbles:
            i[:, 0::2] += c & 15
            i[:, 1::2] += c >> 4
        else:
            i += c ^ np.uint8(flip)
        np.take(table, i, out=out[r0:r1], mode="clip")


@compiled_on_first_use
def _numba_window(numba):
    """numba's forms of the four loops (bytes, nibbles, each with contiguous groups or a group index), or None
    where numba is missing or disabled (CKPTTOOL_NUMBA=0)."""

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def by_bytes(codes, offs, table, out, group, flip):  # pragma: no cover - compiled
        rows, cols = codes.shape
        for i in range(rows):
            w, c, o = offs[i], codes[i], out[i]
            for j in range(cols):
                o[j] = table[np.int64(w[j // group]) + np.int64(c[j] ^ flip)]

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def by_nibbles(codes, offs, table, out, group, flip):  # pragma: no cover - compiled
        rows, half = codes.shape
        for i in range(rows):
            w, c, o = offs[i], codes[i], out[i]
            for k in range(half):
                base = np.int64(w[(2 * k) // group])
                o[2 * k] = table[base + np.int64(c[k] & 15)]
                o[2 * k + 1] = table[base + np.int64(c[k] >> 4)]

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def bytes_gidx(codes, offs, gidx, table, out, flip):  # pragma: no cover - compiled
        rows, cols = codes.shape
        for i in range(rows):
            w, c, o = offs[i], codes[i], out[i]
            for j in range(cols):
                o[j] = table[np.int64(w[gidx[j]]) + np.int64(c[j] ^ flip)]

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def nibbles_gidx(codes, offs, gidx, table, out, flip):  # pragma: no cover - compiled
        rows, half = codes.shape
        for i in range(rows):
            w, c, o = offs[i], codes[i], out[i]
            for k in range(half):
                o[2 * k] = table[np.int64(w[gidx[2 * k]]) + np.int64(c[k] & 15)]
                o[2 * k + 1] = table[np.int64(w[gidx[2 * k + 1]]) + np.int64(c[k] >> 4)]

    return by_bytes, by_nibbles, bytes_gidx, nibbles_gidx


def gather_torch(codes, offs, table, *, group: int, nibbles: bool, flip: int = 0, gidx=None):
    """The same gather on a torch device (CUDA): codes uint8 [rows, width], offs int32, table the CPU's words
    viewed as signed, gidx int32 or None; returns [rows, cols] words, the same bits as the CPU's."""
    import torch

    c = codes.to(torch.int64)
    if nibbles:
        c = torch.stack((c & 15, c >> 4), dim=-1).reshape(c.shape[0], -1)
    elif flip:
        c = c ^ flip
    cols = c.shape[1]
    column_group = gidx.to(torch.int64) if gidx is not None else torch.arange(cols, device=c.device) // group
    return table[offs.to(torch.int64)[:, column_group] + c]
