"""verify's DeepSeek-V4 loaders: an mp shard (mp names as they are; MTP layers skipped), or a whole HF
checkpoint at mp=1 in either spelling (its own config.json says which), and the comparison of every
loaded weight with its slice of a reference checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ckpttool.families.base import ConfigArgs, Verifier, eos_ids, rank_slice
from ckpttool.families.deepseek_v4.config import DeepseekV4Config
from ckpttool.families.deepseek_v4.model import Transformer
from ckpttool.families.deepseek_v4.spec import hf_tensor_shapes, is_mtp_tensor, key_map
from ckpttool.errors import InputError
from ckpttool.formats import declares_fp8_block
from ckpttool.io.checkpoint import Checkpoint, read_config
from ckpttool.io.safetensors import TensorInfo
from ckpttool.model.loading import MAX_LISTED, check_tensors, load_mp_shard, reference_differences
from ckpttool.model.parallel import Linear, ParallelContext


@dataclass(frozen=True, slots=True)
class V4Args(ConfigArgs):
    """What verify asks of a config: the model config plus vocabulary, depth and end-of-sequence ids."""

    cfg: DeepseekV4Config
    eos_token_ids: tuple[int, ...]
    fp8_scale: torch.dtype | None = None
    """the dtype of the FP8 weights' 128x128 scales (float8_e8m0fnu under scale_fmt ue8m0), None: BF16 weights"""

    @classmethod
    def from_hf_config(cls, raw: dict, source: object = "config.json") -> "V4Args":
        return cls(cfg=DeepseekV4Config.from_dict(raw, source), eos_token_ids=eos_ids(raw),
                   fp8_scale=_fp8_scale(raw.get("quantization_config"), source))


def _fp8_scale(quant, source) -> torch.dtype | None:
    """What DeepSeek's V4 model loads from mp files: every linear weight but wo_a FP8 e4m3 in 128x128 blocks, the
    routed experts too (`expert_dtype: fp8`, what `quantize --to fp8-block-deepseek --mp N` writes)."""
    if not declares_fp8_block(quant, source):
        return None
    if quant.get("expert_dtype", "fp8") != "fp8":
        raise InputError(f"verify runs FP8 routed experts, not expert_dtype {quant.get('expert_dtype')!r}",
                         file=source, fix="repack them: ckpttool quantize SRC DST --to fp8-block-deepseek --mp N")
    return torch.float8_e8m0fnu if quant.get("scale_fmt") == "ue8m0" else torch.float32


def build_model(args: V4Args, ctx: ParallelContext, dtype: torch.dtype, attn_impl: str = "") -> Transformer:
    model = Transformer(args.cfg, ctx, dtype=dtype)  # one attention form: attn_impl is DeepSeek-V3's choice
    if args.fp8_scale is not None:
        _as_fp8(model, key_map(args.cfg), args.fp8_scale)
    return model


def _as_fp8(model: Transformer, keys, scale_dtype: torch.dtype) -> None:
    """Each Linear the key table calls a linear projection, held as stored in mp files (its mp dtype column None),
    becomes an FP8 weight beside its block scale, as DeepSeek's model holds it; dequantized on each call."""
    for name, module in model.named_modules():
        mapped = keys.to_hf(f"{name}.weight") if isinstance(module, Linear) else None
        if mapped is None or not mapped.row.linear or mapped.row.mp_dtype is not None:
            continue
        module.hold_fp8(scale_dtype)


def _config(directory: Path) -> DeepseekV4Config:
    path = Path(directory) / "config.json"
    return DeepseekV4Config.from_dict(read_config(path), path)


def load_shard(model: Transformer, path: Path) -> int:
    """An mp shard, strictly; MTP layers (`mtp.N.*`, which DeepSeek's convert.py keeps and `--keep-mtp`
    writes) are not part of the model verify runs: skipped and counted."""
    return load_mp_shard(model, path, skip=lambda native: is_mtp_tensor(model.cfg, native))


def load_hf_checkpoint(model: nn.Module, directory: Path, n_layers: int = 0) -> None:
    """A whole HF DeepSeek-V4 checkpoint, either spelling, into an mp=1 model; MTP layers skipped."""
    cfg = _config(directory)
    keys = key_map(cfg)
    with Checkpoint(directory) as ckpt:
        params = dict(model.named_parameters())
        available: dict[str, tuple[str, TensorInfo]] = {}
        for hf, src in ckpt.tensors.items():
            if is_mtp_tensor(cfg, hf):
                continue
            mapped = keys.to_native(hf)
            available[mapped.name if mapped else hf] = (hf, src.info)
        check_tensors(params, available, Path(directory))
        for name, param in params.items():
            param.data.copy_(ckpt.read(available[name][0]))


def weight_differences(model: nn.Module, ctx: ParallelContext, reference: Path, n_layers: int, shard: Path,
                       limit: int = MAX_LISTED) -> list[str]:
    """Every loaded weight against its slice of the reference checkpoint (either spelling)."""
    cfg = _config(reference)
    keys, shapes = key_map(cfg), hf_tensor_shapes(cfg, with_mtp=False)

    def source(name: str, ckpt: Checkpoint) -> tuple[str, tuple[int, int, int] | None]:
        return rank_slice(keys, name, shapes, cfg, ctx.rank, ctx.world_size)

    return reference_differences(model, reference, shard, source, limit)


VERIFIER = Verifier(
    load_args=V4Args.from_hf_config,
    build=build_model,
    load_shard=load_shard,
    load_hf=load_hf_checkpoint,
    weight_differences=weight_differences,
)
