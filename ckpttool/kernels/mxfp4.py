"""MXFP4 (OCP microscaling, e2m1 values with e8m0 block exponents) dequant: torch on CPU, Triton on
CUDA, the same bits.

Storage (gpt-oss): `*_blocks` u8 [..., G, 16] holds 32 e2m1 codes per group, two per byte, low nibble
first; `*_scales` u8 [..., G] holds one biased exponent per group. Value = e2m1(code) * 2**(scale - 127).

Why both devices give identical bits: no floating-point arithmetic runs on either device. Every output
element is a function of only (scale byte, code nibble), so `_pair_table` precomputes the output bits
of every (scale, byte) pair once, on the CPU, and both paths are pure integer gathers from that one
table (`out[r, j] = table[scale[r] << 8 | blocks[r, j]]`, two outputs per gathered word). Flush-to-zero
modes, fused multiply-adds or a different libm cannot change a gather.

The table reproduces transformers' `convert_moe_packed_tensors` (`torch.ldexp(lut[code], scale - 127)`),
as it runs on CPU when GptOssForCausalLM dequantizes: exact real arithmetic rounded once into the
output dtype. Edge cases, all checked against transformers in tests/test_mxfp4.py:
  - every finite product is exact in fp32/bf16: e2m1 magnitudes have <= 2 significant bits and the
    smallest product, 0.5 * 2**-127 = 2**-128, is above the bf16/fp32 subnormal step (2**-133 / 2**-149);
  - scale 0 (2**-127) with |value| < 2, and scale 1 with |value| = 0.5, give bf16/fp32 *subnormals*,
    kept (not flushed to zero);
  - scale 254 (2**127): |value| >= 2 overflows to +-inf in bf16/fp32; 1.5 * 2**127 is still finite;
  - scale 255 is NaN in the OCP e8m0 spec, but transformers treats it as 2**128: 0.5 -> 2**127
    (finite), |value| >= 1 -> +-inf, +-0 stays +-0. We match transformers, never emit NaN, and leave
    rejecting such blocks to a caller that wants to (published scales are far from both ends);
  - signed zero is kept (code 8 -> -0.0);
  - fp16 output rounds the exact value once (RNE): tiny values underflow to 0, large ones to +-inf.
"""

from __future__ import annotations

import functools
import math

import torch

from ckpttool.errors import InputError

VALUES_PER_BLOCK = 32
BYTES_PER_BLOCK = 16
SCALE_BIAS = 127
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BYTES_PER_CHUNK = 1 << 22  # blocks bytes per CPU step; the int32 index temporary is 4x this (16 MiB)


def check_mxfp4(blocks_shape, scales_shape, *, tensor: str, file: object = None) -> None:
    """blocks [..., G, 16] and scales [..., G] must agree; a mismatch is an error naming the tensor."""
    blocks_shape, scales_shape = tuple(blocks_shape), tuple(scales_shape)
    if len(blocks_shape) < 2 or blocks_shape[-1] != BYTES_PER_BLOCK:
        raise InputError(f"MXFP4 blocks must have shape [..., G, {BYTES_PER_BLOCK}], got {list(blocks_shape)}",
                         file=file, tensor=tensor)
    if blocks_shape[:-1] != scales_shape:
        raise InputError(
            f"MXFP4 scales shape {list(scales_shape)} does not match blocks shape {list(blocks_shape)}: "
            f"expected {list(blocks_shape[:-1])} (one e8m0 exponent per {VALUES_PER_BLOCK} values)",
            file=file, tensor=tensor, fix="re-download the checkpoint; the scales do not belong to these blocks",
        )


def dequantized_shape(blocks_shape) -> tuple[int, ...]:
    *prefix, groups, _ = blocks_shape
    return (*prefix, groups * VALUES_PER_BLOCK)


