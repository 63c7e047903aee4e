"""LongCat-Flash: two MLA sublayers with LoRA scaling, two MLPs and a shortcut MoE with zero (identity) experts
per decoder layer. Its FAMILY row; the family's files are laid out as families/base.py describes."""

from __future__ import annotations

from ckpttool.families.base import Family
from ckpttool.families.lazy import verifier_in
from ckpttool.families.longcat_flash import spec


FAMILY = Family(
    name="longcat_flash",
    model_types=spec.MODEL_TYPES,
    key_map=spec.KEY_MAP,
    parse_config=spec.LongcatFlashConfig.from_dict,
    expected_shapes=spec.hf_tensor_shapes,
    is_mtp_tensor=spec.is_mtp_tensor,  # kept in HF outputs, dropped from mp shards unless --keep-mtp (spec.py)
    num_experts=lambda cfg: cfg.num_experts,  # routed + zero experts (spec.py)
    vocab_size=lambda cfg: cfg.vocab_size,
    check_mp=spec.check_mp,
    verifier=verifier_in(__name__),
    spelled=spec.spelled,
    stacked_experts=spec.stacked_experts,
    buffers=("e_score_correction_bias",),  # a registered buffer in transformers' router
)
