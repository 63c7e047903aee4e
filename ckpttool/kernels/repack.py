"""Exact repacks between quantized formats (numpy): MXFP4 (E2M1 codes, an E8M0 scale per 32 values along a
row) -> FP8 e4m3 codes with one power-of-two (E8M0) scale per b0 x b1 block, and FP8 blocks of one size -> another.

Every MXFP4 value is `m * 2**(s - 127)` with m in {0, 0.5, 1, 1.5, 2, 3, 4, 6}: one or two significant bits. The
block's scale is DeepSeek's ue8m0 rule, `2**ceil(log2(amax / 448))` (1.0 for an all-zero block), so the largest
value lands in [224, 448]; each value divided by it is then an FP8 e4m3 value exactly unless it falls below e4m3's
range (2**-9, subnormals included), which happens only where a group's exponent is 15 or more below the block's
largest. Such a value is never rounded: the block is refused (`Inexact`, naming the block). Since every value is
kept exactly, the repacked weight dequantizes to the very BF16 (or F16, F32) the source does, and the codes and
scales are what an ue8m0 FP8 block quantizer computes from that BF16.

All arithmetic is in float32, where every value here is exact: E2M1 times a power of two down to 2**-128
(subnormal, still exact), and a quotient either an e4m3 value (exact) or flagged.
"""

from __future__ import annotations

import functools

import numpy as np

from ckpttool.kernels import native
from ckpttool.kernels.fp8_cpu import fp8_values

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
FP8_MAX = 448.0


class Inexact(ValueError):
    """A value the target format cannot hold exactly: (block row, block column) of the run given, or (expert,
    block row, block column) of stacked experts."""

    def moved(self, rows: int) -> "Inexact":
        """The same, `rows` block rows (stacked: experts) further down (the run began there)."""
        return Inexact((self.block[0] + rows, *self.block[1:]), self.value, self.scale_exp, self.why)

    def __init__(self, block: tuple[int, ...], value: float, scale_exp: int, why: str = ""):
        self.block, self.value, self.scale_exp, self.why = block, value, scale_exp, why
        super().__init__(f"block {list(block)} " + (why or f"holds {value!r}, which FP8 e4m3 with the block's scale "
                                                         f"2**{scale_exp} cannot represent exactly"))


@functools.lru_cache(maxsize=None)
def _positive_e4m3() -> np.ndarray:
    """The 127 non-negative finite e4m3 values, ascending (code k is entry k)."""
    return fp8_values("F8_E4M3")[:127].copy()


def mxfp4_values(packed: np.ndarray, e8m0: np.ndarray) -> np.ndarray:
    """[R, K/2] bytes (two E2M1 codes, low nibble first) and [R, K/32] E8M0 -> the exact values, float32 [R, K]
    (a code with its sign bit and magnitude 0 is -0.0, as the source dequantizes it)."""
    b = packed.view(np.uint8)
    rows = b.shape[0]
    codes = np.empty((rows, b.shape[1] * 2), dtype=np.uint8)
    codes[:, 0::2], codes[:, 1::2] = b & 0x0F, b >> 4
    mag = E2M1[codes & 7]
    signed = np.where(codes & 8, -mag, mag)
    scale = np.ldexp(np.float32(1.0), e8m0.view(np.uint8).astype(np.int32) - 127).astype(np.float32)
    return (signed.reshape(rows, -1, 32) * scale[:, :, None]).reshape(rows, -1)


