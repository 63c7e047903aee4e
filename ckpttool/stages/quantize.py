"""The quantize stage: BF16/F16/F32 linear weights -> FP8 128x128 blocks, int8 per channel or int4 groups.

Plan time: each weight the architecture calls quantizable (`Arch.quantizable`) becomes two output
tensors made from the same source by two transforms (the quantized values, and their scales); every
other tensor passes through. On-disk layout, HF names (README "Output formats"):

| format | `X.weight` | beside it |
| --- | --- | --- |
| fp8_block | F8_E4M3 [M, N] | `X.weight_scale_inv` F32 [ceil(M/128), ceil(N/128)] (DeepSeek's) |
| int8 | I8 [M, N] | `X.scales` [M], the source dtype (gpt-fast's WeightOnlyInt8Linear) |
| int4 | U8 [M, N/2], two values a byte, low nibble first | `X.scales_and_zeros` BF16 [N/g, M, 2] (gpt-fast's) |

Execution: `QUANTIZE_TRANSFORMS[name](weight)` computes one output from the whole source tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ckpttool.arch.base import Arch
from ckpttool.errors import PlanError
from ckpttool.kernels.fp8 import BLOCK, quantize_fp8_block, scale_shape
from ckpttool.kernels.quant import (
    INT4_GROUP_SIZES,
    pack_int4,
    quantize_int4_grouped,
    quantize_int8_per_channel,
)
from ckpttool.plan import TensorPlan
from ckpttool.stages.dequant import FP8_DTYPES, SCALE_SUFFIX

if TYPE_CHECKING:
    import torch

FORMATS = ("fp8_block", "int8", "int4")
_FLOAT_DTYPES = ("BF16", "F16", "F32")

FP8_QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                           "weight_block_size": [BLOCK, BLOCK]}
"""DeepSeek-V3's quantization_config: transformers' FineGrainedFP8 and our dequant read it."""


def _int4(group_size: int, part: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(w: torch.Tensor) -> torch.Tensor:
        q, scales_and_zeros = quantize_int4_grouped(w, group_size)
        return pack_int4(q) if part == 0 else scales_and_zeros
    return run


QUANTIZE_TRANSFORMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quantize_fp8_block": lambda w: quantize_fp8_block(w)[0],
    "quantize_fp8_block_scale": lambda w: quantize_fp8_block(w)[1],
    "quantize_int8": lambda w: quantize_int8_per_channel(w)[0],
    "quantize_int8_scales": lambda w: quantize_int8_per_channel(w)[1],
    **{f"quantize_int4_g{g}": _int4(g, 0) for g in INT4_GROUP_SIZES},
    **{f"quantize_int4_g{g}_scales_and_zeros": _int4(g, 1) for g in INT4_GROUP_SIZES},
}
"""transform name (TensorPlan.transform) -> whole source tensor -> that output tensor."""


def quantize(tensors: list[TensorPlan], arch: Arch, fmt: str, group_size: int = 128,
             files_of: dict[str, str] | None = None) -> list[TensorPlan]:
    if fmt not in FORMATS:
        raise PlanError(f"unknown quantize format {fmt!r}", fix=f"use one of {', '.join(FORMATS)}")
    if arch.quantizable is None:
        raise PlanError(f"the quantize stage does not support {arch.name} checkpoints")
    files_of = files_of or {}
    out = []
    for t in tensors:
        if not arch.quantizable(t.name):
            out.append(t)
            continue
        file = files_of.get(t.source)
        if t.dtype in FP8_DTYPES and t.transform is None:
            raise PlanError("weight is already FP8", file=file, tensor=t.name,
                            fix="add a dequant stage before quantize to requantize it")
        if t.dtype not in _FLOAT_DTYPES or t.transform is not None or len(t.shape) != 2:
            raise PlanError(f"cannot quantize a {t.dtype} {list(t.shape)} tensor" +
                            (" made by another transform" if t.transform else ""), file=file, tensor=t.name,
                            fix="quantize reads BF16/F16/F32 2-D weights; put dequant and quantize in one recipe "
                                "only through an intermediate BF16 checkpoint")
        rows, cols = t.shape
        base = t.name.removesuffix(".weight")
        if fmt == "fp8_block":
            out.append(t.with_(dtype="F8_E4M3", transform="quantize_fp8_block"))
            out.append(t.with_(name=t.name + SCALE_SUFFIX, dtype="F32", shape=scale_shape(t.shape),
                               transform="quantize_fp8_block_scale"))
        elif fmt == "int8":
            out.append(t.with_(dtype="I8", transform="quantize_int8"))
            out.append(t.with_(name=base + ".scales", shape=(rows,), transform="quantize_int8_scales"))
        else:
            if group_size not in INT4_GROUP_SIZES or cols % group_size or cols % 2:
                raise PlanError(f"int4 needs input features ({cols}) divisible by group_size {group_size} "
                                f"(one of {INT4_GROUP_SIZES})", file=file, tensor=t.name,
                                fix="choose a group_size dividing the input features")
            out.append(t.with_(dtype="U8", shape=(rows, cols // 2), transform=f"quantize_int4_g{group_size}"))
            out.append(t.with_(name=base + ".scales_and_zeros", dtype="BF16", shape=(cols // group_size, rows, 2),
                               transform=f"quantize_int4_g{group_size}_scales_and_zeros"))
    return out


def rewrite_config(config: dict, fmt: str, group_size: int) -> dict:
    """fp8_block: DeepSeek's quantization_config, so loaders treat the output as block FP8. int8/int4
    have no transformers quantizer that reads gpt-fast's layout: they are described under
    `ckpttool_quantization` instead, which no loader mistakes for a method it knows."""
    config = dict(config)
    if fmt == "fp8_block":
        config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    else:
        config.pop("quantization_config", None)
        config["ckpttool_quantization"] = {"format": fmt, "scheme": "gpt-fast weight-only",
                                           **({"group_size": group_size} if fmt == "int4" else {})}
    return config
