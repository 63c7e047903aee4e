"""Tensors read from an input stored in boxes (mp ranks, DCP chunks: `SourceTensor.pieces`) become gathers.

The stages plan every tensor as if the input were one HF checkpoint: a name, a dtype, a shape and, for a rank of
an mp output, the `narrow` it takes. Here each such tensor whose source is stored in boxes becomes the boxes of the
stored tensors it crosses (`TensorPlan.parts` + `boxes`), which the executor copies or assembles run by run
(execute/gather.py): mp N to mp M and a DCP to HF in one streaming pass, the same bytes as assembling first.
"""

from __future__ import annotations

import math

from ckpttool.errors import PlanError
from ckpttool.plan.types import TensorPlan


def assemble(tensors: list[TensorPlan], ckpt) -> list[TensorPlan]:
    out = []
    for t in tensors:
        src = ckpt.tensors.get(t.source)
        if src is None or not src.pieces:
            out.append(t)
            continue
        if t.transform is not None:
            raise PlanError(f"this tensor is stored cut in {len(src.pieces)} pieces ({src.pieces[0].file}, ...), and "
                            f"{t.transform} reads it whole", file=ckpt.root, tensor=t.source,
                            fix="keep the input's dtype (--dtype fp8 keeps FP8 weights), or merge the input into one "
                                "HF checkpoint first and convert that")
        out.append(t.with_(**boxes_of(t, src)))
    return out


def boxes_of(t: TensorPlan, src) -> dict:
    """`parts` and `boxes` of the pieces the (narrowed) tensor crosses; they must cover it exactly."""
    start, size = [0] * len(src.info.shape), list(src.info.shape)
    if t.narrow is not None:
        dim, first, length = t.narrow
        start[dim], size[dim] = first, length
    parts, boxes = [], []
    for p in src.pieces:
        lo = [max(a, o) for a, o in zip(start, p.offset)]
        hi = [min(a + n, o + k) for a, n, o, k in zip(start, size, p.offset, p.info.shape)]
        if any(low >= high for low, high in zip(lo, hi)):
            continue
        parts.append((p.file, p.name))
        boxes.append((tuple(low - o for low, o in zip(lo, p.offset)), tuple(high - low for low, high in zip(lo, hi)),
                      tuple(low - a for low, a in zip(lo, start))))
    if sum(math.prod(n) for _, n, _ in boxes) != math.prod(size):  # the pieces were checked to tile it when read
        raise PlanError(f"the pieces of this tensor do not cover {size} at {start}", tensor=t.source,
                        fix="the input's pieces overlap or leave gaps; it is corrupt")
    return {"parts": tuple(parts), "boxes": tuple(boxes)}
