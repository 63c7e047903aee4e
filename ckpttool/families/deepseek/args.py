"""Model arguments for the bundled DeepSeek V2/V3 model, read from the HF config.json beside the shards.

Where the reference model.py (shared/seeds) and transformers' DeepseekV2/V3 disagree, we follow
transformers, because verify's oracle test compares against it:
- YaRN is applied whenever config.json asks for it (the reference only when max_seq_len exceeds the
  original length), and its `attention_factor` (mscale / mscale_all_dim) scales cos/sin.
- The softmax scale uses `mscale_all_dim` (the reference's `mscale` argument is the same number).
- The correction bias exists when `topk_method == "noaux_tc"` (the reference keys it on dim == 7168).
- Top-k weights are renormalised when `norm_topk_prob` is set (the reference: whenever sigmoid).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ckpttool.errors import InputError
from ckpttool.families.base import Rope, config_fields, eos_ids, read_rope
from ckpttool.families.deepseek.spec import V3_ARCHITECTURE, DeepseekConfig, with_defaults
from ckpttool.formats import declares_fp8_block


@dataclass(kw_only=True, slots=True, frozen=True)
class YarnArgs:
    factor: float
    original_seq_len: int
    beta_fast: float = 32
    beta_slow: float = 1
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelArgs:
    """Everything the model needs to build its modules; `layers` excludes MTP layers."""

    vocab_size: int
    dim: int
    inter_dim: int
    moe_inter_dim: int
    n_layers: int
    n_mtp_layers: int  # config.json's num_nextn_predict_layers: shards may hold them; the model does not run them
    moe_layers: tuple[bool, ...]  # per layer: MoE (True) or dense MLP (False)
    n_heads: int
    # MoE routing
    n_routed_experts: int
    n_shared_experts: int
    n_activated_experts: int
    score_func: Literal["softmax", "sigmoid"]
    group_score: Literal["none", "max", "top2_sum"]  # how a group of experts is ranked
    n_expert_groups: int
    n_limited_groups: int
    correction_bias: bool
    norm_topk_prob: bool
    route_scale: float
    # MLA
    q_lora_rank: int  # 0: a plain wq projection
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # RoPE
    rope_theta: float
    yarn: YarnArgs | None
    rope_interleave: bool  # rotate adjacent pairs (x0, x1) rather than (x_i, x_{i+d/2})
    norm_eps: float
    fp8: bool  # linear weights are FP8 e4m3 with 128x128 block scales
    eos_token_ids: tuple[int, ...]
    # DeepSeek-V3.2's indexer (0 heads: none). Its weights are loaded and checked; attention runs dense,
    # which is what the sparse attention computes while a sequence is no longer than index_topk.
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        if self.yarn is not None and self.yarn.mscale_all_dim:
            m = yarn_mscale(self.yarn.factor, self.yarn.mscale_all_dim)
            scale *= m * m
        return scale

    @classmethod
    def from_hf_config(cls, raw: dict, source: object = "config.json") -> "ModelArgs":
        cfg = DeepseekConfig.from_dict(raw, source)
        raw = with_defaults(raw)
        is_v3 = cfg.model_type in V3_ARCHITECTURE
        topk_method, score_func = raw.get("topk_method"), raw.get("scoring_func")
        # exactly the routing transformers' models run; anything else would be a guess
        if is_v3 and (topk_method, score_func) != ("noaux_tc", "sigmoid"):
            raise InputError(f"unsupported routing for the DeepSeek-V3 architecture: topk_method={topk_method!r}, "
                             f"scoring_func={score_func!r}", file=source,
                             fix="DeepSeek-V3 (and Kimi-K2) route noaux_tc over sigmoid scores; check config.json")
        if not is_v3 and (topk_method not in ("greedy", "group_limited_greedy") or score_func != "softmax"
                          or raw.get("norm_topk_prob")):
            raise InputError(f"unsupported routing for DeepSeek-V2: topk_method={topk_method!r}, "
                             f"scoring_func={score_func!r}, norm_topk_prob={raw.get('norm_topk_prob')!r}", file=source,
                             fix="DeepSeek-V2 routes softmax scores, greedy or group_limited_greedy, without "
                                 "renormalising (as transformers' DeepseekV2); check config.json")
        if cfg.model_type == "deepseek_v32" and (raw.get("attention_bias") or not cfg.q_lora_rank):
            raise InputError("DeepSeek-V3.2 with attention_bias or without q_lora_rank is not supported", file=source,
                             fix="ckpttool's model implements the published V3.2 attention (q_lora_rank, no biases)")
        group_score = {"noaux_tc": "top2_sum", "group_limited_greedy": "max", "greedy": "none"}[topk_method]
        with config_fields(source):
            n_groups = int(raw.get("n_group") or 1) if group_score != "none" else 1
            rope = read_rope(raw, source, default_theta=10000.0, types=("default", "yarn"))
        return cls(
            vocab_size=cfg.vocab_size,
            dim=cfg.hidden_size,
            inter_dim=cfg.intermediate_size,
            moe_inter_dim=cfg.moe_intermediate_size,
            n_layers=cfg.num_hidden_layers,
            n_mtp_layers=cfg.num_nextn_predict_layers,
            moe_layers=tuple(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)),
            n_heads=cfg.num_attention_heads,
            n_routed_experts=cfg.n_routed_experts,
            n_shared_experts=cfg.n_shared_experts,
            n_activated_experts=cfg.num_experts_per_tok,
            score_func=score_func,
            group_score=group_score,
            n_expert_groups=n_groups,
            n_limited_groups=int(raw.get("topk_group") or 1) if n_groups > 1 else 1,
            correction_bias=cfg.has_correction_bias,
            norm_topk_prob=bool(raw.get("norm_topk_prob")),
            route_scale=float(raw.get("routed_scaling_factor") or 1.0),
            q_lora_rank=cfg.q_lora_rank or 0,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim,
            rope_theta=rope.theta,
            yarn=_yarn_args(rope, raw),
            rope_interleave=bool(raw.get("rope_interleave", True)) if is_v3 else True,
            norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            fp8=declares_fp8_block(raw.get("quantization_config"), source),
            eos_token_ids=eos_ids(raw),
            index_n_heads=cfg.index_n_heads,
            index_head_dim=cfg.index_head_dim,
            index_topk=int(raw["index_topk"]) if cfg.index_n_heads else 0,
        )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_args(rope: Rope, raw: dict) -> YarnArgs | None:
    if rope.type == "default":
        return None
    p = rope.params
    original = int(p["original_max_position_embeddings"])
    factor = p.get("factor")
    return YarnArgs(
        factor=float(factor) if factor is not None else int(raw["max_position_embeddings"]) / original,
        original_seq_len=original,
        beta_fast=float(p.get("beta_fast") or 32),
        beta_slow=float(p.get("beta_slow") or 1),
        mscale=float(p.get("mscale") or 0.0),
        mscale_all_dim=float(p.get("mscale_all_dim") or 0.0),
        attention_factor=None if p.get("attention_factor") is None else float(p["attention_factor"]),
        truncate=bool(p.get("truncate", True)),
    )