def mxfp4_to_fp8(packed: np.ndarray, e8m0: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """[R, K/2] MXFP4 bytes and [R, K/32] E8M0 -> (FP8 codes [R, K], scale exponents of `block`):
    `fp8_codes(v, block_exponents(v, block), block)` of `v = mxfp4_values(...)`, by kernels/native/quant.c's loop
    where it is built (the same codes, exponents and first Inexact; tests/test_repack.py), else numpy."""
    lib = native.library()
    if lib is None:
        values = mxfp4_values(packed, e8m0)
        exps = block_exponents(values, block)
        return fp8_codes(values, exps, block), exps
    b = np.ascontiguousarray(packed.view(np.uint8))
    s = np.ascontiguousarray(e8m0.view(np.uint8))
    rows, cols = b.shape[0], b.shape[1] * 2
    if b.ndim != 2 or s.shape != (rows, cols // 32) or cols % 32:
        raise ValueError(f"mxfp4_to_fp8: bytes [R, K/2] and E8M0 [R, K/32], not {b.shape} and {s.shape}")
    codes = np.empty((rows, cols), dtype=np.uint8)
    exps = np.empty((-(-rows // block[0]), -(-cols // block[1])), dtype=np.int32)
    bad = lib.ckpttool_repack_mxfp4_fp8(b.ctypes.data, s.ctypes.data, rows, cols, block[0], block[1],
                                        codes.ctypes.data, exps.ctypes.data)
    if bad == -2:
        raise MemoryError(f"mxfp4_to_fp8: no memory for a block row of {min(block[0], rows)} x {cols} floats")
    if bad >= 0:
        i, j = divmod(int(bad), cols)
        value = float(mxfp4_values(b[i:i + 1], s[i:i + 1])[0, j])
        raise Inexact((i // block[0], j // block[1]), value, int(exps[i // block[0], j // block[1]]))
    return codes, exps


def mxfp4_stacked_to_fp8(blocks: np.ndarray, e8m0: np.ndarray, block: tuple[int, int]
                         ) -> tuple[np.ndarray, np.ndarray]:
    """gpt-oss's stacked MXFP4 experts, [E, R, G, 16] bytes and [E, R, G] E8M0 (each expert an [R, G*32] weight
    stored by output rows) -> (FP8 codes [E, R, G*32], scale exponents [E, ceil(R/b0), ceil(G*32/b1)]): every expert
    on its own, as `mxfp4_values` + `block_exponents` + `fp8_codes`; Inexact names (expert, block row, column)."""
    experts, rows = blocks.shape[:2]
    cols = blocks.shape[2] * blocks.shape[3] * 2
    codes = np.empty((experts, rows, cols), dtype=np.uint8)
    exps = np.empty((experts, -(-rows // block[0]), -(-cols // block[1])), dtype=np.int32)
    for e in range(experts):
        try:
            codes[e], exps[e] = mxfp4_to_fp8(blocks[e].reshape(rows, -1), e8m0[e], block)
        except Inexact as exc:
            raise Inexact((e, *exc.block), exc.value, exc.scale_exp, exc.why) from None
    return codes, exps


def fp8_block_values(codes: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """FP8 e4m3 codes [R, K] times their block's power-of-two scale (float32 [ceil(R/b0), ceil(K/b1)]): exact."""
    b0, b1 = block
    vals = fp8_values("F8_E4M3")[codes.view(np.uint8)]
    full = np.repeat(np.repeat(scale, b0, 0)[: codes.shape[0]], b1, 1)[:, : codes.shape[1]]
    return vals * full


def _blocks(x: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """[R, K] -> [R/b0, b0, K/b1, b1], zero-padded to whole blocks."""
    b0, b1 = block
    r, k = x.shape
    pr, pk = -(-r // b0) * b0, -(-k // b1) * b1
    if (pr, pk) != (r, k):
        x = np.pad(x, ((0, pr - r), (0, pk - k)))
    return x.reshape(pr // b0, b0, pk // b1, b1)


def block_exponents(values: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """Each block's scale exponent: ceil(log2(amax / 448)), 0 for an all-zero block, within E8M0's [-127, 127]."""
    amax = np.abs(_blocks(values, block)).max(axis=(1, 3))
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(amax.astype(np.float64) / FP8_MAX))
    return np.clip(np.where(amax > 0, e, 0), -127, 127).astype(np.int32)


def fp8_codes(values: np.ndarray, exps: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """The e4m3 codes of values / 2**exp per block, or Inexact for the first block holding a value they cannot."""
    b0, b1 = block
    r, k = values.shape
    scale = np.ldexp(np.float32(1.0), exps).astype(np.float32)
    full = np.repeat(np.repeat(scale, b0, 0)[:r], b1, 1)[:, :k]
    q = values / full
    table = _positive_e4m3()
    mag = np.abs(q)
    idx = np.minimum(np.searchsorted(table, mag), len(table) - 1)
    bad = table[idx] != mag
    if bad.any():
        i, j = (int(v) for v in np.argwhere(bad)[0])
        raise Inexact((i // b0, j // b1), float(values[i, j]), int(exps[i // b0, j // b1]))
    return (idx.astype(np.uint8) | np.where(np.signbit(q), np.uint8(0x80), np.uint8(0))).astype(np.uint8)


def _grid(scale: np.ndarray, block: tuple[int, int], shape: tuple[int, int]) -> np.ndarray:
    """A per-block array repeated over each block's elements, cut to `shape`."""
    return np.repeat(np.repeat(scale, block[0], 0)[: shape[0]], block[1], 1)[:, : shape[1]]


def is_pow2(x: np.ndarray) -> np.ndarray:
    m, _ = np.frexp(x)
    return m == 0.5


def fp8_regroup_pow2(codes: np.ndarray, scale: np.ndarray, src: tuple[int, int], dst: tuple[int, int]
                     ) -> tuple[np.ndarray, np.ndarray]:
    """FP8 codes under power-of-two scales of `src` blocks -> (codes, scale exponents) of `dst` blocks, each scale
    DeepSeek's ue8m0 rule of the block's exact values. A source scale that is not a power of two is refused."""
    if not is_pow2(scale).all():
        i, j = (int(v) for v in np.argwhere(~is_pow2(scale))[0])
        raise Inexact((i * src[0] // dst[0], j * src[1] // dst[1]), float(scale[i, j]), 0,
                      f"has a source scale {float(scale[i, j])!r}, not a power of two (scale_fmt ue8m0 says it is)")
    values = fp8_values("F8_E4M3")[codes.view(np.uint8)] * _grid(scale.astype(np.float32), src, codes.shape)
    exps = block_exponents(values, dst)
    return fp8_codes(values, exps, dst), exps


def fp8_regroup_float(codes: np.ndarray, scale: np.ndarray, src: tuple[int, int], dst: tuple[int, int]
                      ) -> tuple[np.ndarray, np.ndarray]:
    """FP8 codes under float scales of `src` blocks -> (codes, F32 scales) of `dst` blocks: each new scale the
    largest source scale its block covers, each code rescaled by its source scale's ratio to it, which must be a
    power of two leaving the code an e4m3 value (splitting a block: ratio 1, the codes unchanged)."""
    shape = codes.shape
    grid = _grid(scale.astype(np.float32), src, shape)
    new = np.abs(_blocks(grid, dst)).max(axis=(1, 3)).astype(np.float32)
    ratio = grid / _grid(new, dst, shape)
    q = fp8_values("F8_E4M3")[codes.view(np.uint8)] * ratio
    table = _positive_e4m3()
    mag = np.abs(q)
    idx = np.minimum(np.searchsorted(table, mag), len(table) - 1)
    bad = (table[idx] != mag) | (~is_pow2(ratio) & (mag != 0))
    if bad.any():
        i, j = (int(v) for v in np.argwhere(bad)[0])
        raise Inexact((i // dst[0], j // dst[1]), float(q[i, j]), 0,
                      f"mixes source scales whose ratio {float(ratio[i, j])!r} is not a power of two the codes can "
                      "absorb exactly")
    return (idx.astype(np.uint8) | np.where(np.signbit(q), np.uint8(0x80), np.uint8(0))).astype(np.uint8), new


# -- NVFP4: ModelOpt (S2 multiplies) <-> compressed-tensors (G divides) -----------------------------------------
def nvfp4_codes(packed: np.ndarray, to_variant: str) -> np.ndarray:
    """E2M1 bytes for the other library: the same codes, but ModelOpt's code 8 (its +0.0) becomes code 0 for
    compressed-tensors, whose code 8 is -0.0. (Into ModelOpt the bytes stay: its code 8 is +0.0, so a
    compressed-tensors -0.0 becomes +0.0, the one value ModelOpt's format cannot hold.)"""
    b = packed.view(np.uint8)
    if to_variant != "compressed-tensors":
        return b.copy()
    lo, hi = b & 0x0F, b >> 4
    lo = np.where(lo == 8, 0, lo)
    hi = np.where(hi == 8, 0, hi)
    return (lo | (hi << 4)).astype(np.uint8)


def _nvfp4_outputs(variant: str, g: float, used: np.ndarray) -> np.ndarray:
    """Each used scale code's seven non-zero E2M1 magnitudes dequantized as the variant's library does (one fp32
    multiply by its block scale), rounded to BF16 and to F16: uint16 [len(used), 14]."""
    from ckpttool.kernels.fp8_cpu import round_to_bf16
    from ckpttool.kernels.nvfp4_cpu import block_scales

    with np.errstate(over="ignore", invalid="ignore"):
        f32 = (E2M1[1:][None, :] * block_scales(variant, g)[used][:, None]).astype(np.float32)
        bf16 = np.empty(f32.shape, dtype=np.uint16)
        round_to_bf16(f32, bf16, np.empty(f32.shape, dtype=np.uint32))
        return np.concatenate([bf16, f32.astype(np.float16).view(np.uint16)], axis=1)


def nvfp4_global(codes: np.ndarray, src_variant: str, src_global: float, dst_variant: str
                 ) -> tuple[np.float32, None] | tuple[None, int]:
    """The other library's per-tensor scale under which every value of the weight dequantizes to the same BF16 and
    F16 as the source's (its fp32 block scale may differ in the last bit: one library divides by the per-tensor
    scale, the other multiplies by its inverse): (scale, None), or (None, the first scale code no candidate
    serves). Candidates: 1 / the source's, then its float32 neighbours, nearest first."""
    used = np.unique(codes.view(np.uint8))
    used = used[(used & 0x7F) != 0x7F]
    want = _nvfp4_outputs(src_variant, src_global, used)
    first = np.float32(1.0 / np.float64(src_global))
    up, down = first, first
    worst = None
    for k in range(65):
        for x in ((first,) if k == 0 else (up, down)):
            bad = np.flatnonzero((_nvfp4_outputs(dst_variant, float(x), used) != want).any(axis=1))
            if not bad.size:
                return np.float32(x), None
            worst = int(used[bad[0]]) if worst is None else worst
        up, down = np.nextafter(up, np.float32(np.inf)), np.nextafter(down, np.float32(0))
    return None, worst
