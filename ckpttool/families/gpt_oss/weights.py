"""Strict gpt-oss weight loading for verify: one `model{rank}-mp{N}.safetensors` (BF16, or MXFP4 expert
blocks/scales as `shard` keeps them), or a whole HF checkpoint (MXFP4 as published, or BF16) at mp=1.

MXFP4 pairs are dequantized to BF16 with the same function as the `dequant` stage (bit-equal to
transformers' own dequantization), so both sources give the model the values a BF16 conversion writes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ckpttool.errors import InputError
from ckpttool.families.base import ConfigArgs, Verifier, eos_ids
from ckpttool.families.gpt_oss.model import Transformer
from ckpttool.families.gpt_oss.spec import (KEY_MAP, MXFP4_BLOCKS, MXFP4_SCALES, GptOssConfig, bf16_expert_shape,
                                             dequant_expert_weight)
from ckpttool.io.checkpoint import Checkpoint
from ckpttool.io.safetensors import TensorInfo, read_bytes, tensor_from_bytes
from ckpttool.kernels.mxfp4 import check_mxfp4
from ckpttool.model.loading import MAX_LISTED, check_tensors, read_shard_header, slice_difference
from ckpttool.model.parallel import ParallelContext

Sources = dict[str, tuple[str, TensorInfo]]  # native name -> (name in the file, header entry)


@dataclass(frozen=True, slots=True)
class GptOssArgs(ConfigArgs):
    """What verify asks of a config: the model config plus vocabulary, depth and end-of-sequence ids."""

    cfg: GptOssConfig
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, raw: dict, source: object = "config.json") -> "GptOssArgs":
        return cls(cfg=GptOssConfig.from_dict(raw, source), eos_token_ids=eos_ids(raw))


def build_model(args: GptOssArgs, ctx: ParallelContext, dtype: torch.dtype, attn_impl: str = "") -> Transformer:
    return Transformer(args.cfg, ctx, dtype=dtype)  # one attention form: attn_impl is DeepSeek's choice


def _plan(params: dict[str, nn.Parameter], sources: Sources, where: Path) -> dict[str, tuple[str, ...]]:
    """For each parameter, the file tensor(s) it is read from: itself, or an MXFP4 (blocks, scales)
    pair for a stacked expert weight. Raises one InputError for every missing, extra or mis-shaped one."""
    pairs: dict[str, tuple[str, str]] = {}
    problems: list[tuple[str, str]] = []
    for name, param in params.items():
        if len(names := _source_names(name, sources)) == 1:
            continue
        pairs[name] = blocks, scales = names
        (file_blocks, b), (file_scales, s) = sources[blocks], sources.get(scales, (scales, None))
        if s is None:
            problems.append((file_blocks, f"{file_blocks!r} has no scales {file_scales!r} beside it"))
        elif b.dtype != "U8" or s.dtype != "U8":
            problems.append((file_blocks, f"MXFP4 {file_blocks!r} / {file_scales!r} are {b.dtype} / {s.dtype}, not U8"))
        else:
            try:
                check_mxfp4(b.shape, s.shape, tensor=file_blocks)
            except InputError as exc:
                problems.append((file_blocks, exc.message))
                continue
            if len(b.shape) != 4 or bf16_expert_shape(b.shape) != tuple(param.shape):
                problems.append((file_blocks, f"MXFP4 {file_blocks!r} {list(b.shape)} does not dequantize to the "
                                              f"{list(param.shape)} the model expects"))
    if problems:
        listed = "; ".join(text for _, text in problems[:MAX_LISTED])
        raise InputError(f"{len(problems)} problem(s) loading MXFP4 expert weights: {listed}", file=where,
                         tensor=problems[0][0], fix="re-run the conversion into an empty directory")
    paired = {n for pair in pairs.values() for n in pair}
    check_tensors({n: p for n, p in params.items() if n not in pairs},
                   {n: src for n, src in sources.items() if n not in paired}, where)
    return {n: pairs.get(n, (n,)) for n in params}


def _source_names(name: str, sources: Sources) -> tuple[str, ...]:
    """(name,), or (blocks, scales) where the source holds the parameter as an MXFP4 pair."""
    blocks, scales = name + MXFP4_BLOCKS, name + MXFP4_SCALES
    return (blocks, scales) if blocks in sources else (name,)


def _value(names: tuple[str, ...], sources: Sources, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """A parameter's dense value: the tensor as stored, or its MXFP4 pair dequantized to BF16."""
    if len(names) == 1:
        return read(sources[names[0]][0])
    blocks, scales = (sources[n][0] for n in names)
    return dequant_expert_weight(read(blocks), read(scales), torch.bfloat16, tensor=blocks)


def _hf_sources(ckpt: Checkpoint) -> Sources:
    """An HF checkpoint's tensors under native names; names outside the table stay as they are
    (and are then reported as unexpected)."""
    out: Sources = {}
    for hf, src in ckpt.tensors.items():
        mapped = KEY_MAP.to_native(hf)
        out[mapped.name if mapped else hf] = (hf, src.info)
    return out


def load_gpt_oss_shard(model: nn.Module, path: Path) -> None:
    """Load one per-rank gpt-oss shard into `model`, strictly."""
    path = Path(path)
    header = read_shard_header(path)
    sources = {name: (name, info) for name, info in header.tensors.items()}
    params = dict(model.named_parameters())
    plan = _plan(params, sources, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        def read(name: str) -> torch.Tensor:
            info = header.tensors[name]
            return tensor_from_bytes(read_bytes(fd, info.start, info.nbytes, path), info.dtype, info.shape)

        for name, param in params.items():
            param.data.copy_(_value(plan[name], sources, read))
    finally:
        os.close(fd)


def load_hf_gpt_oss(model: nn.Module, directory: Path, n_layers: int = 0) -> None:
    """Load a whole HF gpt-oss checkpoint (MXFP4 or BF16) into an mp=1 model, strictly."""
    with Checkpoint(directory) as ckpt:
        sources = _hf_sources(ckpt)
        params = dict(model.named_parameters())
        plan = _plan(params, sources, Path(directory))
        for name, param in params.items():
            param.data.copy_(_value(plan[name], sources, ckpt.read))


def gpt_oss_weight_differences(model: nn.Module, ctx: ParallelContext, reference: Path, n_layers: int,
                               shard: Path, limit: int = MAX_LISTED) -> list[str]:
    """Compare every loaded weight with its slice of the reference HF checkpoint, MXFP4 compared
    dequantized on either side; a lossless conversion makes them equal. Returns what differs."""
    problems: list[str] = []
    with Checkpoint(reference) as ckpt:
        sources = _hf_sources(ckpt)
        for name, param in model.named_parameters():
            names = _source_names(name, sources)
            if missing := [n for n in names if n not in sources]:
                problems.append(f"{name}: the reference has no {KEY_MAP.to_hf(missing[0]).name!r}")
                continue
            split = KEY_MAP.to_hf(name).split
            theirs = _value(names, sources, ckpt.read)
            if split is not None and ctx.world_size > 1:
                theirs = theirs.chunk(ctx.world_size, split)[ctx.rank]
            theirs = theirs.to(param.device, param.dtype)
            hf = sources[names[0]][0]
            if (problem := slice_difference(name, shard, hf, param, theirs)) is not None:
                problems.append(problem)
            if len(problems) >= limit:
                break
    return problems


VERIFIER = Verifier(
    load_args=GptOssArgs.from_hf_config,
    build=build_model,
    load_shard=load_gpt_oss_shard,
    load_hf=load_hf_gpt_oss,
    weight_differences=gpt_oss_weight_differences,
)
