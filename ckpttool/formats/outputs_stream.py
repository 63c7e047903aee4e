"""The quantize stage's outputs that stream: each a row the executor runs as it runs a dequant row (formats/row.py),
a run of the weight's rows in, the matching run of the output's rows out, so memory stays flat however large the
weight. `Output.per_row` says how many weight rows make one output row (1: codes and per-row scales; 128: an FP8
block scale row; 8 or 4: a zero point word packed along the rows); the run is the row's whole computation on those
rows (per-row, per-group and per-block statistics need no other rows), so the bytes are the whole tensor's.
NVFP4's global scale is the whole tensor's amax: its rows take a first pass (`Target.prepass`, the row's
`prepass`), the max of each run's amax over every run of the weight, before any run is quantized; memory stays
flat at the cost of reading the weight twice. gpt-fast's int4 `scales_and_zeros` (stored transposed, a row per
group of columns) runs whole (`QUANTIZE_TRANSFORMS`).

Names: the table's (`Output.transform`), and `{transform}:{rows}x{cols}` for a tensor made from the weight's shape
alone (compressed-tensors' `weight_shape`).
"""

from __future__ import annotations

import functools

import numpy as np

from ckpttool.dtypes import torch_dtype
from ckpttool.formats.outputs import TARGETS, Output, Target
from ckpttool.formats.row import Chunk, Name, QuantFormat, via_cpu
from ckpttool.kernels.quant import check_finite

FLOAT_DTYPES = ("BF16", "F16", "F32")
WHOLE = 1 << 40
"""row_align of a tensor made from the weight's shape: one run writes it all"""
_PREPASS: dict = {}
"""a target's first-pass function, one object for all its outputs (the executor computes it once per weight)"""
_BY_TRANSFORM = {o.transform: (t, o) for t in TARGETS for o in t.outputs if o.per_row is not None}


def is_streamed(name: str | None) -> bool:
    return name is not None and named(name) is not None


def _torch_rows(c: Chunk):
    import torch

    return torch.from_numpy(np.ascontiguousarray(c.values)).view(torch_dtype(c.dtype))


def _as_rows(t) -> np.ndarray:
    import torch

    if not t.dim():
        return t.reshape(1).numpy()
    # flat first: a contiguous [n, 1] may keep a column stride other than 1, which a view as bytes refuses
    return t.contiguous().reshape(-1).view(torch.uint8).reshape(t.shape[0], -1).numpy()


def _row(target: Target, out: Output, shape: tuple[int, int] | None) -> QuantFormat:
    k = out.per_row
    def compute(w, c: Chunk):
        check_finite(w)
        if target.prepass is None:
            return target.compute(w, out.leaf)[out.leaf]
        return target.compute(w, out.leaf, stat=c.global_scale)[out.leaf]  # the first pass's, over every row

    def cpu(c: Chunk, dtype: str, into) -> np.ndarray:
        import torch

        if shape is not None:
            return np.asarray(shape, dtype=np.int64)
        with torch.no_grad():
            return _as_rows(compute(_torch_rows(c), c))

    def example(dev) -> Chunk:
        import torch

        # 256 columns: every target's group divides them
        return Chunk(torch.zeros(128, 256, dtype=torch.bfloat16, device=dev), "BF16")

    def span(r0: int, r1: int, s: tuple) -> tuple[int, int, int]:
        return (0, 0, min(1, s[0])) if shape is not None or out.stat else (0, r0 * k, min(r1 * k, s[0]))

    def prepass(c: Chunk) -> float:
        import torch

        with torch.no_grad():
            return target.prepass(_torch_rows(c))

    name = out.transform if shape is None else f"{out.transform}:{shape[0]}x{shape[1]}"
    return QuantFormat(name=name, title=f"{target.title}: {out.leaf}", values=Name("weight"),
                       value_dtypes=FLOAT_DTYPES, sides=(), check=lambda *a: None,
                       out_shape=lambda s: tuple(out.shape(*s)), source_span=span,
                       row_align=WHOLE if shape is not None or out.stat else max(out.align, 1),
                       cpu=cpu, cuda=via_cpu(cpu), example=example, keepable=False,
                       prepass=None if target.prepass is None else _PREPASS.setdefault(target.name, prepass))


def named(name: str) -> QuantFormat | None:
    """The row a plan's transform name stands for, or None."""
    if not isinstance(name, str) or not name.startswith("quantize"):
        return None
    return _named(name)


@functools.lru_cache(maxsize=None)
def _named(name: str) -> QuantFormat | None:
    if name in _BY_TRANSFORM:
        return _row(*_BY_TRANSFORM[name], None)
    base, _, size = name.rpartition(":")
    rows, _, cols = size.partition("x")
    if base in _BY_TRANSFORM and _BY_TRANSFORM[base][1].per_row == 0 and rows.isdigit() and cols.isdigit():
        return _row(*_BY_TRANSFORM[base], (int(rows), int(cols)))
    return None
