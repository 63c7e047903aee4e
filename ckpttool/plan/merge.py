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
from ckpttool.families.table import family_for
from ckpttool.io.checkpoint import ShardFiles, read_config
from ckpttool.io.listed import Listed
from ckpttool.layouts.hf import HF, files_by_size
from ckpttool.layouts.mp import merged_tensors
from ckpttool.layouts.mp import rank_files as mp_rank_files
from ckpttool.layouts.table import of_directory
from ckpttool.plan.build import input_fingerprints
from ckpttool.plan.rewrite import files_to_copy, hf_index
from ckpttool.plan.types import Plan


@dataclass(frozen=True, kw_only=True)
class MergeSpec:
    """What `merge` produces: HF files of at most max_shard_bytes each (transformers' default 50GB)."""

    max_shard_bytes: int = defaults.parse_size(defaults.MAX_SHARD_SIZE)

    label = "merging"

    def open(self, src: Path) -> ShardFiles:
        """The shards, held to the manifest beside them (io/listed.py): names, sizes and side files now, each
        shard's hash before its first byte is read."""
        src = Path(src)
        row = of_directory(src)
        if row.read_back is not None and row.per_rank:
            raise InputError(f"merge reads model-parallel shards back; this is {row.title}: {row.read_back}",
                             file=src, fix="pass the output directory of `ckpttool shard` / `convert --mp N`")
        names = mp_rank_files(src)  # which also says so when src is not a directory
        listed = Listed(src, names + ["config.json"])
        if listed.manifest is not None:
            listed.check(["config.json"] + [n for n in files_to_copy(src) if n in listed.manifest["files"]])
        return ShardFiles(src, names, before_read=lambda: listed.check(names), notes=[listed.note])

    def plan(self, shards: ShardFiles) -> Plan:
        return plan_merge(shards, max_shard_bytes=self.max_shard_bytes)


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
    tensors = merged_tensors(headers, family, cfg, expected)
    files = files_by_size(tensors, max_shard_bytes)
    copies = sorted(set(files_to_copy(src)) | {"config.json"})
    notes = [f"merged {mp} ranks into {len(tensors)} HF tensors", *shards.notes]
    return Plan(src=str(src), files=files, inputs=input_fingerprints(shards), layout=HF,
                index=hf_index(files, family.buffers) if len(files) > 1 else None, config=None, copies=copies, notes=notes)
