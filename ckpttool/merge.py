"""`merge`: model{i}-mp{N}.safetensors back to an HF checkpoint, the inverse of `shard`.

Planned from the shards' headers and config.json alone, through the same key table read backwards
(KeyMap.to_hf): each HF tensor is the concatenation of its ranks' slices along the row's split dim;
replicated tensors come from rank 0, routed experts from the one rank holding them, and KV heads
replicated over several ranks from the first rank holding each. Every merged shape is checked against
the shapes config.json implies. Execution streams one tensor per worker through the same staging,
journal and publish as every other command (so `--resume` works), writing HF-layout files in
transformers' conventions: `model.safetensors`, or `model-0000i-of-0000n.safetensors` plus
`model.safetensors.index.json` above `max_shard_size`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import torch

from ckpttool.arch import get_arch
from ckpttool.arch.base import HeadSplit
from ckpttool.arch.deepseek import EXPERT
from ckpttool.errors import InputError, OutputError
from ckpttool.io.safetensors import SafetensorsFile, read_bytes, read_header, tensor_from_bytes
from ckpttool.io.writer import PARTIAL_DIR, Staging, check_destination, check_free_space, read_manifest
from ckpttool.kernels.fp8 import BLOCK, scale_shape
from ckpttool.plan import Plan, TensorPlan, build_header, OutFile
from ckpttool.progress import Progress
from ckpttool.stages.dequant import SCALE_SUFFIX
from ckpttool.stages.rewrite import files_to_copy, hf_index
from ckpttool.stages.shard import head_ranges, mp_file

_MP_FILE = re.compile(r"model(\d+)-mp(\d+)\.safetensors")
DEFAULT_MAX_SHARD_BYTES = 50 * 10**9  # transformers' save_pretrained default ("50GB")


def detect_mp(src: Path) -> int:
    found = {(int(m[1]), int(m[2])) for p in src.iterdir() if (m := _MP_FILE.fullmatch(p.name))}
    sizes = sorted({n for _, n in found})
    if not sizes:
        raise InputError("no model{i}-mp{N}.safetensors files", file=src,
                         fix="pass the output directory of `ckpttool shard` / `convert --mp N`")
    if len(sizes) > 1:
        raise InputError(f"shards for several mp sizes {sizes}", file=src, fix="keep one set of shards per directory")
    mp = sizes[0]
    missing = [mp_file(r, mp) for r in range(mp) if (r, mp) not in found]
    if missing:
        raise InputError(f"missing shard(s) {', '.join(missing)}", file=src,
                         fix="the conversion did not finish; convert again into an empty directory")
    return mp


def _natural(name: str) -> tuple:
    """`model.layers.2` before `model.layers.10`: files fill layer by layer."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))


def plan_merge(src: Path | str, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Plan:
    """The HF checkpoint the shards in `src` merge back to, from headers only."""
    src = Path(src)
    if not src.is_dir():
        raise InputError("directory does not exist", file=src, fix="pass the output directory of `ckpttool shard`")
    config_path = src / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except OSError:
        raise InputError("config.json is missing", file=config_path,
                         fix="merge needs the config.json that shard wrote beside the shards") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"config.json is not valid JSON: {exc}", file=config_path) from None
    arch = get_arch(config, config_path)
    cfg = arch.parse_config(config, config_path)
    mp = detect_mp(src)
    headers = [read_header(src / mp_file(r, mp)) for r in range(mp)]
    expected = arch.expected_shapes(cfg, True)

    pieces: dict[str, list[tuple[int, str]]] = {}  # HF name -> [(rank, native name)]
    splits: dict[str, object] = {}
    for rank, header in enumerate(headers):
        for native in header.tensors:
            is_scale = native.endswith(".scale")
            mapped = arch.key_map.to_hf(native.removesuffix("scale") + "weight" if is_scale else native)
            if mapped is None:
                raise InputError(f"not a {arch.name} mp tensor name", file=header.path, tensor=native,
                                 fix="merge reads what `ckpttool shard` writes for this config.json's model_type")
            hf = mapped.name + SCALE_SUFFIX if is_scale else mapped.name
            pieces.setdefault(hf, []).append((rank, native))
            splits[hf] = mapped.split

    tensors = []
    for hf in sorted(pieces, key=_natural):
        tensors.append(_merged_tensor(hf, pieces[hf], splits[hf], headers, expected, cfg, mp))
    files = _hf_files(tensors, max_shard_bytes)
    inputs = {h.path.name: {"size": h.path.stat().st_size,
                            "header_sha256": hashlib.sha256(_header_bytes(h)).hexdigest()} for h in headers}
    copies = sorted(set(files_to_copy(src)) | {"config.json"})
    notes = [f"merged {mp} ranks into {len(tensors)} HF tensors"]
    return Plan(src=str(src), files=files, inputs=inputs, format="hf",
                index=hf_index(files) if len(files) > 1 else None, config=None, copies=copies, notes=notes)


