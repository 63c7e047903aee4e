"""compressed-tensors 0.20's weight quantization, op for op in torch (CPU or CUDA): min-max statistics per group,
block, channel or tensor, `calculate_qparams`, `quantize`, and each compressor's packing.

The library computes in the weight's dtype (BF16 for a BF16 model) and so must we: `w / scale` is rounded to
BF16 before it is rounded to the code, the scale `amax / 7.5` is a BF16 quotient. Every function below names the
library function whose operations it repeats in the same order and dtypes; tests/test_quantize_targets.py holds
the outputs to the library's own `compress_model` of the same weights, byte for byte.

Statistics (llm-compressor's memoryless min-max observer, what a scheme without calibration data uses): amin and
amax of each group (`group_size` input columns), block (b0 x b1), row (`channel`) or the whole tensor, in the
weight's dtype; NVFP4's global scale from the whole tensor's (`generate_gparam`). No calibration, round to nearest.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FP8_MAX = 448.0
FP4_MAX = 6.0


def min_max(w: torch.Tensor, strategy: str, group: int = 0, block: tuple[int, int] = (0, 0)):
    """Per-group / block / channel / tensor amin and amax in w's dtype, shaped as the library's scales."""
    if strategy == "group":
        g = w.unflatten(-1, (-1, group))
        return g.amin(-1), g.amax(-1)
    if strategy == "block":
        b0, b1 = block
        blocks = w.unflatten(0, (-1, b0)).unflatten(-1, (-1, b1))
        return blocks.amin((1, 3)), blocks.amax((1, 3))
    if strategy == "channel":
        return w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    return w.amin().reshape(1), w.amax().reshape(1)


def _range(kind: str, bits: int):
    """calculate_range: the codes' float bounds as 0-d float32 tensors."""
    import torch

    if kind == "int":
        return torch.tensor(-(2.0 ** bits) / 2), torch.tensor(2.0 ** bits / 2 - 1)
    top = FP8_MAX if bits == 8 else FP4_MAX
    return torch.tensor(-top), torch.tensor(top)


def _round_to_dtype(t: torch.Tensor, dtype: torch.dtype, back: bool = True) -> torch.Tensor:
    """round_to_quantized_type_dtype."""
    import torch

    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        rounded = torch.clamp(t, info.min, info.max).to(dtype)
    else:
        info = torch.iinfo(dtype)
        rounded = torch.round(torch.clamp(t, info.min, info.max)).to(dtype)
    return rounded.to(t.dtype) if back else rounded


def _mx_exponent(x: torch.Tensor) -> torch.Tensor:
    """generate_mx_scales for FP4 elements: round_to_power_2 (the mantissa rounded at E2M1's precision), then the
    E8M0 code `127 + floor(log2(.)) - 2`, in x's dtype."""
    import torch

    bits = {torch.bfloat16: (torch.uint16, 7, 8), torch.float16: (torch.uint16, 10, 5),
            torch.float32: (torch.uint32, 23, 8)}
    int_dtype, mantissa, exponent = bits[x.dtype]
    v = x.view(int_dtype).to(torch.int32)
    rounded = torch.bitwise_and(v + (1 << (mantissa - 1 - 1)), ((1 << (exponent + 1)) - 1) << mantissa)
    p2 = (rounded.to(int_dtype) if int_dtype is torch.uint16 else rounded).view(x.dtype)
    return 127 + torch.floor(torch.log2(p2)) - 2


