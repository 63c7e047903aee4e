"""One table of `(hf template, native template, split)` rows serves both directions.

Templates use `{layer}` / `{expert}` for numeric name components. Lookup is O(1): a name's numeric
components are replaced by `{}` and the result is the key, so 90k-tensor checkpoints map quickly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_PLACEHOLDER = re.compile(r"\{(\w+)\}")


@dataclass(frozen=True, slots=True)
class KeyRow:
    hf: str
    native: str
    split: object  # int dim, arch.deepseek.EXPERT, arch.base.HeadSplit, or None

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


class KeyMap:
    def __init__(self, rows: list[tuple[str, str, object]]):
        self.rows = [KeyRow(*r) for r in rows]
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

    @staticmethod
    def _translate(name: str, table: dict[str, KeyRow], *, forward: bool) -> Mapped | None:
        row = table.get(_shape_key(name))
        if row is None:
            return None
        src, dst = (row.hf, row.native) if forward else (row.native, row.hf)
        values = dict(zip(_PLACEHOLDER.findall(src), _numbers(name)))
        return Mapped(dst.format(**values), row.split, values)
