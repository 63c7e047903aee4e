"""The MLA family: DeepSeek V2 / V2-Lite / V3 / R1 / V3.2, Kimi-K2, GLM-5 (glm_moe_dsa), Mistral 4 and Mistral
Large 4's text model (read inside its wrapper, families/multimodal.py): MLA attention, routed + shared experts,
MTP layers, each model type a row of types.py. Its FAMILY row; the family's files are laid out as
families/base.py describes."""

from __future__ import annotations

from ckpttool.families.base import Family
from ckpttool.families.lazy import verifier_in
from ckpttool.families.deepseek import spec
from ckpttool.families.deepseek.types import TYPES


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
    verifier=verifier_in(__name__),
    mtp_config_key="num_nextn_predict_layers",
    explicit_config=spec.explicit_config,
    buffers=("e_score_correction_bias",),  # a registered buffer in transformers' routers
    transformers_types={"kimi_k2": "deepseek_v3"},
    refused_types={t: row.wrapped_only for t, row in TYPES.items() if row.wrapped_only},
)