def qparams(lo: torch.Tensor, hi: torch.Tensor, *, kind: str, bits: int, symmetric: bool = True,
            scale_dtype: torch.dtype | None = None, mx: bool = False, global_scale: torch.Tensor | None = None):
    """calculate_qparams: (scale, zero point) from the statistics, in their dtype (the zero point as int8, or
    float8 for FP4, its zp_dtype)."""
    import torch

    lo = torch.min(lo, torch.zeros_like(lo))
    hi = torch.max(hi, torch.zeros_like(hi))
    bit_min, bit_max = _range(kind, bits)
    bit_range = bit_max - bit_min
    if symmetric:
        top = torch.max(torch.abs(lo), torch.abs(hi))
        scales = _mx_exponent(top) if mx else top / (bit_range.to(top.dtype) / 2)
        zero = torch.zeros(scales.shape, dtype=lo.dtype)
    else:
        scales = (hi - lo) / bit_range.to(hi.dtype)
        zero = torch.clamp(bit_min - (lo / scales), bit_min, bit_max)
    if global_scale is not None:
        scales = global_scale * scales
    if scale_dtype is not None:
        scales = _round_to_dtype(scales, scale_dtype)
    if mx:
        scales = (2.00 ** ((scales.to(torch.int32) - 127).to(torch.float))).to(scales.dtype)
    eps = (0.125 if scale_dtype is torch.float8_e4m3fn else
           1 if scale_dtype is not None and not scale_dtype.is_floating_point else torch.finfo(scales.dtype).eps)
    scales = torch.where(scales == 0, torch.tensor(eps, dtype=scales.dtype), scales)
    return scales, _round_to_dtype(zero, torch.float8_e4m3fn if kind == "float" else torch.int8, back=False)


def global_scale_fp4(w: torch.Tensor) -> torch.Tensor:
    """generate_gparam over the whole tensor: 448 * 6 / amax in w's dtype, then float32 [1] (1.0 for NaN/inf)."""
    import torch

    lo = torch.min(w.amin(), torch.zeros_like(w.amin()))
    hi = torch.max(w.amax(), torch.zeros_like(w.amax()))
    top = torch.clamp(torch.max(torch.abs(lo), torch.abs(hi)), min=torch.finfo(w.dtype).tiny)
    g = torch.nan_to_num(FP8_MAX * FP4_MAX / top, nan=1.0, posinf=1.0, neginf=1.0)
    return g.to(torch.float32).reshape([1])


def cast_to_fp4(x: torch.Tensor) -> torch.Tensor:
    """fp4_utils.cast_to_fp4 (its CPU form): nearest E2M1 value, ties as the library's thresholds break them."""
    import torch

    sign = torch.sign(x)
    x = torch.abs(x)
    x[(x >= 0.0) & (x <= 0.25)] = 0.0
    x[(x > 0.25) & (x < 0.75)] = 0.5
    x[(x >= 0.75) & (x <= 1.25)] = 1.0
    x[(x > 1.25) & (x < 1.75)] = 1.5
    x[(x >= 1.75) & (x <= 2.5)] = 2.0
    x[(x > 2.5) & (x < 3.5)] = 3.0
    x[(x >= 3.5) & (x <= 5.0)] = 4.0
    x[x > 5.0] = 6.0
    return x * sign


def quantize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, *, kind: str, bits: int,
             dtype: torch.dtype | None, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """forward._quantize on values already shaped against their scale (groups unflattened, blocks split)."""
    import torch

    q_min, q_max = _range(kind, bits)
    if global_scale is not None:
        scale = scale / global_scale
    scaled = x / scale
    if zero is not None:
        scaled += zero.to(x.dtype)
    t = torch.clamp(scaled, q_min, q_max)
    if kind == "int":
        rounded = torch.round(t)
    elif bits == 8:
        rounded = t.to(torch.float8_e4m3fn)
    else:
        rounded = cast_to_fp4(t)
    rounded = rounded.to(scaled.dtype)
    return rounded.to(dtype) if dtype is not None else rounded


def quantize_grouped(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int, **kw):
    """_process_group: [M, N] against [M, N/group] scales."""
    zero = None if zero is None else zero.unsqueeze(-1)
    out = quantize(w.unflatten(-1, (-1, group)), scale.unsqueeze(-1), zero, **kw)
    return out.flatten(start_dim=-2)


