"""`merge` planned: model{i}-mp{N}.safetensors back to an HF checkpoint, the inverse of `shard`.

Planned from the shards' headers and config.json alone, through the same key table read backwards
(KeyMap.to_hf): each HF tensor is the concatenation of its ranks' slices along the row's split dim;
replicated tensors come from rank 0, routed experts from the one rank holding them, and KV heads
replicated over several ranks from the first rank holding each; parts a table passes through (a wrapper's
vision tower) from rank 0, as they are; a tensor held as segments (`Segment`) is its segments' parts one
after another. Every merged shape is checked against
the shapes config.json implies. The plan runs on the same executor, staging, journal and publish as
every other command (so `--resume`, the memory budget, the manifest and torchrun work as for convert),
writing HF-layout files in transformers' conventions: `model.safetensors`, or
`model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json` above `max_shard_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ckpttool import defaults
from ckpttool.errors import InputError
from ckpttool.families.base import HeadSplit
from ckpttool.families.keymap import EXPERT, RANK0, Segment
from ckpttool.families.table import family_for
from ckpttool.io.checkpoint import ShardFiles, read_config
from ckpttool.io.layout import find_mp, mp_file
from ckpttool.io.listed import Listed
from ckpttool.io.safetensors import SafetensorsFile
from ckpttool.kernels.fp8 import scale_shape
from ckpttool.plan.build import input_fingerprints
from ckpttool.plan.rewrite import files_to_copy, hf_index
from ckpttool.plan.types import OutFile, Plan, TensorPlan, build_header


@dataclass(frozen=True, kw_only=True)
class MergeSpec:
    """What `merge` produces: HF files of at most max_shard_bytes each (transformers' default 50GB)."""

    max_shard_bytes: int = defaults.parse_size(defaults.MAX_SHARD_SIZE)

    label = "merging"

    def open(self, src: Path) -> ShardFiles:
        """The shards, held to the manifest beside them (io/listed.py): names, sizes and side files now, each
        shard's hash before its first byte is read."""
        src = Path(src)
        mp = find_mp(src)  # which also says so when src is not a directory
        names = [mp_file(r, mp) for r in range(mp)]
        listed = Listed(src, names + ["config.json"])
        if listed.manifest is not None:
            listed.check(["config.json"] + [n for n in files_to_copy(src) if n in listed.manifest["files"]])
        return ShardFiles(src, names, before_read=lambda: listed.check(names), notes=[listed.note])

    def plan(self, shards: ShardFiles) -> Plan:
        return plan_merge(shards, max_shard_bytes=self.max_shard_bytes)


def _natural(name: str) -> tuple:
    """`model.layers.2` before `model.layers.10`: files fill layer by layer."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))


def plan_merge(shards: ShardFiles, *, max_shard_bytes: int) -> Plan:
    """The HF checkpoint the shards merge back to, from headers only."""
    src = shards.root
    config_path = src / "config.json"
    config = read_config(config_path, missing_fix="merge needs the config.json that shard wrote beside the shards")
    family = family_for(config, config_path)
    cfg = family.parse_config(config, config_path)
    headers = list(shards.files.values())
    if family.spelled is not None:  # a wrapper: the spelling whose parts passed through rank 0 holds
        cfg = family.spelled(cfg, [name for header in headers for name in header.tensors])
    mp = len(headers)
    expected = family.expected_for(cfg, True, n_tensors=sum(len(h.tensors) for h in headers), source=config_path)

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

    tensors = [_joined(hf, {i: _merged_tensor(hf, found, mapped_of[hf, i], headers, expected, cfg, mp)
                            for i, found in pieces[hf].items()}, mapped_of[hf, min(pieces[hf])], headers)
               for hf in sorted(pieces, key=_natural)]
    files = _hf_files(tensors, max_shard_bytes)
    copies = sorted(set(files_to_copy(src)) | {"config.json"})
    notes = [f"merged {mp} ranks into {len(tensors)} HF tensors", *shards.notes]
    return Plan(src=str(src), files=files, inputs=input_fingerprints(shards), format="hf",
                index=hf_index(files, family.buffers) if len(files) > 1 else None, config=None, copies=copies, notes=notes)


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


def _hf_files(tensors: list[TensorPlan], max_bytes: int) -> list[OutFile]:
    groups: list[list[TensorPlan]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    n = len(groups)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    files = []
    for name, group in zip(names, groups):
        header, placed = build_header([t.with_(file=name) for t in group], {"format": "pt"})
        files.append(OutFile(name, header, placed))
    return files
