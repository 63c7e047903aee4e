"""The model-parallel layout: `model{i}-mp{N}.safetensors`, one file per rank, tensors under the family's native
names (DeepSeek's reference layout for the MLA types, ours for dense / MoE / gpt-oss, DeepSeek-V4's), cut per rank
by the family's key table (plan/shard.py), and read back through the same table backwards (`merged_tensors`):
each HF tensor is its ranks' slices concatenated along the row's split dim; replicated tensors come from rank 0,
routed experts from the one rank holding them, KV heads replicated over several ranks from the first rank
holding each; parts a table passes through (a wrapper's vision tower) from rank 0, as they are; a tensor held as
segments (`Segment`) is its segments' parts one after another. Every merged
shape is checked against the shapes config.json implies."""

from __future__ import annotations

from pathlib import Path

from ckpttool.errors import InputError
from ckpttool.families.base import HeadSplit
from ckpttool.families.keymap import EXPERT, RANK0, Segment
from ckpttool.families.table import family_for
from ckpttool.io.checkpoint import Checkpoint, Piece, ShardFiles, SourceTensor, read_config
from ckpttool.io.layout import INDEX_NAME, MP_FILE, find_mp, mp_file
from ckpttool.io.listed import Listed
from ckpttool.io.safetensors import SafetensorsFile, TensorInfo
from ckpttool.kernels.fp8 import scale_shape
from ckpttool.layouts.row import Layout, no_extras
from ckpttool.plan.shard import shard
from ckpttool.plan.types import TensorPlan, layout


def rank_files(directory: Path, mp: int | None = None) -> list[str]:
    """Each rank's file, in rank order: all N present, no rank beyond them."""
    mp = find_mp(directory, mp)
    return [mp_file(r, mp) for r in range(mp)]


def merged_tensors(headers: list[SafetensorsFile], family, cfg, expected: dict) -> list[TensorPlan]:
    """The HF tensors the ranks' files hold, each as the (file, native name) parts it is concatenated from along
    `concat_dim`, in natural name order. Refuses a name the family's table does not know, a rank missing a
    tensor, ranks disagreeing on a dtype and a merged shape config.json does not imply."""
    from ckpttool.layouts.hf import natural

    pieces: dict[str, dict[int, list[tuple[int, str]]]] = {}  # HF name -> segment -> [(rank, native name)]
    mapped_of: dict[tuple[str, int], object] = {}
    for rank, header in enumerate(headers):
        for native in header.tensors:
            mapped = family.keys(cfg).to_hf(native)
            if mapped is None:
                raise InputError(f"not a {family.name} mp tensor name", file=header.path, tensor=native,
                                 fix="merge reads what `ckpttool shard` writes for this config.json's model_type")
            segment = mapped.split.index if isinstance(mapped.split, Segment) else 0
            pieces.setdefault(mapped.name, {}).setdefault(segment, []).append((rank, native))
            mapped_of[mapped.name, segment] = mapped
    mp = len(headers)
    return [_joined(hf, {i: _merged_tensor(hf, found, mapped_of[hf, i], headers, expected, cfg, mp)
                         for i, found in pieces[hf].items()}, mapped_of[hf, min(pieces[hf])], headers)
            for hf in sorted(pieces, key=natural)]


def _joined(hf: str, segments: dict[int, TensorPlan], mapped, headers: list[SafetensorsFile]) -> TensorPlan:
    """An HF tensor from its one merged part, or from every segment's parts one after another."""
    if not isinstance(mapped.split, Segment):
        return segments[0]
    merged, dim = [segments[i] for i in sorted(segments)], mapped.split.dim
    problem = (f"the shards hold segments {sorted(segments)} of it, not each of {list(mapped.split.sizes)}"
               if sorted(segments) != list(range(len(mapped.split.sizes))) else
               f"its segments disagree on the dtype ({sorted({t.dtype for t in merged})})"
               if len({t.dtype for t in merged}) > 1 else None)
    if problem:
        raise InputError(problem, file=headers[0].path, tensor=hf,
                         fix="the shards are incomplete or from different conversions")
    shape = tuple(sum(t.shape[dim] for t in merged) if d == dim else n for d, n in enumerate(merged[0].shape))
    return merged[0].with_(shape=shape, parts=tuple(p for t in merged for p in t.parts), concat_dim=dim)