def _merged_tensor(hf: str, found: list[tuple[int, str]], split, headers: list[SafetensorsFile],
                   expected: dict, cfg, mp: int) -> TensorPlan:
    is_scale = hf.endswith(SCALE_SUFFIX)
    weight = hf.removesuffix(SCALE_SUFFIX)
    if weight not in expected:
        raise InputError("tensor is not part of the model config.json describes", file=headers[found[0][0]].path,
                         tensor=found[0][1], fix="check that config.json belongs to these shards")
    full = tuple(expected[weight])
    if is_scale:
        full = scale_shape(full)
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
    elif split is None or mp == 1:
        need_all_ranks()
        parts = (part(0),)
    elif isinstance(split, HeadSplit):
        need_all_ranks()
        weight_shape = tuple(expected[weight])
        ranges = head_ranges(split, weight_shape, cfg, mp, tensor=native0, file=headers[rank0].path)
        if is_scale:
            ranges = [(start // BLOCK, -(-length // BLOCK)) for start, length in ranges]
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


def _header_bytes(h: SafetensorsFile) -> bytes:
    with open(h.path, "rb") as f:
        return f.read(h.data_start)


# -- execution ---------------------------------------------------------------------------------------
class _Reader:
    """pread of whole tensors from the rank files, one descriptor per file."""

    def __init__(self, src: Path, plan: Plan):
        self.src = src
        self.headers = {name: read_header(src / name) for name in plan.inputs}
        self.fds = {name: os.open(src / name, os.O_RDONLY) for name in plan.inputs}

    def read(self, file: str, tensor: str) -> torch.Tensor:
        info = self.headers[file].tensors[tensor]
        return tensor_from_bytes(read_bytes(self.fds[file], info.start, info.nbytes, self.src / file),
                                 info.dtype, info.shape)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def _write_tensor(reader: _Reader, staging: Staging, file: str, placed) -> tuple[str, str]:
    t = placed.tensor
    if t.concat_dim == 0 or len(t.parts) == 1:  # rows of a contiguous tensor: write each part in place
        offset = placed.start
        for part in t.parts:
            data = reader.read(*part).reshape(-1).view(torch.uint8).numpy()
            staging.pwrite(file, data, offset)
            offset += data.nbytes
    else:
        merged = torch.cat([reader.read(*part) for part in t.parts], dim=t.concat_dim)
        staging.pwrite(file, merged.reshape(-1).view(torch.uint8).numpy(), placed.start)
    return file, t.name


def merge(src: Path | str, dst: Path | str, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
          max_memory: int = 4 << 30, workers: int = 4, overwrite: bool = False, resume: bool = False,
          quiet: bool = False):
    """Plan, execute under a memory budget, publish. Returns runner.RunResult."""
    from ckpttool.runner import RunResult

    src, dst = Path(src), Path(dst)
    check_destination(src, dst, overwrite=overwrite, resume=resume)
    started = time.monotonic()
    plan = plan_merge(src, max_shard_bytes=max_shard_bytes)
    if resume and not (dst / PARTIAL_DIR).exists():
        manifest = read_manifest(dst)
        if manifest is None or manifest.get("plan_hash") != plan.hash:
            raise OutputError("--resume: the output here was produced by a different plan", file=dst,
                              fix="rerun with the original arguments, or --overwrite to start over")
        return RunResult(plan, dst, time.monotonic() - started, 0, already_complete=True)
    dst.mkdir(parents=True, exist_ok=True)
    staging = Staging(dst, plan, resume=resume, overwrite=overwrite)
    reader = _Reader(src, plan)
    try:
        staging.open_files()
        resumed = len(staging.done)
        todo = [(f.name, p) for f in plan.files if f.name not in staging.published for p in f.tensors
                if (f.name, p.tensor.name) not in staging.done]
        total = sum(p.end - p.start for _, p in todo)
        check_free_space(dst, total + (64 << 20))
        with Progress(total, "merging", quiet=quiet) as progress, ThreadPoolExecutor(workers) as pool:
            in_flight: dict = {}
            used = 0

            def reap(block: bool) -> None:
                nonlocal used
                done, _ = wait(list(in_flight), timeout=None if block else 0, return_when=FIRST_COMPLETED)
                finished = []
                for fut in done:
                    used -= in_flight.pop(fut)
                    finished.append(fut.result())
                if finished:
                    staging.commit(finished)
                    progress.advance(sum(plan_bytes[f] for f in finished))

            plan_bytes = {(file, p.tensor.name): p.end - p.start for file, p in todo}
            for file, placed in todo:
                need = 2 * (placed.end - placed.start)  # the parts, and their concatenation
                while in_flight and (len(in_flight) >= 2 * workers or used + need > max_memory):
                    reap(block=True)
                in_flight[pool.submit(_write_tensor, reader, staging, file, placed)] = need
                used += need
            while in_flight:
                reap(block=True)
        staging.publish(src, overwrite=overwrite)
    finally:
        staging.close()
        reader.close()
    return RunResult(plan, dst, time.monotonic() - started, total, resumed_from=resumed)
