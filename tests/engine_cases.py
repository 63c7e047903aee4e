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
from test_moe import _BASE as MOE_TINY_BASE, TINY as MOE_TINY

from ckpttool.families.deepseek import spec as deepseek_spec
from ckpttool.families.moe import spec as moe_spec

STRIPPED = set(deepseek_spec.ROUTING_FIELDS) | set(moe_spec.ROUTING_FIELDS) | \
    {k for row in moe_spec.TYPES.values() for k in row.hard_coded_routing} | \
    {"num_experts", "num_local_experts", "n_routed_experts", "partial_rotary_factor", "rotary_dim", "rope_theta"}

_MOE_BASE = {**MOE_TINY_BASE, "hidden_size": 128}  # head_dim 32 where the class derives it
# tests/test_moe.py's tiny models (GQA, dense layers among MoE ones, shared experts and their gate, sigmoid
# routing with a correction bias and expert groups, partial rotary, q/k norms, biases, non-default
# rope_theta), changed only where an engine needs it: head_dim 32, and no feature an engine lacks (README)
ENGINE_CHANGES = {
    "qwen3_moe": {"mlp_only_layers": []},  # llama.cpp's qwen3moe has no dense layers
    "olmoe": {"clip_qkv": None},  # vLLM's OLMoE ignores clip_qkv (OLMoE-1B-7B has none)
    "glm4_moe": {"head_dim": 32},
    "minimax_m2": {"head_dim": 32, "rotary_dim": 16},
    # vLLM's ERNIE builds its shared experts and head without biases (use_bias reaches q/k/v and the dense MLP
    # only); llama.cpp's converter sizes the shared experts as intermediate_size // num_key_value_heads and its
    # model makes every layer after the leading dense ones MoE (moe_layer_end_index unread): each holds for
    # ERNIE-4.5's published configs (use_bias false; 12288 // 4 = 1536 x 2; MoE up to the last layer)
    "ernie4_5_moe": {"use_bias": False, "intermediate_size": 64, "moe_layer_end_index": 2},
}
MOE = {t: {**spec, **ENGINE_CHANGES.get(t, {})} for t, spec in MOE_TINY.items()}

BASE_SEEDS = {"deepseek_v3": 3, "gpt_oss": 7, "llama": 0, **{t: 11 for t in MOE},
              "minimax_m2": 13}  # seed 11 makes a MiniMax-M2 whose greedy ids are one token repeated: proves little


def seeds(model_type: str, n: int) -> list[int]:
    """The weights' seeds a case is made with: an engine's claim must hold for each, not for one lucky draw."""
    return [BASE_SEEDS[model_type] + 100 * k for k in range(n)]


@dataclass
class Case:
    name: str
    output: str  # what ckpttool wrote, in words (the README table's "output kind")
    out: Path  # ckpttool's HF output: what the engines load
    fp8: bool = False  # FP8 weights: the oracle runs transformers on their float32 dequantization
    model_type: str = ""
    stripped: list[str] = field(default_factory=list)  # config fields the input lacked
    seed: int = 0  # of the input's weights

    @property
    def key(self) -> str:
        """One engine job: the case made with one seed."""
        return f"{self.name} / seed {self.seed}"


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


def deepseek_v3_fp8_dequant(root: Path, seed: int) -> Case:
    """DeepSeek-V3 as published (FP8 128x128 blocks, MTP layer, non-zero correction bias, grouped top-k) ->
    `ckpttool dequant` -> BF16 HF."""
    from ckpttool.families.deepseek.demo import build_checkpoint

    src = build_checkpoint(root / f"dsv3-fp8-s{seed}", "tiny-v3", seed=seed)
    stripped = strip_to_what_transformers_needs(src)
    run_cli("dequant", src, root / f"dsv3-bf16-s{seed}", "--quiet")
    return Case("deepseek_v3 FP8 -> BF16", "`dequant` DeepSeek-V3 FP8 -> BF16", root / f"dsv3-bf16-s{seed}",
                model_type="deepseek_v3", stripped=stripped, seed=seed)


def gpt_oss_mxfp4_bf16(root: Path, seed: int) -> Case:
    """gpt-oss as published (MXFP4 experts, sinks, sliding window, YaRN) -> recipe gpt-oss-bf16 -> BF16 HF."""
    from ckpttool.families.gpt_oss.demo import build_gpt_oss_checkpoint

    src = build_gpt_oss_checkpoint(root / f"gpt-oss-mxfp4-s{seed}", mxfp4=True, seed=seed, overrides={"head_dim": 32})
    run_cli("run", "gpt-oss-bf16", "-i", src, "-o", root / f"gpt-oss-bf16-s{seed}", "--quiet")
    return Case("gpt_oss MXFP4 -> BF16", "recipe `gpt-oss-bf16` MXFP4 -> BF16", root / f"gpt-oss-bf16-s{seed}",
                model_type="gpt_oss", seed=seed)


def dense_fp8(root: Path, seed: int) -> Case:
    """A transformers-saved Llama (GQA, llama3 RoPE) -> recipe dense-fp8 -> FP8 block HF."""
    from dense_models import TINY

    src = build_hf("llama", root / f"llama-s{seed}", seed=seed, spec={**TINY["llama"], "hidden_size": 128})
    run_cli("run", "dense-fp8", "-i", src, "-o", root / f"llama-fp8-s{seed}", "--quiet")
    return Case("llama BF16 -> FP8", "recipe `dense-fp8` BF16 -> FP8 block", root / f"llama-fp8-s{seed}", fp8=True,
                model_type="llama", seed=seed)


def moe_merged(root: Path, model_type: str, seed: int) -> Case:
    """A transformers-saved MoE stripped of its class defaults -> `shard --mp 2` -> `merge` -> BF16 HF."""
    name = f"{model_type}-s{seed}"
    src = build_hf(model_type, root / name, seed=seed, spec={**_MOE_BASE, **MOE[model_type]})
    stripped = strip_to_what_transformers_needs(src)
    run_cli("shard", src, root / f"{name}-mp2", "--mp", 2, "--quiet")
    run_cli("merge", root / f"{name}-mp2", root / f"{name}-hf", "--quiet")
    return Case(model_type, f"{model_type}: `shard --mp 2` then `merge` -> HF", root / f"{name}-hf",
                model_type=model_type, stripped=stripped, seed=seed)


BUILDERS = {"deepseek_v3": deepseek_v3_fp8_dequant, "gpt_oss": gpt_oss_mxfp4_bf16, "llama": dense_fp8,
            **{t: (lambda root, seed, t=t: moe_merged(root, t, seed)) for t in MOE}}


def build_all(root: Path, n_seeds: int) -> list[Case]:
    """Every case, each with `n_seeds` seeds."""
    return [BUILDERS[t](root, seed) for t in BUILDERS for seed in seeds(t, n_seeds)]