def _merged_tensor(hf: str, found: list[tuple[int, str]], mapped, headers: list[SafetensorsFile],
                   expected: dict, cfg, mp: int) -> TensorPlan:
    split, companion = mapped.split, mapped.companion
    weight = mapped.hf_weight or hf
    if split == RANK0:  # a part passed through whole on rank 0 (a wrapper's vision tower): as it is there
        info = headers[found[0][0]].tensors[found[0][1]]
        if [rank for rank, _ in found] != [0]:
            raise InputError(f"a part passed through unchanged is on rank(s) {[r for r, _ in found]}, expected on "
                             "rank 0 only", file=headers[found[0][0]].path, tensor=found[0][1],
                             fix="the shards are not what `ckpttool shard` wrote; convert again")
        return TensorPlan(hf, info.dtype, tuple(info.shape), source=found[0][1],
                          parts=((headers[0].path.name, found[0][1]),), concat_dim=0)
    if weight not in expected:
        raise InputError("tensor is not part of the model config.json describes", file=headers[found[0][0]].path,
                         tensor=found[0][1], fix="check that config.json belongs to these shards")
    full = tuple(expected[weight])
    if companion is not None:
        full = scale_shape(full, companion.block)
    if isinstance(split, Segment):  # this segment's own extent: its one range at mp=1
        length = split.rank_ranges(tuple(expected[weight]), cfg, 1, tensor=found[0][1])[0][1]
        full = tuple(length if d == split.dim else n for d, n in enumerate(tuple(expected[weight])))
        if companion is not None:
            full = scale_shape(full, companion.block)
    infos = {rank: headers[rank].tensors[native] for rank, native in found}
    dtypes = {i.dtype for i in infos.values()}
    rank0, native0 = found[0]
    if len(dtypes) > 1:
        raise InputError(f"ranks disagree on the dtype ({sorted(dtypes)})", file=headers[rank0].path, tensor=native0)
    ranks = sorted(infos)

    def part(rank: int) -> tuple[str, str]:
        return (headers[rank].path.name, dict(found)[rank])

    def need_all_ranks() -> None:
        if ranks != list(range(mp)):
            missing = sorted(set(range(mp)) - set(ranks))
            raise InputError(f"rank(s) {missing} lack this tensor", file=headers[missing[0]].path, tensor=native0,
                             fix="the shards are incomplete or from different conversions")

    concat_dim = 0
    if split == EXPERT:
        if len(ranks) != 1:
            raise InputError(f"routed expert tensor is on ranks {ranks}, expected one", tensor=native0,
                             file=headers[rank0].path)
        parts = (part(ranks[0]),)
    elif split is None or (mp == 1 and not isinstance(split, Segment)):
        need_all_ranks()
        parts = (part(0),)
    elif isinstance(split, (HeadSplit, Segment)):
        need_all_ranks()
        ranges = split.rank_ranges(tuple(expected[weight]), cfg, mp, tensor=native0, file=headers[rank0].path)
        if companion is not None:
            ranges = [companion.scale_range(start, length) for start, length in ranges]
        first_holder: dict[tuple[int, int], int] = {}
        for rank, rng in enumerate(ranges):
            first_holder.setdefault(rng, rank)  # a replicated KV head: take it from its first rank
        parts = tuple(part(first_holder[rng]) for rng in sorted(first_holder))
        concat_dim = split.dim
    else:
        need_all_ranks()
        parts = tuple(part(r) for r in ranks)
        concat_dim = split
    by_part = {(headers[r].path.name, n): infos[r] for r, n in found}
    got = list(by_part[parts[0]].shape)
    if len(parts) > 1:
        got[concat_dim] = sum(by_part[p].shape[concat_dim] for p in parts)
    if tuple(got) != full:
        raise InputError(f"merged shape {got} contradicts config.json, which implies {list(full)}",
                         file=headers[rank0].path, tensor=native0,
                         fix="check that config.json belongs to these shards and all ranks are present")
    return TensorPlan(hf, dtypes.pop(), full, source=parts[0][1], parts=parts, concat_dim=concat_dim)


def _unquantized(tensors: list[TensorPlan], rules, keys) -> list[TensorPlan]:
    """The quantized weights the family's reference mp layout holds dequantized (the key table's mp dtype column:
    DeepSeek-V4's wo_a, BF16 in DeepSeek's convert.py), dequantized as the dequant stage does, their scales gone."""
    from ckpttool.plan.dequant import dequant, matches

    found = {v: m for v, m in matches(tensors, rules).items() if keys.mp_dtype(m.base) is not None}
    out = [t for t in tensors if not any(t.name in m.present() for m in found.values())]
    for dtype in sorted({keys.mp_dtype(m.base) for m in found.values()}):
        names = set().union(*(m.present() for m in found.values() if keys.mp_dtype(m.base) == dtype))
        out += dequant([t for t in tensors if t.name in names], rules, dtype)[0]
    return out


