"""One table of `(hf template, native template, split[, LINEAR])` rows serves both directions.

Templates use `{layer}` / `{expert}` for numeric name components. Lookup is O(1): a name's numeric
components are replaced by `{}` and the result is the key, so 90k-tensor checkpoints map quickly.

Two columns beyond the names:
- `split`: an int dim cut evenly over ranks, a `HeadSplit`, `EXPERT` (whole tensors on the rank
  owning the expert), a `Segment` (one of the consecutive parts an HF tensor holds, each cut on whole
  heads: the only rows that share an HF template) or None (replicated).
- `LINEAR`: the row is a linear projection weight: what published FP8 checkpoints quantize and what
  the quantize stage quantizes (never embeddings, norms, biases, routers or heads).
- a fifth column, a dtype (`MP_BF16`): the mp layout holds this weight dequantized where the checkpoint stores
  it quantized, as the family's reference convert.py writes it (DeepSeek-V4's `wo_a`, which its model runs in
  BF16); the HF layout keeps it as stored.

Every `*.weight` row implies one row per scale companion of the format table (formats.COMPANIONS:
`X.weight_scale_inv` <-> `Y.scale`), with the weight's split; `Mapped.companion` says which. A table whose
checkpoints name a weight's scale otherwise says so with `hf_scale_leaf` (DeepSeek-V4: `X.scale`).

A table may also list aliases: another HF spelling of one of its rows that some checkpoints use (what
transformers 5's save_pretrained writes with save_original_format=False: Mixtral's router at `mlp.gate`
where the published checkpoints say `block_sparse_moe.gate`). Aliases are read as the row's HF name
(`canonical`); outputs and merge always write the row's own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ckpttool.errors import PlanError
from ckpttool.formats import COMPANIONS, Companion, with_leaf

_PLACEHOLDER = re.compile(r"\{(\w+)\}")

LINEAR = True
"""fourth column of a key-table row: a linear projection weight (see the module docstring)"""
RANK0 = "rank 0"
"""split of a part a table passes through (a multimodal wrapper's vision tower and projector): whole, on
rank 0 only, under its HF name"""
MP_BF16 = "BF16"
"""fifth column of a key-table row: the mp layout holds the weight in BF16 (see the module docstring)"""
EXPERT = "expert"
"""split of a routed expert's tensors: whole, on the rank that owns the expert's contiguous range"""


@dataclass(frozen=True, slots=True)
class Segment:
    """Split of a native tensor that is one of the consecutive segments an HF tensor holds along `dim`
    (Gated DeltaNet's conv1d and in_proj_qkv: every q channel, then every k, then every v, so a rank's
    heads are three ranges, not one): segment `index` of the lengths the parsed config's `sizes` fields
    give, cut over ranks by `heads` (a families.base.HeadSplit along the same dim). Even at mp=1 each
    segment is a tensor of its own; merge concatenates them back in order."""

    dim: int
    sizes: tuple[str, ...]
    index: int
    heads: object  # families.base.HeadSplit

    def rank_ranges(self, weight_shape: tuple[int, ...], cfg, mp: int, *, tensor: str | None = None,
                    file=None) -> list[tuple[int, int]]:
        """(start, length) along `dim` of the HF tensor: each rank's part of this segment."""
        sizes = [getattr(cfg, s) for s in self.sizes]
        if sum(sizes) != weight_shape[self.dim]:
            raise PlanError(f"dim {self.dim} ({weight_shape[self.dim]}) is not the {' + '.join(self.sizes)} "
                            f"({' + '.join(map(str, sizes))}) config.json implies", file=file, tensor=tensor,
                            fix="check that config.json belongs to this checkpoint")
        offset, size = sum(sizes[:self.index]), sizes[self.index]
        shape = tuple(size if d == self.dim else n for d, n in enumerate(weight_shape))
        return [(offset + start, length)
                for start, length in self.heads.rank_ranges(shape, cfg, mp, tensor=tensor, file=file)]


@dataclass(frozen=True, slots=True)
class KeyRow:
    hf: str
    native: str
    split: object  # int dim, EXPERT, families.base.HeadSplit, or None
    linear: bool = False
    mp_dtype: str | None = None
    """the dtype the mp layout holds the weight in where its checkpoint stores it quantized (dequantized as the
    layout is written), None: as stored (DeepSeek-V4's wo_a, which its model computes in BF16)"""
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
    def __init__(self, rows: list[tuple], *, hf_scale_leaf: str | None = None,
                 aliases: tuple[tuple[str, str], ...] = (), passthrough: tuple[str, ...] = ()):
        """`hf_scale_leaf`: the leaf these checkpoints give every weight's scale (`X.<leaf>`), where it is
        not the format table's own (DeepSeek-V4 names it `X.scale` where V3 says `X.weight_scale_inv`).
        `aliases`: (another spelling, a row's HF template) pairs (see the module docstring).
        `passthrough`: name prefixes of parts carried unchanged (RANK0), e.g. a wrapper's vision tower."""
        self._hf_scale_leaf, self.passthrough, self._alias_pairs = hf_scale_leaf, tuple(passthrough), tuple(aliases)
        companions = COMPANIONS if hf_scale_leaf is None else tuple(replace(c, hf_leaf=hf_scale_leaf)
                                                                    for c in COMPANIONS)
        self.rows = [KeyRow(*r) for r in rows]
        for r in list(self.rows):
            if r.hf.endswith(".weight") and r.native.endswith(".weight"):
                self.rows += [KeyRow(with_leaf(r.hf, c.hf_leaf), with_leaf(r.native, c.native_leaf), r.split,
                                     companion=c, weight=r) for c in companions]
        self._by_hf: dict[str, KeyRow] = {}
        self._segments: dict[str, list[KeyRow]] = {}  # HF template -> its Segment rows, in index order
        for r in self.rows:
            if isinstance(r.split, Segment):
                self._segments.setdefault(_shape_key(r.hf), []).append(r)
            self._by_hf.setdefault(_shape_key(r.hf), r)
        self._by_native = {_shape_key(r.native): r for r in self.rows}
        shared = sum(len(rows) - 1 for rows in self._segments.values())
        if len(self._by_hf) != len(self.rows) - shared or len(self._by_native) != len(self.rows):
            raise ValueError("key table has two rows with the same template")
        for key, rows in self._segments.items():
            rows.sort(key=lambda r: r.split.index)
            if [r.split.index for r in rows] != list(range(len(rows[0].split.sizes))) or \
                    len({(r.split.dim, r.split.sizes) for r in rows}) != 1:
                raise ValueError(f"segments of {rows[0].hf} are not each of its {rows[0].split.sizes} once")
        for r in self.rows:
            if set(_PLACEHOLDER.findall(r.hf)) != set(_PLACEHOLDER.findall(r.native)):
                raise ValueError(f"row {r.hf} -> {r.native} changes placeholders")
        self._aliases: dict[str, tuple[str, str]] = {}
        for alias, hf in aliases:
            row = self._by_hf.get(_shape_key(hf))
            if row is None or row.hf != hf or _shape_key(alias) in self._by_hf:
                raise ValueError(f"alias {alias} -> {hf} is not another spelling of one row")
            if _PLACEHOLDER.findall(alias) != _PLACEHOLDER.findall(hf):
                raise ValueError(f"alias {alias} -> {hf} changes placeholders")
            self._aliases[_shape_key(alias)] = (alias, hf)

    def to_native(self, hf_name: str) -> Mapped | None:
        """The native tensor of an HF one (the first, for one held as segments: see `to_natives`)."""
        return self._passed(hf_name) or self._translate(hf_name, self._by_hf, forward=True)

    def to_natives(self, hf_name: str) -> list[Mapped]:
        """Every native tensor an HF tensor becomes: one, or one per `Segment`, in order."""
        rows = self._segments.get(_shape_key(hf_name))
        if rows is None:
            mapped = self.to_native(hf_name)
            return [] if mapped is None else [mapped]
        return [self._translate(hf_name, {_shape_key(hf_name): r}, forward=True) for r in rows]

    def to_hf(self, native_name: str) -> Mapped | None:
        return self._passed(native_name) or self._translate(native_name, self._by_native, forward=False)

    def canonical(self, hf_name: str) -> str | None:
        """The row's HF name of a tensor spelled as one of the table's aliases (None: not an alias)."""
        entry = self._aliases.get(_shape_key(hf_name))
        if entry is None:
            return None
        alias, hf = entry
        return hf.format(**dict(zip(_PLACEHOLDER.findall(alias), _numbers(hf_name))))

    def is_linear(self, hf_name: str) -> bool:
        row = self._by_hf.get(_shape_key(hf_name))
        return row is not None and row.linear

    def mp_dtype(self, hf_name: str) -> str | None:
        """The dtype the mp layout holds this quantized weight in (the row's fifth column), or None: as stored."""
        row = self._by_hf.get(_shape_key(hf_name))
        return None if row is None else row.mp_dtype

    def passes_through(self, name: str) -> bool:
        """A name under one of the `passthrough` prefixes: carried unchanged, whole, on rank 0."""
        return any(name.startswith(p) for p in self.passthrough)

    def renamed(self, hf_name, passthrough: tuple[str, ...] = ()) -> "KeyMap":
        """This table with every HF template renamed by `hf_name` (str -> str: a wrapper's prefix on its text
        tower; the native side is unchanged; a row it renames to None is left out), its aliases renamed alike, the same scale leaf, and `passthrough`
        prefixes of its own."""
        rows = [(hf, r.native, r.split, r.linear, r.mp_dtype) for r in self.rows
                if r.companion is None and (hf := hf_name(r.hf)) is not None]
        aliases = tuple((a, h) for a, h in ((hf_name(a), hf_name(h)) for a, h in self._alias_pairs)
                        if a is not None and h is not None)
        return KeyMap(rows, hf_scale_leaf=self._hf_scale_leaf, aliases=aliases, passthrough=passthrough)

    def _passed(self, name: str) -> Mapped | None:
        if not self.passes_through(name):
            return None
        return Mapped(name, RANK0, {}, KeyRow(name, name, RANK0))

    @staticmethod
    def _translate(name: str, table: dict[str, KeyRow], *, forward: bool) -> Mapped | None:
        row = table.get(_shape_key(name))
        if row is None:
            return None
        src, dst = (row.hf, row.native) if forward else (row.native, row.hf)
        values = dict(zip(_PLACEHOLDER.findall(src), _numbers(name)))
        return Mapped(dst.format(**values), row.split, values, row)
