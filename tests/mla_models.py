"""Tiny MLA-family checkpoints that transformers 5.24 builds and saves itself (GLM-5, Mistral 4, and Kimi-K2.5's
multimodal wrapper over a DeepSeek-V3 text tower), every parameter and router bias perturbed, and transformers'
own greedy ids as the oracle."""

from __future__ import annotations

import json
from pathlib import Path

import torch

_MLA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
            n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=32,
            kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=128,
            eos_token_id=None, bos_token_id=None, pad_token_id=None)
# Each exercises what its type adds: GLM-5's indexers shared across layers (index_topk_freq 2: layer 2 holds
# none), biased MLA projections, sigmoid routing with a bias over groups; Mistral 4's softmax routing over
# groups without a bias, YaRN over a short original length with Llama-4's query scaling (positions 4 and on),
# biases; Kimi-K2.5's DeepSeek-V3 text tower (model_type kimi_k2, as published) beside a vision tower and
# projector.
TINY = {
    "glm_moe_dsa": dict(cls="GlmMoeDsaForCausalLM", config="GlmMoeDsaConfig", **_MLA, num_hidden_layers=4,
                        n_group=2, topk_group=1, routed_scaling_factor=2.5, attention_bias=True, index_n_heads=2,
                        index_head_dim=16, index_topk=64, index_topk_freq=2,
                        rope_parameters={"rope_type": "default", "rope_theta": 40000.0}),
    "mistral4": dict(cls="Mistral4ForCausalLM", config="Mistral4Config", **_MLA, num_hidden_layers=3, n_group=2,
                     topk_group=1, routed_scaling_factor=1.5, attention_bias=True,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 4, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}),
}
KIMI_TEXT = dict(model_type="kimi_k2", **{k: v for k, v in _MLA.items() if not k.endswith("token_id")},
                 num_hidden_layers=2, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                 num_nextn_predict_layers=0, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
KIMI_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
                   pos_emb_height=4, pos_emb_width=4, pos_emb_time=2)
PROMPT = [3, 17, 42, 99, 7, 150]
NEW_TOKENS = 6


def perturb(model, seed: int | None = None) -> None:
    """Every parameter drawn anew (norms around 1), router biases non-zero: nothing left at its init. Seeded with
    `seed` first; None: where the caller seeded before building the model."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.08) + (1.0 if name.endswith("norm.weight") else 0.0))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand_like(b) * 0.5)


def build_hf(model_type: str, dst: Path, *, seed: int = 0) -> Path:
    """save_pretrained of a tiny model of one TINY type, in float32."""
    import transformers
    from transformers.models import mistral4  # noqa: F401  (Mistral4ForCausalLM is outside transformers' top level)

    spec = dict(TINY[model_type])
    cls, config_cls = spec.pop("cls"), spec.pop("config")
    module = transformers if hasattr(transformers, cls) else transformers.models.mistral4
    config = getattr(module, config_cls)(**spec)
    model = getattr(module, cls)(config)
    perturb(model, seed)
    model.save_pretrained(dst)
    return dst


def build_kimi_k25(dst: Path, *, seed: int = 0, **save) -> Path:
    """A Kimi-K2.5 (Kimi_K25ForConditionalGeneration): DeepSeek-V3 text tower, MoonViT vision tower, projector.
    `save`: save_pretrained's arguments (save_original_format=False writes transformers' own names)."""
    from transformers.models.kimi_k25 import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    config = Kimi_K25Config(text_config=dict(KIMI_TEXT), vision_config=dict(KIMI_VISION), projection_hidden_size=32,
                            tie_word_embeddings=False)
    model = Kimi_K25ForConditionalGeneration(config)
    perturb(model, seed)
    model.save_pretrained(dst, **save)
    return dst


def greedy_oracle(hf_dir: Path, prompt: list[int] = PROMPT, new_tokens: int = NEW_TOKENS) -> list[int]:
    """transformers' own greedy ids in float32 (the auto class verify's oracle picks)."""
    import transformers

    from ckpttool.verify.oracle import _auto_class

    config = transformers.AutoConfig.from_pretrained(hf_dir)
    model = _auto_class(transformers, type(config)).from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def config_of(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


# MiniMax-M3 (minimax_m3_vl): GQA with KV heads replicated at mp 4, a dense layer among MoE ones, a layer with the
# lightning indexer (blocks of 4 keys, 4 kept: 16 positions, more than the tests' 12), partial rotary, and a
# swiglu_limit the activations reach.
MINIMAX_TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=32, dense_intermediate_size=96,
                    shared_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, num_local_experts=4, num_experts_per_tok=2, routed_scaling_factor=1.5,
                    swiglu_limit=0.6, mlp_layer_types=["dense", "sparse", "sparse"],
                    layer_types=["full_attention", "minimax_m3_sparse", "full_attention"], index_n_heads=2,
                    index_head_dim=8, index_block_size=4, index_topk_blocks=4, max_position_embeddings=128,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                    bos_token_id=None, eos_token_id=None)
MINIMAX_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
                      image_size=16, spatial_merge_size=2)


def build_minimax_m3(dst: Path, *, seed: int = 0, **save) -> Path:
    """A MiniMax-M3 (MiniMaxM3SparseForConditionalGeneration): its text model beside a vision tower and projector."""
    from transformers.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig

    config = MiniMaxM3VLConfig(text_config=dict(MINIMAX_TEXT), vision_config=dict(MINIMAX_VISION),
                               projector_hidden_size=64)
    model = MiniMaxM3SparseForConditionalGeneration(config)
    perturb(model, seed)
    model.save_pretrained(dst, **save)
    return dst
