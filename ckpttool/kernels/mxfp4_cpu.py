"""MXFP4 dequant on the CPU, in numpy, and the pair table both devices gather from (see
kernels/mxfp4.py for the format and why a table gives the same bits everywhere). No torch import.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ckpttool.dtypes import CARRIERS
from ckpttool.kernels import native
from ckpttool.kernels.fp8_cpu import OUT_DTYPES, round_to_bf16  # noqa: F401 - OUT_DTYPES re-exported
from ckpttool.kernels.numba_jit import compiled_on_first_use

VALUES_PER_BLOCK = 32
BYTES_PER_BLOCK = 16
SCALE_BIAS = 127
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_ROWS_PER_STEP = 1 << 14
"""groups of 16 bytes per gather: a 1 MiB int32 index temporary, which stays in L2. 16 MiB steps (1 << 18)
ran at half the speed: 82 vs 40 ms for 4 gpt-oss experts (1 core, bench machine of 2026-11-23), and
NVFP4 (kernels/nvfp4_cpu.py) 47 vs 16 ms for [7168, 2048]."""


@functools.lru_cache(maxsize=None)
def value_bits(out: str) -> np.ndarray:
    """[256 scales, 16 codes]: the bits of every dequantized (e8m0 scale, e2m1 code), exactly as
    transformers computes them. math.ldexp in float64 is exact for all 4096 products (|value| <=
    6 * 2**128); the cast to float32 rounds only where fp32 overflows (>= 2**128 -> inf), which
    bf16/fp16 would too, and the cast on to the output dtype is one RNE rounding of the exact value."""
    exact = np.array([[math.ldexp(v, s - SCALE_BIAS) for v in E2M1_VALUES] for s in range(256)])
    with np.errstate(over="ignore"):
        f32 = exact.astype(np.float32)
        if out == "F32":
            return f32.view(np.uint32)
        if out == "F16":
            return f32.astype(np.float16).view(np.uint16)
    bits = np.empty(f32.shape, dtype=np.uint16)
    round_to_bf16(f32, bits, np.empty(f32.shape, dtype=np.uint32))
    return bits


@functools.lru_cache(maxsize=None)
def pair_table(out: str) -> np.ndarray:
    """[65536] integer words: entry (scale << 8 | byte) holds the two output elements of that byte,
    low nibble's element first in memory."""
    return pair_words(value_bits(out))


def pair_words(bits: np.ndarray) -> np.ndarray:
    """[S scales, 16 nibbles] of output bits -> [S * 256] words: entry (scale << 8 | byte) holds the two
    elements of that byte, low nibble's first in memory (NVFP4 and INT4 build their tables with this too)."""
    byte = np.arange(256)
    pair = np.empty((bits.shape[0], 256, 2), dtype=bits.dtype)
    pair[:, :, 0] = bits[:, byte & 0x0F]
    pair[:, :, 1] = bits[:, byte >> 4]
    word = {2: np.uint32, 4: np.uint64}[bits.itemsize]
    return np.ascontiguousarray(pair).view(word).reshape(-1)


def gather_pairs(blocks: np.ndarray, scales: np.ndarray, out: str) -> np.ndarray:
    """uint8 blocks [..., G, 16] and uint8 scales [..., G] -> words [rows, 16] with
    words[r, j] = table[scales[r] << 8 | blocks[r, j]]: the caller views them as [..., G * 32]."""
    return gather_words(pair_table(out), blocks, scales)


def gather_words(table: np.ndarray, blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """uint8 blocks [..., G, B] and scale indices [..., G] -> words [rows, B],
    words[r, j] = table[scales[r] << 8 | blocks[r, j]], for any pair table of pair_words' layout. Every
    index is in the table by construction (scales index its [S, 256] rows), so np.take runs unbuffered
    (mode="clip", as kernels/fp8_gather.py): 1.2x the speed of its default mode for NVFP4 and INT4 on
    the 2-core box (bench/quant_bench.py, 2026-11-23)."""
    width = blocks.shape[-1]
    rows = math.prod(scales.shape)
    flat_blocks = blocks.reshape(rows, width)
    flat_scales = scales.reshape(rows, 1)
    words = np.empty((rows, width), dtype=table.dtype)
    step = max(1, _ROWS_PER_STEP * BYTES_PER_BLOCK // max(width, 1))
    idx = np.empty((min(rows, step), width), dtype=np.int32)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        i = idx[: r1 - r0]
        np.left_shift(flat_scales[r0:r1], 8, out=i, dtype=np.int32)
        i |= flat_blocks[r0:r1]
        np.take(table, i, out=words[r0:r1], mode="clip")
    return words


def dequant(blocks: np.ndarray, scales: np.ndarray, out: str) -> np.ndarray:
    """[..., G, 16] blocks, [..., G] scales -> [..., G * 32] values in the output's carrier
    (io.safetensors.CARRIERS: bf16 as uint16)."""
    *prefix, groups, _ = blocks.shape
    return gather_pairs(blocks, scales, out).view(CARRIERS[out]).reshape(*prefix, groups * VALUES_PER_BLOCK)


def dequant_transposed(blocks: np.ndarray, scales: np.ndarray, out: str, into: np.ndarray | None = None
                       ) -> tuple[np.ndarray, str]:
    """gpt-oss' experts, [E, R, G, 16] blocks and [E, R, G] scales -> [E, G * 32, R] in out's carrier (into `into`,
    a buffer of that many bytes, where given): transformers' layout (its convert_moe_packed_tensors, then the
    transpose GptOss loads). Returns (the output, which loops ran). Compiled, one pass of tiles that stay in L1 (C:
    kernels/native/mxfp4.c; numba); numpy gathers [E, R, G * 32] and transposes, which was 90% of its time."""
    experts, rows, groups = scales.shape
    table = pair_table(out)
    half = np.dtype(np.uint16 if table.dtype == np.uint32 else np.uint32)
    shape = (experts, groups * VALUES_PER_BLOCK, rows)
    result = np.empty(shape, dtype=half) if into is None else into.view(half).reshape(shape)
    blocks, scales = np.ascontiguousarray(blocks.view(np.uint8)), np.ascontiguousarray(scales.view(np.uint8))
    if native.library() is not None:
        native.mxfp4_transposed(blocks, scales, table, result)
        ran = "C"
    elif (loop := _numba_transposed()) is not None:
        loop(blocks, scales, table, result, np.uint64(8 * half.itemsize))
        ran = "numba"
    else:
        np.copyto(result, dequant(blocks, scales, out).view(half).transpose(0, 2, 1))
        ran = "numpy"
    return result.view(CARRIERS[out]), ran


@compiled_on_first_use
def _numba_transposed(numba):
    """numba's dequant_transposed: the same tiles' order without the buffer, or None (numba missing or disabled)."""

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def transposed(blocks, scales, table, out, shift):  # pragma: no cover - compiled
        experts, rows, groups = scales.shape
        mask = (np.uint64(1) << shift) - np.uint64(1)
        for e in range(experts):
            for r0 in range(0, rows, 32):
                for g in range(groups):
                    for r in range(r0, min(rows, r0 + 32)):
                        base = np.int64(scales[e, r, g]) << 8
                        for k in range(16):
                            word = np.uint64(table[base | np.int64(blocks[e, r, g, k])])
                            out[e, g * 32 + 2 * k, r] = word & mask
                            out[e, g * 32 + 2 * k + 1, r] = word >> shift

    return transposed
