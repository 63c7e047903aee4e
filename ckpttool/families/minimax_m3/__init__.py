"""MiniMax-M3's text model (the text tower of `minimax_m3_vl`, read through its multimodal wrapper,
families/multimodal.py). Its FAMILY row; the family's files are laid out as families/base.py describes."""

from __future__ import annotations

from ckpttool.families.base import Family
from ckpttool.families.lazy import verifier_in
from ckpttool.families.minimax_m3 import spec


FAMILY = Family(
    name="minimax_m3",
    model_types=(),  # read inside minimax_m3_vl only: see refused_types
    key_map=spec.KEY_MAP,
    parse_config=spec.MiniMaxM3Config.from_dict,
    expected_shapes=lambda cfg, with_mtp: spec.hf_tensor_shapes(cfg, with_mtp=with_mtp),
    is_mtp_tensor=spec.is_mtp_tensor,
    num_experts=lambda cfg: cfg.num_experts,
    vocab_size=lambda cfg: cfg.vocab_size,
    check_mp=spec.check_mp,
    verifier=verifier_in(__name__),
    buffers=("e_score_correction_bias",),  # a registered buffer in transformers' router
    refused_types={spec.MODEL_TYPE: "MiniMax-M3's text model is read inside its multimodal checkpoint "
                                    "(minimax_m3_vl), under the hub's names; transformers' save of the text model "
                                    "alone fuses each MLP's gate_up_proj, which ckpttool does not split"},
)
