"""Model arguments for the bundled MLA model (DeepSeek V2/V3/V3.2, Kimi-K2, GLM-5, Mistral 4, Large 4), read
from the HF config.json beside the shards, through the model type's row (types.py).

Where the reference model.py (shared/seeds) and transformers' DeepseekV2/V3 disagree, we follow
transformers, because verify's oracle test compares against it:
- YaRN is applied whenever config.json asks for it (the reference only when max_seq_len exceeds the
  original length), and its `attention_factor` (mscale / mscale_all_dim) scales cos/sin.
- The softmax scale uses `mscale_all_dim` (the reference's `mscale` argument is the same number).
- The correction bias exists where the type's router has one (types.py; the reference keys it on dim == 7168).
- Top-k weights are renormalised when `norm_topk_prob` is set (the reference: whenever sigmoid).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ckpttool.errors import InputError
from ckpttool.families.base import Rope, config_fields, eos_ids, read_rope
from ckpttool.families.deepseek.spec import DEFAULT_ROPE_THETA, DeepseekConfig, with_defaults
from ckpttool.families.deepseek.types import MlaType
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
    attention_bias: bool = False  # q_a_proj (wq_a), kv_a_proj_with_mqa (wkv_a) and o_proj (wo) carry biases
    tie_word_embeddings: bool = False  # the head is the embedding (no head.weight)
    llama4_beta: float = 0.0  # Mistral 4: queries scaled by 1 + beta * log(1 + floor(pos / llama4_original))
    llama4_original: int = 1
    # The DSA indexer (DeepSeek-V3.2, GLM-5; 0 heads: none), in the layers `indexer_layers` marks. Its weights
    # are loaded and checked; attention runs dense, which is what the sparse attention computes while a
    # sequence is no longer than index_topk.
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    indexer_layers: tuple[bool, ...] = ()
    # Mistral Large 4 (types.py): which layers rotate and whose latent KV each attends to (empty: all rotate, each
    # its own), per-head query scaling by log(position), learned rotary frequencies, logit softcapping (0: none),
    # and the router's weight kept in float32 as transformers keeps it
    rope_layers: tuple[bool, ...] = ()
    kv_sources: tuple[int, ...] = ()
    softmax_scaling: bool = False
    lerope: bool = False
    logit_softcapping: float = 0.0
    fp32_router: bool = False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def rotates(self, layer: int) -> bool:
        return not self.rope_layers or self.rope_layers[layer]

    def kv_source(self, layer: int) -> int:
        return self.kv_sources[layer] if self.kv_sources else layer

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
        t = cfg.type
        if t.default_rope is not None and not (raw.get("rope_scaling") or raw.get("rope_parameters")):
            raw = {**raw, "rope_parameters": t.default_rope}  # the class's own rope (Mistral 4: YaRN)
        raw = with_defaults(raw)
        score_func, group_score = _routing(t, raw, source)
        with config_fields(source):
            n_groups = int(raw.get("n_group") or 1) if group_score != "none" else 1
            rope = read_rope(raw, source, default_theta=DEFAULT_ROPE_THETA, types=("default", "yarn"))
            _check_rotary_dims(cfg, rope, source)
            beta, original = _llama4_scaling(t, rope, source)
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
                rope_interleave=bool(raw["rope_interleave"]) if t.rope_interleave is None else t.rope_interleave,
                norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                fp8=declares_fp8_block(raw.get("quantization_config"), source),
                eos_token_ids=eos_ids(raw),
                attention_bias=cfg.attention_bias,
                tie_word_embeddings=cfg.tie_word_embeddings,
                llama4_beta=beta,
                llama4_original=original,
                index_n_heads=cfg.index_n_heads,
                index_head_dim=cfg.index_head_dim,
                index_topk=int(raw["index_topk"]) if cfg.index_n_heads else 0,
                indexer_layers=tuple(cfg.has_indexer(i) for i in range(cfg.num_hidden_layers)),
                rope_layers=cfg.rope_layers or (),
                kv_sources=cfg.kv_sources or (),
                softmax_scaling=t.softmax_scaling,
                lerope=t.lerope,
                logit_softcapping=float(raw.get("final_logit_softcapping") or 0.0) if t.logit_softcapping else 0.0,
                fp32_router=t.fp32_router,
            )


def _routing(t: MlaType, raw: dict, source: object) -> tuple[str, str]:
    """(score function, group ranking) of the type's router; a config asking for routing its transformers
    model does not run is refused, not approximated."""
    stated = {k: raw[k] for k in t.hard_coded if k in raw}
    wrong = {k: v for k, v in stated.items() if k in t.hard_coded and v != t.hard_coded[k]}
    method = raw.get("topk_method")
    if t.topk_methods is not None and method not in t.topk_methods:
        wrong["topk_method"] = method
    if not t.renormalizes and raw.get("norm_topk_prob"):
        wrong["norm_topk_prob"] = raw.get("norm_topk_prob")
    if wrong:
        asked = ", ".join(f"{k}={v!r}" for k, v in wrong.items())
        runs = ", ".join(f"{k}={v!r}" for k, v in t.hard_coded.items())
        if t.topk_methods is not None:
            runs += f", topk_method one of {sorted(t.topk_methods)}"
        if not t.renormalizes:
            runs += ", without renormalising (norm_topk_prob false)"
        raise InputError(f"unsupported routing for {t.title}: {asked}", file=source,
                         fix=f"transformers' model routes {runs}; check config.json")
    return t.scoring, t.topk_methods[method] if t.topk_methods is not None else t.group_score


def _check_rotary_dims(cfg: DeepseekConfig, rope: Rope, source: object) -> None:
    """The dims transformers rotates (its rotary head times any partial_rotary_factor) must be qk_rope_head_dim."""
    factor = rope.params.get("partial_rotary_factor")
    if factor is None:
        return
    head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim if cfg.type.rope_head_dim == "qk_head_dim" \
        else cfg.qk_rope_head_dim
    if int(head * float(factor)) != cfg.qk_rope_head_dim:
        raise InputError(f"partial_rotary_factor {factor} rotates {int(head * float(factor))} dims of each head, "
                         f"not its qk_rope_head_dim ({cfg.qk_rope_head_dim})", file=source,
                         fix="use the config.json published with the checkpoint")


def _llama4_scaling(t: MlaType, rope: Rope, source: object) -> tuple[float, int]:
    """Mistral 4's query scaling (llama_4_scaling_beta over original_max_position_embeddings); (0, 1): none."""
    if not t.llama4_scaling:
        return 0.0, 1
    beta, original = rope.params.get("llama_4_scaling_beta"), rope.params.get("original_max_position_embeddings")
    if beta is None or not original:
        raise InputError(f"{t.title} scales queries by the rope parameters' llama_4_scaling_beta and "
                         "original_max_position_embeddings, and config.json lacks one", file=source,
                         fix="use the config.json published with the checkpoint")
    return float(beta), int(original)


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
