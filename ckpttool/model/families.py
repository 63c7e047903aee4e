"""Which bundled model a config.json asks for, and how verify builds, loads and checks it: one row per
family, chosen by `model_type` (DeepSeek for anything else; its loader reports what is wrong)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ckpttool.model import dense, gpt_oss_loading
from ckpttool.model.args import ModelArgs
from ckpttool.model.deepseek import Transformer
from ckpttool.model.loading import load_hf_checkpoint, load_mp_shard, weight_differences


@dataclass(frozen=True)
class Family:
    load_args: Callable[[Path], Any]  # config.json path -> args (with vocab_size, n_layers, eos_token_ids)
    build: Callable  # (args, ctx, dtype, attn_impl) -> model
    load_hf: Callable  # (model, HF dir, n_layers) -> None
    weight_differences: Callable  # (model, ctx, HF dir, n_layers, shard path) -> problems
    load_shard: Callable = load_mp_shard  # (model, model{rank}-mp{N}.safetensors) -> None


DEEPSEEK = Family(ModelArgs.load, lambda a, ctx, dt, attn: Transformer(a, ctx, dtype=dt, attn_impl=attn),
                  load_hf_checkpoint, weight_differences)
DENSE = Family(dense.DenseArgs.load, lambda a, ctx, dt, attn: dense.DenseTransformer(a, ctx, dtype=dt),
               dense.load_hf_dense, dense.dense_weight_differences)
GPT_OSS = Family(gpt_oss_loading.GptOssArgs.load, gpt_oss_loading.build_model, gpt_oss_loading.load_hf_gpt_oss,
                 gpt_oss_loading.gpt_oss_weight_differences, gpt_oss_loading.load_gpt_oss_shard)

BY_MODEL_TYPE: dict[str, Family] = {**{t: DENSE for t in dense.MODEL_TYPES}, "gpt_oss": GPT_OSS}


def family_for(config_path: Path) -> Family:
    try:
        raw = json.loads(Path(config_path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return DEEPSEEK  # its loader reports what is wrong with the file
    return BY_MODEL_TYPE.get(raw.get("model_type"), DEEPSEEK) if isinstance(raw, dict) else DEEPSEEK
