"""Tiny Mistral Large 4 checkpoints (mistral_large4: its MLA text tower beside a Pixtral vision tower and projector)
that transformers 5.24 builds and saves itself, every parameter perturbed, in both spellings of the same weights:
Mistral's own names (what save_pretrained writes by default, as on the hub) and transformers' own
(save_original_format=False, experts stacked)."""

from __future__ import annotations

from pathlib import Path

import torch

# Six layers, each exercising what Large 4 adds: NoPE layers (2 and 4), latent KV stored by layers 1 (RoPE) and 2
# (NoPE) and reused by layers 3 and 4 (which hold no kv_a_proj_with_mqa), "shared" indexer layers (2 and 5) that
# reuse the previous top-k, a dense first layer, softmax routing over two expert groups, YaRN over a short original
# length with a learned LeRoPE alpha, and per-head softmax scaling in attention and indexer alike.
TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
            first_k_dense_replace=1, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            max_position_embeddings=128, num_hidden_layers=6, n_group=2, topk_group=1, routed_scaling_factor=1.5,
            index_n_heads=2, index_head_dim=16, index_topk=64, no_rope_layers=[1, 1, 0, 1, 0, 1],
            kv_source_layers=[0, 1, 2, 1, 2, 5], indexer_types=["full", "full", "shared", "full", "full", "shared"],
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 4, "beta_fast": 32.0, "beta_slow": 1.0,
                             "attention_factor": 1.0},
            final_logit_softcapping=3.0, eos_token_id=None, bos_token_id=None, pad_token_id=None)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
              image_size=16, head_dim=16)
PASSED = ("vision_encoder.", "pre_mm_projector_norm.", "patch_merger.", "vision_language_adapter.",
          "model.vision_tower.", "model.multi_modal_projector.")


def build_model(seed: int = 0, **text):
    """MistralLarge4ForConditionalGeneration with every parameter drawn anew: norms around 1, softmax scaling
    biases around 1 with non-zero slopes, a non-zero LeRoPE alpha."""
    from transformers.models.mistral_large4 import MistralLarge4Config, MistralLarge4ForConditionalGeneration

    model = MistralLarge4ForConditionalGeneration(
        MistralLarge4Config(text_config={**TEXT, **text}, vision_config=dict(VISION)))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("softmax_scaling.bias"):
                p.copy_(1.0 + torch.randn_like(p) * 0.2)
            elif name.endswith("softmax_scaling.scale"):
                p.copy_(torch.randn_like(p) * 0.3)
            elif name.endswith("rotary_emb.alpha"):
                p.copy_(torch.randn_like(p) * 0.5)
            else:
                p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.08)
                        + (1.0 if name.endswith("norm.weight") else 0.0))
    return model


def build_large4(root: Path, seed: int = 0, **text) -> dict[str, Path]:
    """spelling ("mistral": Mistral's own names, "transformers": save_original_format=False) -> its HF dir, the
    same weights in each."""
    model = build_model(seed, **text)
    model.save_pretrained(root / "mistral")
    model.save_pretrained(root / "transformers", save_original_format=False)
    return {"mistral": root / "mistral", "transformers": root / "transformers"}
