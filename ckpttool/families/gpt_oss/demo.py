"""Tiny but real gpt-oss checkpoints, laid out like openai/gpt-oss-20b.

HF key names, two safetensors files with an index, MXFP4 expert weights (`*_blocks` / `*_scales`,
u8) beside BF16 everything-else, config.json in the published form (`rope_theta` + YaRN
`rope_scaling`, `layer_types`, `quantization_config: {quant_method: mxfp4}`), a WordLevel tokenizer
and generation_config.json. The same seed gives the same model in both forms: with mxfp4=False the
expert weights are the exact BF16 dequantization of the MXFP4 ones, in transformers' layout.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ckpttool.families.base import layer_index
from ckpttool.families.demo_files import write_configs, write_shards, write_tokenizer
from ckpttool.families.gpt_oss.spec import (MXFP4_BLOCKS, MXFP4_SCALES, GptOssConfig, dequant_expert_weight,
                                             hf_tensor_shapes)

# Dims are small but keep every structural feature: GQA (4 q heads, 2 kv heads), 2 and 3 MXFP4 groups per
# row, sliding window (4) shorter than a test prompt, alternating sliding/full layers, 4 experts, top-2,
# and everything an mp=2 split cuts (heads, kv heads, experts, vocab) even.
CONFIG: dict = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "head_dim": 16,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_local_experts": 4, "num_experts_per_tok": 2, "experts_per_token": 2,
    "sliding_window": 4,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "attention_bias": True, "attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02,
    "rms_norm_eps": 1e-5, "swiglu_limit": 7.0,
    "max_position_embeddings": 256, "initial_context_length": 64, "rope_theta": 150000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 64, "truncate": False},
    "router_aux_loss_coef": 0.9, "output_router_logits": False, "use_cache": True,
    "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "tie_word_embeddings": False,
}

MXFP4_QUANTIZATION_CONFIG = {
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                               "lm_head"],
    "quant_method": "mxfp4",
}

# e8m0 exponents of the random blocks: 2**-6 .. 2**-3 times e2m1 codes (|v| <= 6, rms ~2.9) gives
# weights of rms ~0.1, about 1/sqrt(fan_in) for fan_in 64, so activations stay O(1).
_SCALE_EXPONENTS = (-6, -3)


def build_gpt_oss_checkpoint(dst: Path, *, mxfp4: bool = True, seed: int = 0, overrides: dict | None = None,
                             n_files: int = 2) -> Path:
    """Write a random-weight HF gpt-oss checkpoint to `dst` and return it."""
    raw = {**CONFIG, **(overrides or {})}
    cfg = GptOssConfig.from_dict(raw)
    gen = torch.Generator().manual_seed(seed)
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)

    tensors: dict[str, torch.Tensor] = {}
    for name, shape in hf_tensor_shapes(cfg, mxfp4=True).items():
        tensors[name] = _make_tensor(name, shape, gen)
    if not mxfp4:
        for name in [n for n in tensors if n.endswith(MXFP4_BLOCKS)]:
            base = name.removesuffix(MXFP4_BLOCKS)
            tensors[base] = dequant_expert_weight(tensors.pop(name), tensors.pop(base + MXFP4_SCALES),
                                                  tensor=name)

    files: list[dict[str, torch.Tensor]] = [{} for _ in range(n_files)]
    for name, t in tensors.items():
        layer = layer_index(name)
        idx = 0 if layer is None else min(n_files - 1, layer * n_files // cfg.num_hidden_layers)
        files[idx][name] = t
    # gpt-oss numbers its shards from 0
    write_shards(dst, files, [f"model-{i:05d}-of-{n_files - 1:05d}.safetensors" for i in range(n_files)])
    write_configs(dst, raw, MXFP4_QUANTIZATION_CONFIG if mxfp4 else None,
                  {"bos_token_id": raw["bos_token_id"], "eos_token_id": raw["eos_token_id"],
                   "pad_token_id": raw["pad_token_id"], "do_sample": False})
    write_tokenizer(dst, cfg.vocab_size)
    return dst


def random_mxfp4(shape: tuple[int, ...], gen: torch.Generator,
                 exponents: tuple[int, int] = _SCALE_EXPONENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random e2m1 code bytes [..., G, 16] and e8m0 scales [..., G] with 2**lo .. 2**hi."""
    blocks = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    scales = torch.randint(127 + exponents[0], 127 + exponents[1] + 1, shape[:-1], generator=gen, dtype=torch.uint8)
    return blocks, scales


def _make_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if name.endswith(MXFP4_BLOCKS):
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    if name.endswith(MXFP4_SCALES):
        lo, hi = _SCALE_EXPONENTS
        return torch.randint(127 + lo, 127 + hi + 1, shape, generator=gen, dtype=torch.uint8)
    if name.endswith("norm.weight"):
        w = 1.0 + 0.1 * torch.randn(shape, generator=gen)
    elif name.endswith("sinks"):
        w = 0.5 * torch.randn(shape, generator=gen)
    elif name.endswith("embed_tokens.weight"):
        w = torch.randn(shape, generator=gen)
    elif name.endswith(("_proj_bias", "router.bias")):
        w = 0.1 * torch.randn(shape, generator=gen)
    elif name.endswith(".bias"):
        w = 0.02 * torch.randn(shape, generator=gen)
    else:
        w = torch.randn(shape, generator=gen) * shape[-1] ** -0.5
    return w.to(torch.bfloat16)
