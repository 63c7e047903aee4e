"""MXFP4 (OCP microscaling, e2m1 values with e8m0 block exponents) dequant: numpy on CPU (kernels/mxfp4_cpu.py),
Triton on CUDA, the same bits.

Storage (gpt-oss): `*_blocks` u8 [..., G, 16] holds 32 e2m1 codes per group, two per byte, low nibble
first; `*_scales` u8 [..., G] holds one biased exponent per group. Value = e2m1(code) * 2**(scale - 127).

Why both devices give identical bits: no floating-point arithmetic runs on either device. Every output
element is a function of only (scale byte, code nibble), so `pair_table` (mxfp4_cpu.py) precomputes the output bits
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
from typing import TYPE_CHECKING

from ckpttool.errors import InputError
from ckpttool.dtypes import dtype_code, torch_dtype
from ckpttool.kernels.mxfp4_cpu import (  # noqa: F401 - the format's constants, re-exported
    BYTES_PER_BLOCK,
    E2M1_VALUES,
    OUT_DTYPES,
    SCALE_BIAS,
    VALUES_PER_BLOCK,
    gather_pairs,
    pair_table,
)

if TYPE_CHECKING:
    import torch


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


def dequant_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype | None = None,
                  *, tensor: str = "<blocks>") -> torch.Tensor:
    """u8 blocks [..., G, 16] and u8 (or float8_e8m0fnu) scales [..., G] -> out_dtype (bf16 by
    default) [..., G * 32].

    No transpose: the layout change gpt-oss needs lives in families/gpt_oss/spec.py.
    """
    import torch

    out_dtype = out_dtype or torch.bfloat16
    check_mxfp4(blocks.shape, scales.shape, tensor=tensor)
    if blocks.dtype != torch.uint8:
        raise InputError(f"MXFP4 blocks must be uint8, got {blocks.dtype}", tensor=tensor)
    if scales.dtype == getattr(torch, "float8_e8m0fnu", None):
        scales = scales.view(torch.uint8)
    if scales.dtype != torch.uint8:
        raise InputError(f"MXFP4 scales must be uint8 e8m0 exponents, got {scales.dtype}", tensor=tensor)
    out = dtype_code(out_dtype)
    if out not in OUT_DTYPES:
        raise InputError(f"MXFP4 dequant writes one of {[str(torch_dtype(c)) for c in OUT_DTYPES]}, not {out_dtype}",
                         tensor=tensor)
    if blocks.device != scales.device:
        raise InputError(f"blocks on {blocks.device} but scales on {scales.device}", tensor=tensor)
    if blocks.numel() == 0:  # (numpy gives an empty array zero strides, which torch cannot view)
        return torch.empty(dequantized_shape(blocks.shape), dtype=out_dtype, device=blocks.device)
    if blocks.is_cuda:
        from ckpttool.kernels import mxfp4_triton

        words = mxfp4_triton.gather_pairs(blocks, scales, device_pair_table(out, blocks.device))
    else:
        words = torch.from_numpy(gather_pairs(blocks.contiguous().numpy(), scales.contiguous().numpy(), out))
    return words.view(out_dtype).reshape(dequantized_shape(blocks.shape))


@functools.lru_cache(maxsize=None)
def device_pair_table(out: str, device: torch.device) -> torch.Tensor:
    """kernels.mxfp4_cpu.pair_table on a torch device (as signed words, which torch supports
    everywhere), built once per (dtype, device)."""
    import torch

    table = pair_table(out)
    return torch.from_numpy(table.view(table.dtype.str.replace("u", "i"))).to(device)
