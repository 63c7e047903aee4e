"""Tiny but real DeepSeek checkpoints, laid out exactly like the published ones.

Used by `ckpttool demo`, the tests and the benchmarks: HF key names, several safetensors files with
an index, FP8 e4m3 128x128 block weights with `weight_scale_inv`, config.json with
`quantization_config`, a working WordLevel tokenizer and generation_config.json.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

from ckpttool.families.base import layer_index
from ckpttool.families.deepseek.spec import DeepseekConfig, hf_tensor_shapes, is_fp8_in_published_checkpoint
from ckpttool.families.demo_files import (
    Array,
    bf16,
    bf16_to_f32,
    quantize_fp8_block,
    write_configs,
    write_shards,
    write_tokenizer,
)
from ckpttool.formats import FP8_QUANTIZATION_CONFIG, SCALE_SUFFIX

# Dimensions keep FP8 128x128 blocks meaningful (partial blocks included: kv_a has 192 rows) and
# keep every FP8 split block-aligned at mp 2, like the real V3 at mp 8.
PRESETS: dict[str, dict] = {
    "tiny-v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256,
        "num_hidden_layers": 3, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 256, "kv_lora_rank": 128, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
        "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "num_nextn_predict_layers": 1,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 1024, "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False, "attention_bias": False,
    },
    "tiny-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
        "num_hidden_layers": 3, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": None, "kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32,
        "v_head_dim": 64,
        "n_routed_experts": 8, "n_shared_experts": 2, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.0, "scoring_func": "softmax", "topk_method": "greedy", "norm_topk_prob": False,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 1024, "rope_theta": 10000.0,
        "rope_scaling": None,
        "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False, "attention_bias": False,
    },
}

def build_checkpoint(dst: Path, preset: str = "tiny-v3", *, fp8: bool | None = None, seed: int = 0,
                     overrides: dict | None = None, n_files: int = 3, scales_in_last_file: bool = False) -> Path:
    """Write a random-weight HF DeepSeek checkpoint to `dst` and return it.

    fp8 defaults to True for V3 presets (as published) and False otherwise. `scales_in_last_file`
    moves every `weight_scale_inv` away from its weight, to exercise index resolution. numpy only
    (`ckpttool demo` needs no torch); the FP8 bits are kernels.fp8.quantize_fp8_block's.
    """
    raw = {**PRESETS[preset], **(overrides or {})}
    cfg = DeepseekConfig.from_dict(raw)
    fp8 = raw["model_type"] == "deepseek_v3" if fp8 is None else fp8
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)

    tensors: dict[str, Array] = {}
    for name, shape in hf_tensor_shapes(cfg).items():
        # each tensor draws from its own stream, so a tensor's values depend on (seed, name) alone: the same
        # seed gives the same weights whatever else the config adds (an MTP layer) or however shapes are listed
        gen = np.random.default_rng([seed, zlib.crc32(name.encode())])
        tensors.update(_make_tensor(name, shape, fp8, gen))

    n_layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    files: list[dict[str, Array]] = [{} for _ in range(n_files)]
    for name, t in tensors.items():
        layer = layer_index(name)
        idx = 0 if layer is None else min(n_files - 1, layer * n_files // max(n_layers, 1))
        if scales_in_last_file and name.endswith(SCALE_SUFFIX):
            idx = n_files - 1
        files[idx][name] = t
    write_shards(dst, files, [f"model-{i + 1:05d}-of-{n_files:05d}.safetensors" for i in range(n_files)])
    write_configs(dst, raw, FP8_QUANTIZATION_CONFIG if fp8 else None,
                  {"bos_token_id": raw["bos_token_id"], "eos_token_id": raw["eos_token_id"], "do_sample": False})
    write_tokenizer(dst, cfg.vocab_size)
    return dst


def _make_tensor(name: str, shape: tuple[int, ...], fp8: bool, gen: np.random.Generator) -> dict[str, Array]:
    if name.endswith("e_score_correction_bias"):
        return {name: Array("F32", gen.random(shape, dtype=np.float32) * np.float32(0.1))}
    if name.endswith("norm.weight"):
        return {name: bf16(1.0 + 0.1 * gen.standard_normal(shape, dtype=np.float32))}
    fan_in = shape[-1]
    w = bf16(gen.standard_normal(shape, dtype=np.float32) * np.float32((1.0 / fan_in) ** 0.5))
    if fp8 and is_fp8_in_published_checkpoint(name):
        q, s = quantize_fp8_block(bf16_to_f32(w))
        return {name: q, name + SCALE_SUFFIX: s}
    return {name: w}
