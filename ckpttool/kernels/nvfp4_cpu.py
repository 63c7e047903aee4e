"""NVFP4 dequant (e2m1 codes, one F8_E4M3 scale per 16 values, one fp32 scale per tensor), in numpy;
the CUDA path gathers from the same table (kernels/nvfp4.py). No torch import.

Two libraries define NVFP4 checkpoints, with the same tensors and different arithmetic, each
reproduced here bit for bit (tests/test_quant_formats.py runs both libraries as the oracle):

  compressed-tensors (`nvfp4-pack-quantized`, global scale G = `weight_global_scale`):
      out = bf16( e2m1(c) * fp32( fp32(s) / G ) )       e2m1(0b1000) = -0.0
      (NVFP4PackedCompressor.decompress: scale / global_scale in fp32, x_q * scale in fp32, then .to(bf16))
  NVIDIA ModelOpt (`hf_quant_config.json` quant_algo NVFP4, S2 = `weight_scale_2`, which is 1 / G):
      out = bf16( e2m1(c) * fp32( fp32(s) * S2 ) )      e2m1(0b1000) = +0.0
      (NVFP4QTensor.dequantize: per_block_scale = scale.float() * double_scale, then the product)

Each multiply and the division is one IEEE fp32 operation rounded to nearest even, and the last
step one RNE rounding into the output dtype. As G (or S2) is fixed for a tensor, every output element
is a function of only (scale code, nibble): one [256 x 256]-pair table per tensor, built here from
those fp32 operations, and both devices are then pure integer gathers from it (as for MXFP4).
"""

from __future__ import annotations

import functools

import numpy as np

from ckpttool.dtypes import CARRIERS
from ckpttool.kernels.scaled_cpu import compiled
from ckpttool.kernels.fp8_cpu import fp8_values, round_to_bf16
from ckpttool.kernels.mxfp4_cpu import E2M1_VALUES, gather_words, pair_words

GROUP = 16
"""values per F8_E4M3 scale"""
BYTES_PER_GROUP = GROUP // 2
VARIANTS = ("compressed-tensors", "modelopt")
_E2M1 = {"compressed-tensors": np.array(E2M1_VALUES, dtype=np.float32),  # kE2M1ToFloat[c & 7] * -1.0 for c & 8
         "modelopt": np.array([abs(v) if i == 8 else v for i, v in enumerate(E2M1_VALUES)], dtype=np.float32)}


def block_scales(variant: str, global_scale: float) -> np.ndarray:
    """fp32 [256]: the effective scale of each F8_E4M3 scale code, as the variant's library computes it."""
    s = fp8_values("F8_E4M3")
    g = np.float32(global_scale)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return s / g if variant == "compressed-tensors" else s * g


@functools.lru_cache(maxsize=32)
def table(variant: str, global_scale: float, out: str) -> np.ndarray:
    """[65536] words: entry (scale code << 8 | byte) holds the output bits of that byte's two values."""
    with np.errstate(over="ignore", invalid="ignore"):
        f32 = _E2M1[variant][None, :] * block_scales(variant, global_scale)[:, None]  # one fp32 multiply
        if out == "F32":
            bits = f32.view(np.uint32)
        elif out == "F16":
            bits = f32.astype(np.float16).view(np.uint16)
        else:
            bits = np.empty(f32.shape, dtype=np.uint16)
            round_to_bf16(f32, bits, np.empty(f32.shape, dtype=np.uint32))
    return pair_words(bits)


def nan_scale_rows(scales: np.ndarray) -> np.ndarray:
    """Row indices whose F8_E4M3 scale codes include NaN (S.1111.111): refused, never dequantized."""
    return np.flatnonzero(((scales.reshape(scales.shape[0], -1) & 0x7F) == 0x7F).any(axis=1))


def dequant(packed: np.ndarray, scales: np.ndarray, variant: str, global_scale: float, out: str) -> np.ndarray:
    """uint8 packed [M, N/2] (two codes a byte, low nibble first), uint8 F8_E4M3 scales [M, N/16]
    -> [M, N] in out's carrier. The caller has checked shapes and refused NaN scale codes."""
    rows, width = packed.shape
    groups = width // BYTES_PER_GROUP
    pairs = table(variant, float(global_scale), out)
    loops = compiled()
    if loops is not None and rows and width:
        words = np.empty((rows, width), dtype=pairs.dtype)
        loops.nvfp4(packed, scales.reshape(rows, groups), pairs, words)
    else:
        words = gather_words(pairs, packed.reshape(rows, groups, BYTES_PER_GROUP), scales.reshape(rows, groups))
    return words.view(CARRIERS[out]).reshape(rows, width * 2)