def _place(tensors: list[TensorPlan], family, cfg, ranks: int | None, files_of: dict, input_files) -> list[TensorPlan]:
    return shard([t.with_(file=None) for t in tensors], family, cfg, ranks or 1, files_of)


def _lay_out(tensors: list[TensorPlan], file_order: list[str]) -> list:
    ranks = max((int(MP_FILE.fullmatch(t.file)[2]) for t in tensors), default=1)
    return layout(tensors, [mp_file(r, ranks) for r in range(ranks)])


def _holds(path: Path) -> bool:
    return not (path / INDEX_NAME).exists() and any(MP_FILE.fullmatch(p.name) for p in path.iterdir())


def _open(path: Path, config=None) -> "MpCheckpoint":
    return MpCheckpoint(path, config)


def _listing(path: Path) -> tuple:
    names = rank_files(path)
    with ShardFiles(path, names) as shards:
        entries = [(f, n, i.dtype, tuple(i.shape), i.nbytes) for f in names for n, i in shards.files[f].tensors.items()]
    config = read_config(path / "config.json") if (path / "config.json").exists() else {}
    return len(names), entries, config


MP = Layout(
    name="mp", title="model-parallel shards", per_rank=True, native_names=True, suffix=".safetensors",
    keeps_mtp=lambda family: family.mtp_in_mp,  # as the family's reference layout has them
    place=_place, unquantized=_unquantized, lay_out=_lay_out, index=lambda files, family: None, extras=no_extras,
    holds=_holds, open=_open, listing=_listing,
)


class MpCheckpoint(Checkpoint):
    """Model-parallel shards read as the HF checkpoint they were cut from: each HF tensor (the family's table read
    backwards, as merge reads it) is one rank's tensor where one holds it whole (replicated, an expert, mp 1), else
    the pieces of its ranks along the split dim (`SourceTensor.pieces`), which a plan gathers per output tensor
    (plan/assemble.py). Every file read is held to the manifest beside the shards, as merge holds them."""

    layout = MP

    def __init__(self, root: Path | str, config: Path | None = None):
        root = Path(root)
        names = rank_files(root)
        listed = Listed(root, names + ["config.json"])
        if listed.manifest is not None:
            listed.check(["config.json"] + [n for n in self.top_level_names(root) if n in listed.manifest["files"]])
        ShardFiles.__init__(self, root, names, before_read=lambda: listed.check(names),
                            notes=[f"read {len(names)} mp ranks as one checkpoint", listed.note])
        config_path = config or root / "config.json"
        self.config = read_config(config_path, missing_fix="copy the config.json that shard wrote beside the shards")
        family = family_for(self.config, config_path)
        cfg = family.parse_config(self.config, config_path)
        headers = list(self.files.values())
        if family.spelled is not None:
            cfg = family.spelled(cfg, [name for header in headers for name in header.tensors])
        expected = family.expected_for(cfg, True, n_tensors=sum(len(h.tensors) for h in headers), source=config_path)
        self.tensors = {t.name: _source(t, self.files) for t in merged_tensors(headers, family, cfg, expected)}

    _add_file = ShardFiles._add_file  # rank files repeat tensor names

    @staticmethod
    def top_level_names(root: Path) -> list[str]:
        return [p.name for p in sorted(root.iterdir()) if p.is_file()]


def _source(t: TensorPlan, files: dict[str, SafetensorsFile]) -> SourceTensor:
    """One rank's tensor where it holds it whole; else the ranks' pieces along `concat_dim`."""
    infos = [files[f].tensors[n] for f, n in t.parts]
    if len(infos) == 1:
        return SourceTensor(t.parts[0][0], infos[0])
    pieces, at = [], 0
    for (f, n), info in zip(t.parts, infos):
        offset = [0] * len(t.shape)
        offset[t.concat_dim] = at
        pieces.append(Piece(f, n, tuple(offset), info))
        at += info.shape[t.concat_dim]
    return SourceTensor(t.parts[0][0], TensorInfo(t.name, t.dtype, t.shape, 0, t.nbytes), tuple(pieces))
