"""The dequant stage, at plan time: resolve every quantized weight to its format (formats/resolve.py: the
config's rules against the headers), check the tensors beside it, and describe the dequantized tensor it
becomes. The formats, their names and which ones a config declares are rows of ckpttool/formats/."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ckpttool.errors import InputError, PlanError
from ckpttool.formats import Match, QuantFormat, Rule, resolve
from ckpttool.formats.repack import repackable
from ckpttool.formats.resolve import check_shapes, members_of, unclaimed
from ckpttool.formats.row import AT_PLAN, AT_PLAN_BYTES
from ckpttool.io.checkpoint import Checkpoint
from ckpttool.plan.types import TensorPlan

Rules = tuple[Rule, ...]
Planned = dict[str, QuantFormat]
"""values name -> the row a weight is planned with, where its AT_PLAN data decide it (check_scales)"""


def matches(tensors: list[TensorPlan], rules: Rules, file_of=lambda name: None) -> dict[str, Match]:
    """stored values name -> its Match, for every quantized weight in this list."""
    return resolve({t.name: (t.dtype, t.shape) for t in tensors}, rules, file_of)


def scale_names(tensors: list[TensorPlan], rules: Rules) -> set[str]:
    """Names of the tensors stored beside a quantized weight in this list (scales, global scales,
    shapes, activation scales): what the dequant stage consumes or drops."""
    found = matches(tensors, rules)
    return members_of(found) - set(found)


def _file(ckpt: Checkpoint, name: str):
    return ckpt.root / ckpt.source(name).file


def check_scales(tensors: list[TensorPlan], ckpt: Checkpoint, rules: Rules) -> Planned:
    """Every quantized weight resolves to exactly one declared format, with well-shaped side tensors of the
    right dtypes; every tensor that looks quantized belongs to one: no silent fallbacks (the reference
    warns and copies FP8 bytes through as if they were BF16). Returns the row of each weight whose row
    reads its AT_PLAN sides to plan it (`QuantFormat.at_plan`: bitsandbytes' quant state), by values name."""
    header = {t.name: (t.dtype, t.shape) for t in tensors}
    found = resolve(header, rules, lambda name: _file(ckpt, name))
    planned: Planned = {}
    for m in found.values():
        row = m.row
        for side in row.sides:
            name = m.members.get(side.role)
            if name is None or not side.dtypes:
                continue
            dtype = header[name][0]
            if dtype not in side.dtypes:
                raise InputError(f"{side.role} dtype is {dtype}, expected {' or '.join(side.dtypes)}",
                                 file=_file(ckpt, name), tensor=name,
                                 fix=f"this is not a {row.title} checkpoint as published; re-download it")
        check_shapes(m, header, _file(ckpt, m.members.get("scale", m.values)))
        for side in row.sides:
            if side.role in ("global", "shape") and side.role in m.members:
                _check_beside(ckpt, m, m.members[side.role], side.role, header)
        if row.at_plan is not None:
            shapes = {role: header[n][1] for role, n in m.members.items()}
            planned[m.values] = row.at_plan(header[m.values][1], shapes, _plan_data(ckpt, m), m.members,
                                            _file(ckpt, m.values))
    unclaimed(header, rules, found, lambda name: _file(ckpt, name))
    return planned


def _plan_data(ckpt: Checkpoint, m: Match) -> dict[str, np.ndarray]:
    """The AT_PLAN sides of a weight whose row plans it from them, read now (each at most AT_PLAN_BYTES)."""
    data = {}
    for side in m.row.sides:
        name = m.members.get(side.role)
        if side.read != AT_PLAN or name is None:
            continue
        nbytes = ckpt.source(name).info.nbytes
        if nbytes > AT_PLAN_BYTES:
            raise InputError(f"{side.role} is {nbytes} bytes; a {m.row.title} {side.role} is at most {AT_PLAN_BYTES}",
                             file=_file(ckpt, name), tensor=name,
                             fix=f"this is not a {m.row.title} checkpoint as published; re-download it")
        if not ckpt.local:
            raise InputError(f"{m.row.title} weights are planned from the data of tensors stored beside them (this "
                             "one), which a streamed hub input does not have before it runs", file=_file(ckpt, name),
                             tensor=name,
                             fix="download the checkpoint first (`ckpttool download REPO_ID DIR`), then convert DIR")
        data[side.role] = ckpt.read_array(name)
    return data


def _check_beside(ckpt: Checkpoint, m: Match, name: str, role: str, header) -> None:
    """A global scale is one F32; a stored shape (read here: 16 bytes) is the packed weight's shape."""
    dtype, shape = header[name]
    file = _file(ckpt, name)
    title = m.row.title
    if role == "global":
        if shape not in ((), (1,)):
            raise InputError(f"{dtype} {list(shape)}, expected one F32 value", file=file, tensor=name,
                             fix=f"this is not a {title} checkpoint as published; re-download it")
        return
    if shape != (2,):
        raise InputError(f"{dtype} {list(shape)}, expected two integers (rows, columns)", file=file, tensor=name,
                         fix=f"this is not a {title} checkpoint as published; re-download it")
    if not ckpt.local:  # streamed from the hub: no data before execution; config.json checks the shape
        return
    stored = tuple(int(v) for v in np.asarray(ckpt.read_array(name)))
    packed = m.row.out_shape(header[m.values][1])
    if stored != packed:
        why = (f"{stored[1]} columns do not fill whole int32 words of 8 values (compressed-tensors pads the last "
               "word; ckpttool reads whole words only)" if stored[0] == packed[0] and stored[1] % 8 else
               f"{m.values} {list(header[m.values][1])} holds {list(packed)}")
        raise InputError(f"says the weight is {list(stored)}, but {why}", file=file, tensor=name,
                         fix="the checkpoint is inconsistent or padded; re-download it, or dequantize it with "
                             "compressed-tensors itself")


def dequant(tensors: list[TensorPlan], rules: Rules, out_dtype: str = "BF16", planned: Planned | None = None
            ) -> tuple[list[TensorPlan], int]:
    """Quantized weights become `out_dtype` tensors made from their values and side tensors; the side
    tensors disappear. Returns the new list and how many weights were dequantized. `planned`: check_scales'
    rows of the weights whose AT_PLAN data decide their row."""
    found = {name: _planned(m, planned) for name, m in matches(tensors, rules).items()}
    beside = members_of(found) - set(found)
    out, n = [], 0
    for t in tensors:
        if t.name in beside:
            continue
        m = found.get(t.name)
        if m is not None:
            t = t.with_(name=m.base, dtype=out_dtype, shape=m.row.out_shape(t.shape), transform=m.row.name,
                        sides=m.sides)
            n += 1
        out.append(t)
    return out, n


def _planned(m: Match, planned: Planned | None) -> Match:
    row = (planned or {}).get(m.values, m.row)
    if row.at_plan is not None:
        raise PlanError(f"{m.row.title} weights are planned from their data (check_scales), which this plan did not "
                        "read", tensor=m.values, fix="report this: it is a bug in ckpttool")
    return replace(m, row=row)


def refuse_kept(tensors: list[TensorPlan], rules: Rules, source) -> None:
    """A plan that keeps quantized weights may only keep formats ckpttool can lay out again."""
    for m in matches(tensors, rules).values():
        if not m.row.keepable:
            repack = ("; or repack them exactly into FP8 128x128 blocks, which the mp layout cuts: `ckpttool "
                      "quantize SRC DST --to fp8-128x128 --mp N`" if repackable(m.row) else "")
            raise PlanError(f"{m.row.title} weights can only be dequantized: ckpttool does not split or re-lay "
                            "packed groups across ranks", file=source, tensor=m.values,
                            fix="dequantize them too (`ckpttool convert --dtype bf16`, or a dequant stage)" + repack)
