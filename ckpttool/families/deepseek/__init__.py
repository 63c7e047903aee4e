"""The MLA family: DeepSeek V2 / V2-Lite / V3 / R1 / V3.2, Kimi-K2, GLM-5 (glm_moe_dsa) and Mistral 4 (MLA
attention, routed + shared experts, MTP layers), each model type a row of types.py. Its FAMILY row; the
family's files are laid out as families/base.py describes."""

from __future__ import annotations

from ckpttool.families.base import Family, Verifier
from ckpttool.families.deepseek import spec


_LARGE4 = ("Mistral Large 4's text model is GLM-5's MLA with the DSA indexer plus what ckpttool's MLA model does "
           "not implement yet: NoPE layers (no_rope_layers), latent KV shared across layers (kv_source_layers: "
           "layers without kv_a_proj_with_mqa), per-head query scaling by log(position) (softmax_scaling), LeRoPE's "
           "learned rotary frequencies (rotary_emb.alpha), final_logit_softcapping and an indexer of its own; its "
           "published checkpoint is in Mistral's native names (tok_embeddings, layers.N.attention.wq, "
           "vision_encoder.*), which no key table here reads")


def _verifier() -> Verifier:
    from ckpttool.families.deepseek.weights import VERIFIER

    return VERIFIER


FAMILY = Family(
    name="deepseek",
    model_types=spec.MODEL_TYPES,
    key_map=spec.KEY_MAP,
    parse_config=spec.DeepseekConfig.from_dict,
    expected_shapes=lambda cfg, with_mtp: spec.hf_tensor_shapes(cfg, with_mtp=with_mtp),
    is_mtp_tensor=spec.is_mtp_tensor,
    num_experts=lambda cfg: cfg.n_routed_experts,
    vocab_size=lambda cfg: cfg.vocab_size,
    check_mp=spec.check_mp,
    verifier=_verifier,
    mtp_config_key="num_nextn_predict_layers",
    explicit_config=spec.explicit_config,
    buffers=("e_score_correction_bias",),  # a registered buffer in transformers' routers
    transformers_types={"kimi_k2": "deepseek_v3"},
    refused_types={t: _LARGE4 for t in ("mistral_large4", "mistral_large4_text")},
)
