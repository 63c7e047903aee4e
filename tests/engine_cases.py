"""The checkpoints the engines tier (tests/test_engines.py) hands to vLLM and llama.cpp: each is an output
ckpttool writes in HF layout, made from a tiny input the way users make theirs, with the oracle dir that
transformers reads for the same weights.

Inputs state no more than transformers saves: every routing field equal to its class default, and every
field transformers' model hard-codes (DeepSeek-V3's topk_method / scoring_func), is stripped from
config.json, so an engine sees those fields only if ckpttool's config rewrite states them. Head sizes are
>= 32 (vLLM's CPU attention has kernels for 32, 64, 80, ... only).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from conftest import run_cli
from dense_models import build_hf

from ckpttool.families.deepseek import spec as deepseek_spec
from ckpttool.families.moe import spec as moe_spec

STRIPPED = set(deepseek_spec.ROUTING_FIELDS) | set(moe_spec._ROUTING_FIELDS) | \
    {k for fields in moe_spec.HARD_CODED_ROUTING.values() for k in fields} | \
    {"num_experts", "num_local_experts", "n_routed_experts", "partial_rotary_factor", "rotary_dim", "rope_theta"}

_MOE_BASE = dict(vocab_size=256, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                 max_position_embeddings=64, tie_word_embeddings=False)
# As tests/test_moe.py's tiny models (GQA, dense layers among MoE ones, shared experts and their gate,
# sigmoid routing with a correction bias and expert groups, partial rotary, q/k norms, biases, clip_qkv,
# non-default rope_theta), with head_dim 32.
MOE = {
    "qwen3_moe": dict(cls="Qwen3MoeForCausalLM", config="Qwen3MoeConfig", num_key_value_heads=2, head_dim=32,
                      intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=True,  # no mlp_only_layers: llama.cpp's qwen3moe has no dense layers
                      rope_parameters={"rope_type": "default", "rope_theta": 1234567.0}),
    "qwen2_moe": dict(cls="Qwen2MoeForCausalLM", config="Qwen2MoeConfig", num_key_value_heads=2,
                      intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                      shared_expert_intermediate_size=48),
    "mixtral": dict(cls="MixtralForCausalLM", config="MixtralConfig", num_key_value_heads=2, intermediate_size=32,
                    num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(cls="OlmoeForCausalLM", config="OlmoeConfig", num_key_value_heads=4, intermediate_size=32,
                  num_experts=4, num_experts_per_tok=2),  # clip_qkv: README (vLLM ignores it)
    "glm4_moe": dict(cls="Glm4MoeForCausalLM", config="Glm4MoeConfig", num_key_value_heads=2, head_dim=32,
                     intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                     n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, use_qk_norm=True,
                     attention_bias=True, routed_scaling_factor=2.5, num_nextn_predict_layers=0),
    "minimax_m2": dict(cls="MiniMaxM2ForCausalLM", config="MiniMaxM2Config", num_key_value_heads=2, head_dim=32,
                       intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, rotary_dim=16),
}

SEEDS = {"minimax_m2": 13}  # seed 11 makes a MiniMax-M2 whose greedy ids are one token repeated: proves little


@dataclass
class Case:
    name: str
    output: str  # what ckpttool wrote, in words (the README table's "output kind")
    out: Path  # ckpttool's HF output: what the engines load
    fp8: bool = False  # the oracle dequantizes FP8 (transformers' FineGrainedFP8, dequantize=True)
    model_type: str = ""
    stripped: list[str] = field(default_factory=list)  # config fields the input lacked


def strip_to_what_transformers_needs(hf: Path) -> list[str]:
    """Remove from config.json each STRIPPED field transformers reads the same without (its class default, or
    a field its config class does not have); returns what was removed."""
    import transformers

    path = hf / "config.json"
    raw = json.loads(path.read_text())
    defaults = transformers.CONFIG_MAPPING[raw["model_type"]]()
    gone = sorted(k for k in raw if k in STRIPPED and (not hasattr(defaults, k) or getattr(defaults, k) == raw[k]))
    path.write_text(json.dumps({k: v for k, v in raw.items() if k not in gone}, indent=2))
    return gone


def deepseek_v3_fp8_dequant(root: Path) -> Case:
    """DeepSeek-V3 as published (FP8 128x128 blocks, MTP layer, non-zero correction bias, grouped top-k) ->
    `ckpttool dequant` -> BF16 HF."""
    from ckpttool.families.deepseek.demo import build_checkpoint

    src = build_checkpoint(root / "dsv3-fp8", "tiny-v3", seed=3)
    stripped = strip_to_what_transformers_needs(src)
    run_cli("dequant", src, root / "dsv3-bf16", "--quiet")
    return Case("deepseek_v3 FP8 -> BF16", "`dequant` DeepSeek-V3 FP8 -> BF16", root / "dsv3-bf16",
                model_type="deepseek_v3", stripped=stripped)


def gpt_oss_mxfp4_bf16(root: Path) -> Case:
    """gpt-oss as published (MXFP4 experts, sinks, sliding window, YaRN) -> recipe gpt-oss-bf16 -> BF16 HF."""
    from ckpttool.families.gpt_oss.demo import build_gpt_oss_checkpoint

    src = build_gpt_oss_checkpoint(root / "gpt-oss-mxfp4", mxfp4=True, seed=7, overrides={"head_dim": 32})
    run_cli("run", "gpt-oss-bf16", "-i", src, "-o", root / "gpt-oss-bf16", "--quiet")
    return Case("gpt_oss MXFP4 -> BF16", "recipe `gpt-oss-bf16` MXFP4 -> BF16", root / "gpt-oss-bf16",
                model_type="gpt_oss")


def dense_fp8(root: Path) -> Case:
    """A transformers-saved Llama (GQA, llama3 RoPE) -> recipe dense-fp8 -> FP8 block HF."""
    from dense_models import TINY

    src = build_hf("llama", root / "llama", spec={**TINY["llama"], "hidden_size": 128})
    run_cli("run", "dense-fp8", "-i", src, "-o", root / "llama-fp8", "--quiet")
    return Case("llama BF16 -> FP8", "recipe `dense-fp8` BF16 -> FP8 block", root / "llama-fp8", fp8=True,
                model_type="llama")


def moe_merged(root: Path, model_type: str) -> Case:
    """A transformers-saved MoE stripped of its class defaults -> `shard --mp 2` -> `merge` -> BF16 HF."""
    src = build_hf(model_type, root / model_type, seed=SEEDS.get(model_type, 11), spec={**_MOE_BASE, **MOE[model_type]})
    stripped = strip_to_what_transformers_needs(src)
    run_cli("shard", src, root / f"{model_type}-mp2", "--mp", 2, "--quiet")
    run_cli("merge", root / f"{model_type}-mp2", root / f"{model_type}-hf", "--quiet")
    return Case(model_type, f"{model_type}: `shard --mp 2` then `merge` -> HF", root / f"{model_type}-hf",
                model_type=model_type, stripped=stripped)


def build_all(root: Path) -> list[Case]:
    return [deepseek_v3_fp8_dequant(root), gpt_oss_mxfp4_bf16(root), dense_fp8(root),
            *(moe_merged(root, t) for t in MOE)]