def dequant_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                  *, tensor: str = "<blocks>") -> torch.Tensor:
    """u8 blocks [..., G, 16] and u8 (or float8_e8m0fnu) scales [..., G] -> out_dtype [..., G * 32].

    No transpose: the layout change gpt-oss needs lives in ckpttool.arch.gpt_oss.
    """
    check_mxfp4(blocks.shape, scales.shape, tensor=tensor)
    if blocks.dtype != torch.uint8:
        raise InputError(f"MXFP4 blocks must be uint8, got {blocks.dtype}", tensor=tensor)
    if scales.dtype == getattr(torch, "float8_e8m0fnu", None):
        scales = scales.view(torch.uint8)
    if scales.dtype != torch.uint8:
        raise InputError(f"MXFP4 scales must be uint8 e8m0 exponents, got {scales.dtype}", tensor=tensor)
    if out_dtype not in OUT_DTYPES:
        raise InputError(f"MXFP4 dequant writes one of {[str(d) for d in OUT_DTYPES]}, not {out_dtype}",
                         tensor=tensor)
    if blocks.device != scales.device:
        raise InputError(f"blocks on {blocks.device} but scales on {scales.device}", tensor=tensor)
    table = _pair_table(out_dtype, blocks.device)
    if blocks.is_cuda:
        from ckpttool.kernels import mxfp4_triton

        words = mxfp4_triton.gather_pairs(blocks, scales, table)
    else:
        words = _gather_pairs_cpu(blocks, scales, table)
    return words.view(out_dtype).reshape(dequantized_shape(blocks.shape))


def _gather_pairs_cpu(blocks: torch.Tensor, scales: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """words[r, j] = table[scales[r] << 8 | blocks[r, j]], chunked so temporaries stay bounded."""
    rows = math.prod(scales.shape)
    flat_blocks = blocks.reshape(rows, BYTES_PER_BLOCK)
    flat_scales = scales.reshape(rows, 1)
    words = torch.empty((rows, BYTES_PER_BLOCK), dtype=table.dtype)
    step = max(1, _BYTES_PER_CHUNK // BYTES_PER_BLOCK)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        idx = flat_blocks[r0:r1].to(torch.int32)
        idx |= flat_scales[r0:r1].to(torch.int32) << 8
        torch.index_select(table, 0, idx.view(-1), out=words[r0:r1].view(-1))
    return words


@functools.lru_cache(maxsize=None)
def _pair_table(out_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[65536] integer words: entry (scale << 8 | byte) holds the two output elements of that byte,
    low nibble's element first in memory. Built once per (dtype, device) from the CPU table."""
    if device.type != "cpu":
        return _pair_table(out_dtype, torch.device("cpu")).to(device)
    values = value_table(out_dtype)  # [256 scales, 16 codes]
    elem_int = {2: torch.int16, 4: torch.int32}[values.element_size()]
    word_int = {2: torch.int32, 4: torch.int64}[values.element_size()]
    bits = values.view(elem_int)
    byte = torch.arange(256)
    pair = torch.empty((256, 256, 2), dtype=elem_int)
    pair[:, :, 0] = bits[:, byte & 0x0F]
    pair[:, :, 1] = bits[:, byte >> 4]
    return pair.view(word_int).reshape(256 * 256).contiguous()


@functools.lru_cache(maxsize=None)
def value_table(out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[256, 16]: the dequantized value of every (e8m0 scale, e2m1 code), exactly as transformers does.

    math.ldexp in float64 is exact for all 4096 products (|value| <= 6 * 2**128); the single cast
    to float32 rounds only where fp32 overflows (>= 2**128 -> inf), which bf16/fp16 would too, and
    the cast on to out_dtype is then one RNE rounding of the exact value.
    """
    exact = torch.tensor([[math.ldexp(v, s - SCALE_BIAS) for v in E2M1_VALUES] for s in range(256)],
                         dtype=torch.float64)
    return exact.to(torch.float32).to(out_dtype)
