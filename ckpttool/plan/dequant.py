"""The dequant stage, at plan time: pair every quantized weight with its scales and the other tensors
its format stores beside it (or fail), and describe the dequantized tensor it becomes. The formats,
their names and which ones a config declares are rows of ckpttool/formats/."""

from __future__ import annotations

import numpy as np

from ckpttool.errors import InputError, PlanError
from ckpttool.formats import QuantFormat
from ckpttool.io.checkpoint import Checkpoint
from ckpttool.plan.types import TensorPlan

Formats = tuple[QuantFormat, ...]


def _match(t: TensorPlan, by_name: dict[str, TensorPlan], formats: Formats) -> tuple[QuantFormat, str, str] | None:
    """(format, dequantized name, scale name) if `t` is a quantized weight with a sibling scale tensor."""
    for fmt in formats:
        if t.dtype not in fmt.weight_dtypes or not t.name.endswith(fmt.weight_suffix):
            continue
        base = fmt.base_of(t.name)
        if base + fmt.scale_suffix in by_name:
            return fmt, base, base + fmt.scale_suffix
    return None


def _matches(tensors: list[TensorPlan], formats: Formats) -> dict[str, tuple[QuantFormat, str, str]]:
    by_name = {t.name: t for t in tensors}
    return {t.name: m for t in tensors if (m := _match(t, by_name, formats))}


def quantized_weights(tensors: list[TensorPlan], formats: Formats) -> dict[str, QuantFormat]:
    """stored weight name -> its format, for every quantized weight with its scale beside it."""
    return {name: m[0] for name, m in _matches(tensors, formats).items()}


def scale_names(tensors: list[TensorPlan], formats: Formats) -> set[str]:
    """Names of the tensors stored beside a quantized weight in this list (scales, global scales,
    shapes, activation scales): what the dequant stage consumes or drops."""
    return _beside(_matches(tensors, formats), {t.name for t in tensors})


def _beside(matches: dict[str, tuple[QuantFormat, str, str]], names: set[str]) -> set[str]:
    out = set()
    for fmt, base, scale in matches.values():
        out.add(scale)
        out |= set(fmt.besides(base))
    return out & names


def _file(ckpt: Checkpoint, t: TensorPlan):
    return ckpt.root / ckpt.source(t.source).file


def check_scales(tensors: list[TensorPlan], ckpt: Checkpoint, formats: Formats) -> None:
    """Every quantized weight has a well-shaped scale of the right dtype (and every other tensor its
    format needs), every scale has its weight: no silent fallbacks (the reference warns and copies FP8
    bytes through as if they were BF16)."""
    by_name = {t.name: t for t in tensors}
    paired = set()
    for name, (fmt, base, scale_name) in _matches(tensors, formats).items():
        scale = by_name[scale_name]
        file = _file(ckpt, scale)
        if scale.dtype != fmt.scale_dtype:
            raise InputError(f"scale dtype is {scale.dtype}, expected {fmt.scale_dtype}", file=file, tensor=scale_name,
                             fix=f"this is not a {fmt.title} checkpoint as published; re-download it")
        fmt.check(by_name[name].shape, scale.shape, scale_name, file)
        for other, role in fmt.besides(base).items():
            if role != "dropped":
                _check_beside(ckpt, fmt, by_name[name], by_name.get(other), other, role)
            paired.add(other)
        paired |= {name, scale_name}
    unpaired = [t for t in tensors if t.name not in paired]
    for t in unpaired:  # a weight without its scale first: the cause, where its orphans are the symptom
        _check_unpaired_weight(t, formats, _file(ckpt, t))
    for t in unpaired:
        _check_unpaired_scale(t, formats, _file(ckpt, t))


def _check_beside(ckpt: Checkpoint, fmt: QuantFormat, weight: TensorPlan, t: TensorPlan | None, name: str,
                  role: str) -> None:
    """A global scale is one F32; a stored shape (read here: 16 bytes) is the packed weight's shape."""
    wfile = _file(ckpt, weight)
    if t is None:
        raise InputError(f"{fmt.title} weight has no {name!r}", file=wfile, tensor=weight.name,
                         fix="the checkpoint is incomplete (or the index lost the entry); re-download it")
    file = _file(ckpt, t)
    if role == "global":
        if t.dtype != "F32" or t.shape not in ((), (1,)):
            raise InputError(f"{t.dtype} {list(t.shape)}, expected one F32 value", file=file, tensor=name,
                             fix=f"this is not a {fmt.title} checkpoint as published; re-download it")
        return
    if t.dtype not in ("I64", "I32") or t.shape != (2,):
        raise InputError(f"{t.dtype} {list(t.shape)}, expected two integers (rows, columns)", file=file, tensor=name,
                         fix=f"this is not a {fmt.title} checkpoint as published; re-download it")
    if not ckpt.local:  # streamed from the hub: no data before execution; config.json checks the shape
        return
    stored = tuple(int(v) for v in np.asarray(ckpt.read_array(name)))
    packed = fmt.out_shape(weight.shape)
    if stored != packed:
        why = (f"{stored[1]} columns do not fill whole int32 words of 8 values (compressed-tensors pads the last "
               "word; ckpttool reads whole words only)" if stored[0] == packed[0] and stored[1] % 8 else
               f"{weight.name} {list(weight.shape)} holds {list(packed)}")
        raise InputError(f"says the weight is {list(stored)}, but {why}", file=file, tensor=name,
                         fix="the checkpoint is inconsistent or padded; re-download it, or dequantize it with "
                             "compressed-tensors itself")


def _check_unpaired_weight(t: TensorPlan, formats: Formats, file) -> None:
    for fmt in formats:
        if t.dtype in fmt.weight_dtypes and t.name.endswith(fmt.weight_suffix):  # "" matches every name
            raise InputError(f"{fmt.title} weight has no {fmt.base_of(t.name) + fmt.scale_suffix!r}", file=file,
                             tensor=t.name,
                             fix="the checkpoint is incomplete (or the index lost the scale entry); re-download it")


def _check_unpaired_scale(t: TensorPlan, formats: Formats, file) -> None:
    for fmt in formats:
        if t.name.endswith(fmt.scale_suffix) and (fmt.weight_suffix or t.dtype == fmt.scale_dtype):
            raise InputError("scale has no quantized weight beside it", file=file, tensor=t.name,
                             fix="the checkpoint is incomplete; re-download it")


def dequant(tensors: list[TensorPlan], formats: Formats, out_dtype: str = "BF16") -> tuple[list[TensorPlan], int]:
    """Quantized weights become `out_dtype` tensors made from (weight, scale); the tensors beside them
    disappear. Returns the new list and how many weights were dequantized."""
    matches = _matches(tensors, formats)
    beside = _beside(matches, {t.name for t in tensors})
    out, n = [], 0
    for t in tensors:
        if t.name in beside:
            continue
        if t.name in matches:
            fmt, base, scale_name = matches[t.name]
            t = t.with_(name=base, dtype=out_dtype, shape=fmt.out_shape(t.shape), transform=fmt.name,
                        scale=scale_name)
            n += 1
        out.append(t)
    return out, n


def refuse_kept(tensors: list[TensorPlan], formats: Formats, source) -> None:
    """A plan that keeps quantized weights may only keep formats ckpttool can lay out again."""
    for fmt, _, _ in _matches(tensors, formats).values():
        if not fmt.keepable:
            raise PlanError(f"{fmt.title} weights can only be dequantized: ckpttool does not split or re-lay "
                            "packed groups across ranks", file=source,
                            fix="dequantize them too (`ckpttool convert --dtype bf16`, or a dequant stage)")
