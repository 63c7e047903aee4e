"""The MLA family: DeepSeek V2 / V2-Lite / V3 / R1 / V3.2, Kimi-K2, GLM-5 (glm_moe_dsa) and Mistral 4 (MLA
attention, routed + shared experts, MTP layers), each model type a row of types.py. Its FAMILY row; the
family's files are laid out as families/base.py describes."""

from __future__ import annotations

from ckpttool.families.base import Family, Verifier
from ckpttool.families.deepseek import spec


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
    transformers_types={"kimi_k2": "deepseek_v3"},
)
