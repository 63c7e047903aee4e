"""The dequant stage, at plan time: pair every quantized weight with its scales (or fail), and describe
the dequantized tensor it becomes. The formats and their names are rows of ckpttool/formats.py."""

from __future__ import annotations

from ckpttool.errors import InputError
from ckpttool.formats import DEQUANT_FORMATS, FP8_DTYPES, SCALE_SUFFIX, QuantFormat
from ckpttool.io.checkpoint import Checkpoint
from ckpttool.plan.types import TensorPlan


def _match(t: TensorPlan, by_name: dict[str, TensorPlan]) -> tuple[QuantFormat, str, str] | None:
    """(format, dequantized name, scale name) if `t` is a quantized weight with a sibling scale tensor."""
    for fmt in DEQUANT_FORMATS:
        if t.dtype not in fmt.weight_dtypes or not t.name.endswith(fmt.weight_suffix):
            continue
        base = t.name[: len(t.name) - len(fmt.weight_suffix)] if fmt.weight_suffix else t.name
        if base + fmt.scale_suffix in by_name:
            return fmt, base, base + fmt.scale_suffix
    return None


def scale_names(tensors: list[TensorPlan]) -> set[str]:
    """Names of the tensors that are scales of a quantized weight in this list."""
    by_name = {t.name: t for t in tensors}
    return {m[2] for t in tensors if (m := _match(t, by_name))}


def check_scales(tensors: list[TensorPlan], ckpt: Checkpoint) -> None:
    """Every quantized weight has a well-shaped scale of the right dtype, every scale has its weight:
    no silent fallbacks (the reference warns and copies FP8 bytes through as if they were BF16)."""
    by_name = {t.name: t for t in tensors}
    paired = set()
    for t in tensors:
        m = _match(t, by_name)
        if m is None:
            continue
        fmt, _, scale_name = m
        scale = by_name[scale_name]
        file = ckpt.root / ckpt.source(scale.source).file
        if scale.dtype != fmt.scale_dtype:
            raise InputError(f"scale dtype is {scale.dtype}, expected {fmt.scale_dtype}", file=file, tensor=scale_name,
                             fix=f"this is not a {fmt.name} checkpoint as published; re-download it")
        fmt.check(t.shape, scale.shape, scale_name, file)
        paired |= {t.name, scale_name}
    for t in tensors:
        if t.name in paired:
            continue
        file = ckpt.root / ckpt.source(t.source).file
        if t.dtype in FP8_DTYPES:
            raise InputError(f"FP8 weight has no {t.name + SCALE_SUFFIX!r}", file=file, tensor=t.name,
                             fix="the checkpoint is incomplete (or the index lost the scale entry); re-download it")
        for fmt in DEQUANT_FORMATS:
            if fmt.weight_suffix and t.name.endswith(fmt.weight_suffix) and t.dtype in fmt.weight_dtypes:
                raise InputError(f"{fmt.name} blocks have no {fmt.scale_suffix!r} tensor", file=file,
                                 tensor=t.name, fix="the checkpoint is incomplete; re-download it")
            if t.name.endswith(fmt.scale_suffix) and (fmt.weight_suffix or t.dtype == fmt.scale_dtype):
                raise InputError("scale has no quantized weight beside it", file=file, tensor=t.name,
                                 fix="the checkpoint is incomplete; re-download it")


def dequant(tensors: list[TensorPlan], out_dtype: str = "BF16") -> tuple[list[TensorPlan], int]:
    """Quantized weights become `out_dtype` tensors made from (weight, scale); scales disappear.
    Returns the new list and how many weights were dequantized."""
    by_name = {t.name: t for t in tensors}
    scales = scale_names(tensors)
    out, n = [], 0
    for t in tensors:
        if t.name in scales:
            continue
        m = _match(t, by_name)
        if m is not None:
            fmt, base, scale_name = m
            t = t.with_(name=base, dtype=out_dtype, shape=fmt.out_shape(t.shape), transform=fmt.name,
                        scale=scale_name)
            n += 1
        out.append(t)
    return out, n
