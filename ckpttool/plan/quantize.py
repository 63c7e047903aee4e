"""The quantize stage: BF16/F16/F32 linear weights -> FP8 128x128 blocks, int8 per channel or int4 groups.

Plan time: each weight the family calls quantizable (the key table's LINEAR column) becomes two output
tensors made from the same source by two transforms (the quantized values, and their scales); every
other tensor passes through. On-disk layout, HF names (README "Output formats"):

| format | `X.weight` | beside it |
| --- | --- | --- |
| fp8_block | F8_E4M3 [M, N] | `X.weight_scale_inv` F32 [ceil(M/128), ceil(N/128)] (DeepSeek's) |
| int8 | I8 [M, N] | `X.scales` [M], the source dtype (gpt-fast's WeightOnlyInt8Linear) |
| int4 | U8 [M, N/2], two values a byte, low nibble first | `X.scales_and_zeros` BF16 [N/g, M, 2] (gpt-fast's) |

Execution: `formats.QUANTIZE_TRANSFORMS[name](weight)` computes one output from the whole source tensor.
"""

from __future__ import annotations


from ckpttool.errors import PlanError
from ckpttool.families.base import Family
from ckpttool.formats import (
    FP8_DTYPES,
    FP8_SCALE,
    INT4_GROUP_SIZES,
    INT4_SCALES_AND_ZEROS,
    INT8_SCALES,
    QUANTIZE_FORMATS,
    with_leaf,
)
from ckpttool.kernels.fp8 import scale_shape
from ckpttool.plan.types import TensorPlan

_FLOAT_DTYPES = ("BF16", "F16", "F32")


def quantize(tensors: list[TensorPlan], family: Family, cfg, fmt: str, group_size: int = 128,
             files_of: dict[str, str] | None = None) -> list[TensorPlan]:
    if fmt not in QUANTIZE_FORMATS:
        raise PlanError(f"unknown quantize format {fmt!r}", fix=f"use one of {', '.join(QUANTIZE_FORMATS)}")
    if not family.quantize:
        raise PlanError(f"the quantize stage does not support {family.name} checkpoints")
    files_of = files_of or {}
    out = []
    for t in tensors:
        if not family.quantizable(cfg, t.name):
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
        if fmt == "fp8_block":
            out.append(t.with_(dtype="F8_E4M3", transform="quantize_fp8_block"))
            out.append(t.with_(name=with_leaf(t.name, FP8_SCALE.hf_leaf), dtype="F32", shape=scale_shape(t.shape),
                               transform="quantize_fp8_block_scale"))
        elif fmt == "int8":
            out.append(t.with_(dtype="I8", transform="quantize_int8"))
            out.append(t.with_(name=with_leaf(t.name, INT8_SCALES), shape=(rows,), transform="quantize_int8_scales"))
        else:
            if group_size not in INT4_GROUP_SIZES or cols % group_size or cols % 2:
                raise PlanError(f"int4 needs input features ({cols}) divisible by group_size {group_size} "
                                f"(one of {INT4_GROUP_SIZES})", file=file, tensor=t.name,
                                fix="choose a group_size dividing the input features")
            out.append(t.with_(dtype="U8", shape=(rows, cols // 2), transform=f"quantize_int4_g{group_size}"))
            out.append(t.with_(name=with_leaf(t.name, INT4_SCALES_AND_ZEROS), dtype="BF16", shape=(cols // group_size, rows, 2),
                               transform=f"quantize_int4_g{group_size}_scales_and_zeros"))
    return out