def quantize_blocks(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], **kw):
    """_process_block for shapes the blocks divide."""
    b0, b1 = block
    rows, cols = w.shape
    x = w.reshape(rows // b0, b0, cols // b1, b1).transpose(1, 2)
    q = quantize(x, scale.unsqueeze(-1).unsqueeze(-1), None, **kw)
    return q.transpose(1, 2).reshape(rows, cols)


def pack_to_int32(value: torch.Tensor, bits: int, packed_dim: int = 1) -> torch.Tensor:
    """pack_quantized.helpers.pack_to_int32: int8 codes, offset to unsigned, `32 / bits` a word, lowest first."""
    import torch

    v = value.to(torch.int32) + (1 << (bits - 1))
    if packed_dim == 0:
        v = v.transpose(0, 1)
    rows, cols = v.shape
    words = math.ceil(cols * bits / 32)
    per = 32 // bits
    padded = math.ceil(cols / per) * per
    if padded > cols:
        v = torch.nn.functional.pad(v, (0, padded - cols))
    v = v.reshape(rows, -1, per).to(torch.int64)
    shifts = torch.arange(per, dtype=torch.int64) * bits
    packed = (v << shifts).sum(-1)
    packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)[:, :words]
    return packed.transpose(0, 1).contiguous() if packed_dim == 0 else packed.contiguous()


def pack_fp4(x: torch.Tensor) -> torch.Tensor:
    """nvfp4.helpers.pack_fp4_to_uint8 (CPU form): E2M1 codes, two a byte, the even column in the low nibble."""
    import torch

    m, n = x.shape
    sign = torch.signbit(x).to(torch.uint8)
    a = (x * 2).to(torch.int8).abs_()
    idx = torch.zeros_like(a, dtype=torch.uint8)
    for code, value in ((1, 1), (2, 2), (3, 3), (4, 4), (5, 6), (6, 8)):
        idx[a == value] = code
    idx[a >= 12] = 7
    idx = (idx | (sign << 3)).reshape(-1, 2)
    return (idx[:, 0] | (idx[:, 1] << 4)).reshape(m, n // 2)


def mx_scale_code(scale: torch.Tensor) -> torch.Tensor:
    """mx_utils.compress_mx_scale: a power-of-two scale as its E8M0 code (uint8)."""
    import torch

    return (127 + torch.floor(torch.log2(scale)).to(torch.int32)).to(torch.uint8)


def _fp4_bounds():
    """cast_to_fp4's thresholds as bucketize boundaries: a value <= each goes below it, so the library's strict
    ones (x < 0.75, x < 1.75, x < 3.5 round down) are the float32 just below."""
    import torch

    strict = torch.tensor([0.75, 1.75, 3.5], dtype=torch.float32)
    below = torch.nextafter(strict, torch.zeros_like(strict))
    return torch.tensor([0.25, float(below[0]), 1.25, float(below[1]), 2.5, float(below[2]), 5.0], dtype=torch.float32)


def fp4_packed(t: torch.Tensor) -> torch.Tensor:
    """pack_fp4(cast_to_fp4(t)) for finite t in one pass: E2M1 magnitude index by bucketize against the library's
    thresholds, its sign bit that of `magnitude * sign(t)` as the library multiplies: set for t < 0 (a negative value
    rounding to zero is -0.0), clear for -0.0 itself (sign(-0.0) is 0); two codes a byte, the even column low.
    tests/test_quantize_targets.py holds it to the library's path."""
    import torch

    idx = torch.bucketize(t.abs().float(), _fp4_bounds()).to(torch.uint8)
    codes = idx | ((t < 0).to(torch.uint8) << 3)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def quantize_fp4_grouped(w: torch.Tensor, scale: torch.Tensor, group: int,
                         global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """quantize_and_pack_fp4's bytes: forward._quantize's division and clamp in its dtypes, then fp4_packed."""
    import torch

    x, s = w.unflatten(-1, (-1, group)), scale.unsqueeze(-1)
    if global_scale is not None:
        s = s / global_scale
    t = torch.clamp(x / s, -FP4_MAX, FP4_MAX)
    return fp4_packed(t.flatten(start_dim=-2))
