"""FP8 block dequant at plan time: pair each FP8 weight with its `weight_scale_inv`, or fail."""

from __future__ import annotations

from ckpttool.errors import InputError
from ckpttool.io.checkpoint import Checkpoint
from ckpttool.kernels.fp8 import check_scale
from ckpttool.plan import TensorPlan

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")


def check_scales(tensors: list[TensorPlan], ckpt: Checkpoint) -> None:
    """Every FP8 weight has a well-shaped F32 scale, and every scale has its weight: no silent fallbacks."""
    by_name = {t.name: t for t in tensors}
    for t in tensors:
        file = ckpt.root / ckpt.source(t.source).file
        if t.name.endswith(SCALE_SUFFIX):
            weight = by_name.get(t.name[: -len(SCALE_SUFFIX)])
            if weight is None:
                raise InputError("scale has no weight", file=file, tensor=t.name,
                                 fix="the checkpoint is incomplete; re-download it")
            if weight.dtype not in FP8_DTYPES:
                raise InputError(f"scale belongs to a {weight.dtype} weight, not an FP8 one", file=file, tensor=t.name)
            if t.dtype != "F32":
                raise InputError(f"scale dtype is {t.dtype}, expected F32", file=file, tensor=t.name)
            check_scale(weight.shape, t.shape, tensor=t.name, file=file)
        elif t.dtype in FP8_DTYPES and t.name + SCALE_SUFFIX not in by_name:
            raise InputError(f"FP8 weight has no {t.name + SCALE_SUFFIX!r}", file=file, tensor=t.name,
                             fix="the checkpoint is incomplete (or the index lost the scale entry); re-download it")


def dequant(tensors: list[TensorPlan], out_dtype: str = "BF16") -> list[TensorPlan]:
    """FP8 weights become `out_dtype` tensors made from (weight, scale); scale tensors disappear."""
    out = []
    for t in tensors:
        if t.name.endswith(SCALE_SUFFIX):
            continue
        if t.dtype in FP8_DTYPES:
            t = t.with_(dtype=out_dtype, transform="fp8_block", scale=t.source + SCALE_SUFFIX)
        out.append(t)
    return out
