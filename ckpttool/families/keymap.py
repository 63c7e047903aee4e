"""One table of `(hf template, native template, split[, LINEAR])` rows serves both directions.

Templates use `{layer}` / `{expert}` for numeric name components. Lookup is O(1): a name's numeric
components are replaced by `{}` and the result is the key, so 90k-tensor checkpoints map quickly.

Two columns beyond the names:
- `split`: an int dim cut evenly over ranks, a `HeadSplit`, `EXPERT` (whole tensors on the rank
  owning the expert) or None (replicated).
- `LINEAR`: the row is a linear projection weight: what published FP8 checkpoints quantize and what
  the quantize stage quantizes (never embeddings, norms, biases, routers or heads).

Every `*.weight` row implies one row per scale companion of the format table (formats.COMPANIONS:
`X.weight_scale_inv` <-> `Y.scale`), with the weight's split; `Mapped.companion` says which. A table whose
checkpoints name a weight's scale otherwise says so with `hf_scale_leaf` (DeepSeek-V4: `X.scale`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ckpttool.formats import COMPANIONS, Companion, with_leaf

_PLACEHOLDER = re.compile(r"\{(\w+)\}")

LINEAR = True
"""fourth column of a key-table row: a linear projection weight (see the module docstring)"""
EXPERT = "expert"
"""split of a routed expert's tensors: whole, on the rank that owns the expert's contiguous range"""


@dataclass(frozen=True, slots=True)
class KeyRow:
    hf: str
    native: str
    split: object  # int dim, EXPERT, families.base.HeadSplit, or None
    linear: bool = False
    companion: Companion | None = None
    weight: "KeyRow | None" = None  # for a companion row: the weight's row

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(_PLACEHOLDER.findall(self.hf))


def _shape_key(template_or_name: str) -> str:
    parts = template_or_name.split(".")
    return ".".join("{}" if (p.isdigit() or _PLACEHOLDER.fullmatch(p)) else p for p in parts)


def _numbers(name: str) -> list[int]:
    return [int(p) for p in name.split(".") if p.isdigit()]


@dataclass(frozen=True, slots=True)
class Mapped:
    name: str
    split: object
    values: dict[str, int]
    row: KeyRow

    @property
    def companion(self) -> Companion | None:
        return self.row.companion

    @property
    def hf_weight(self) -> str | None:
        """For a scale companion, the HF name of the weight it belongs to."""
        return None if self.row.weight is None else self.row.weight.hf.format(**self.values)


class KeyMap:
    def __init__(self, rows: list[tuple], *, hf_scale_leaf: str | None = None):
        """`hf_scale_leaf`: the leaf these checkpoints give every weight's scale (`X.<leaf>`), where it is
        not the format table's own (DeepSeek-V4 names it `X.scale` where V3 says `X.weight_scale_inv`)."""
        companions = COMPANIONS if hf_scale_leaf is None else tuple(replace(c, hf_leaf=hf_scale_leaf)
                                                                    for c in COMPANIONS)
        self.rows = [KeyRow(*r) for r in rows]
        for r in list(self.rows):
            if r.hf.endswith(".weight") and r.native.endswith(".weight"):
                self.rows += [KeyRow(with_leaf(r.hf, c.hf_leaf), with_leaf(r.native, c.native_leaf), r.split,
                                     companion=c, weight=r) for c in companions]
        self._by_hf = {_shape_key(r.hf): r for r in self.rows}
        self._by_native = {_shape_key(r.native): r for r in self.rows}
        if len(self._by_hf) != len(self.rows) or len(self._by_native) != len(self.rows):
            raise ValueError("key table has two rows with the same template")
        for r in self.rows:
            if set(_PLACEHOLDER.findall(r.hf)) != set(_PLACEHOLDER.findall(r.native)):
                raise ValueError(f"row {r.hf} -> {r.native} changes placeholders")

    def to_native(self, hf_name: str) -> Mapped | None:
        return self._translate(hf_name, self._by_hf, forward=True)

    def to_hf(self, native_name: str) -> Mapped | None:
        return self._translate(native_name, self._by_native, forward=False)

    def is_linear(self, hf_name: str) -> bool:
        row = self._by_hf.get(_shape_key(hf_name))
        return row is not None and row.linear

    @staticmethod
    def _translate(name: str, table: dict[str, KeyRow], *, forward: bool) -> Mapped | None:
        row = table.get(_shape_key(name))
        if row is None:
            return None
        src, dst = (row.hf, row.native) if forward else (row.native, row.hf)
        values = dict(zip(_PLACEHOLDER.findall(src), _numbers(name)))
        return Mapped(dst.format(**values), row.split, values, row)
