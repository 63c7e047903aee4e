"""Tiny DeepSeek-V4 checkpoints for the tests, built and saved by transformers 5.24 itself with every
parameter and buffer perturbed, in either spelling:
- `transformers`: exactly what DeepseekV4ForCausalLM.save_pretrained writes (config.json with
  `layer_types`; `model.layers.N.attn.*`, `model.embed_tokens.weight`, tid2eid as I64; no MTP);
- `deepseek`: the same tensors under DeepSeek's hub names (`layers.N.attn.*`, `embed.weight`,
  `hc_head_fn`, `attn.kv_norm`; tid2eid as I32) in files split like the hub's, with DeepSeek's own
  config.json fields (`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`) and,
  when asked, an MTP layer `mtp.0.*` of random values (transformers builds none; verify skips it).

The config has every layer type (sliding, CSA, HCA) and both MLP types (hash, top-k), a sliding window,
CSA rate and index_topk small enough that the prompts the tests use go past all three, YaRN on the
compressed layers as V4-Flash has it, and every count divisible by 4 (mp 1, 2 and 4).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ckpttool.families.deepseek_v4.config import RATIO_TO_LAYER_TYPE, DeepseekV4Config
from ckpttool.families.deepseek_v4.spec import KEY_MAPS, native_shapes
from ckpttool.families.demo_files import write_tokenizer

LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
               "compressed_sparse_attention", "sliding_attention"]
RATIOS = {t: r for r, t in RATIO_TO_LAYER_TYPE.items()}
TINY = dict(vocab_size=128, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=5, num_attention_heads=4,
            head_dim=16, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=8, o_groups=4, o_lora_rank=8,
            index_n_heads=8, index_head_dim=8, index_topk=2, sliding_window=6, hc_mult=4, hc_sinkhorn_iters=20,
            compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
            layer_types=LAYER_TYPES, mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"],
            partial_rotary_factor=0.5, rope_theta=10000.0, compress_rope_theta=40000.0, routed_scaling_factor=1.5,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                             "beta_fast": 32, "beta_slow": 1},
            max_position_embeddings=256, num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=None,
            rms_norm_eps=1e-6)
PROMPT = [0, 5, 17, 42, 99, 7, 3, 64, 31, 2, 88, 19, 120, 45]
"""14 tokens: past the sliding window (6), 7 CSA entries (index_topk 2) and 3 HCA entries"""


def build(dst: Path, *, spelling: str = "transformers", seed: int = 0, mtp: bool = False,
          dtype: torch.dtype = torch.bfloat16, **overrides) -> Path:
    """A perturbed tiny DeepseekV4ForCausalLM saved in `dst` in the given spelling."""
    import transformers

    dst = Path(dst)
    config = transformers.DeepseekV4Config(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            centre = 1.0 if name.endswith("norm.weight") or name.endswith(".scale") or name.endswith("hc_scale") else 0.0
            p.copy_(torch.randn_like(p) * (0.2 if centre else 0.15) + centre)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand_like(b) * 0.3)
            elif name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(config.n_routed_experts)[:config.num_experts_per_tok]
                                     for _ in range(config.vocab_size)]))
    model.to(dtype).save_pretrained(dst)
    write_tokenizer(dst, config.vocab_size)
    if spelling == "deepseek":
        _respell(dst, mtp=mtp, seed=seed)
    return dst


def _respell(dst: Path, *, mtp: bool, seed: int) -> None:
    """transformers' files -> DeepSeek's: hub names and config fields, split over two files, MTP optional."""
    raw = json.loads((dst / "config.json").read_text())
    tensors = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    mapped = {}
    for name, t in tensors.items():
        native = KEY_MAPS["transformers"].to_native(name).name
        mapped[native] = t.to(torch.int32) if native.endswith("tid2eid") else t
    hub = {k: v for k, v in raw.items() if k not in ("layer_types", "mlp_layer_types", "compress_rates",
                                                     "rope_parameters", "partial_rotary_factor")}
    n_mtp = raw["num_nextn_predict_layers"] if mtp else 0
    hub.update(compress_ratios=[RATIOS[t] for t in raw["layer_types"]] + [0] * n_mtp,
               num_hash_layers=raw["mlp_layer_types"].count("hash_moe"),
               qk_rope_head_dim=int(raw["head_dim"] * raw["partial_rotary_factor"]),
               compress_rate_csa=raw["compress_rates"]["compressed_sparse_attention"],
               compress_rate_hca=raw["compress_rates"]["heavily_compressed_attention"],
               rope_scaling={k: v for k, v in raw["rope_parameters"]["compress"].items()
                             if k not in ("rope_theta", "partial_rotary_factor", "attention_factor")},
               num_nextn_predict_layers=n_mtp)
    if mtp:
        gen = torch.Generator().manual_seed(seed + 1000)
        cfg = DeepseekV4Config.from_dict(hub)
        for name, shape in native_shapes(cfg).items():
            if name.startswith("mtp."):
                mapped[name] = (torch.randn(shape, generator=gen) * 0.1).to(torch.bfloat16)
    (dst / "config.json").write_text(json.dumps(hub, indent=2))
    names = sorted(mapped)
    halves = [{n: mapped[n].contiguous() for n in names[: len(names) // 2]},
              {n: mapped[n].contiguous() for n in names[len(names) // 2:]}]
    files = [f"model-0000{i + 1}-of-00002.safetensors" for i in range(2)]
    weight_map = {}
    for part, fname in zip(halves, files):
        save_file(part, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in mapped.values())
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=2))
