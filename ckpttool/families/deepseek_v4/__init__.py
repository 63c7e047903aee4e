"""DeepSeek-V4 (V4-Flash, V4-Pro): shared-KV attention with sinks over a sliding window plus compressed
(CSA, with its indexer) or heavily compressed (HCA) KV, a grouped low-rank output projection,
hyper-connections, hash-routed then top-k experts, MTP layers. Its FAMILY row; the family's files are
laid out as families/base.py describes (config.py reads config.json)."""

from __future__ import annotations

from ckpttool.families.base import Family
from ckpttool.families.lazy import verifier_in
from ckpttool.families.deepseek_v4 import spec
from ckpttool.families.deepseek_v4.config import MODEL_TYPE, DeepseekV4Config


FAMILY = Family(
    name="deepseek_v4",
    model_types=(MODEL_TYPE,),
    key_map=spec.KEY_MAPS["deepseek"],
    key_map_of=spec.key_map,
    parse_config=DeepseekV4Config.from_dict,
    expected_shapes=lambda cfg, with_mtp: spec.hf_tensor_shapes(cfg, with_mtp=with_mtp),
    is_mtp_tensor=spec.is_mtp_tensor,
    num_experts=lambda cfg: cfg.n_routed_experts,
    vocab_size=lambda cfg: cfg.vocab_size,
    check_mp=spec.check_mp,
    verifier=verifier_in(__name__),
    mtp_config_key="num_nextn_predict_layers",
    mtp_in_mp=True,
    # buffers in transformers' DeepseekV4 routers, in either spelling (DeepSeek's `ffn.gate.bias`)
    buffers=("e_score_correction_bias", "tid2eid", "gate.bias"),
    refused_types={"deepseek_v41": "DeepSeek-V4.1 (a text_config with KV and indexers shared across layers, "
                                   "compress ratios 1 and 2, Engram tables, DSpark stages, and a vision tower) "
                                   "has no implementation in transformers 5.24, verify's oracle, nor in "
                                   "ckpttool's DeepSeek-V4 model"},
)
