"""DeepSeek V2 / V2-Lite / V3 / R1: config, tensor shapes and the HF <-> reference-mp key table.

The key table carries rename and shard together, exactly as the reference convert.py does:
`(hf template, native template, split)` where split is a dim to cut for tensor parallelism,
`EXPERT` for routed experts (whole tensors, distributed by contiguous expert range) or None
(replicated). `{layer}` and `{expert}` are the only placeholders.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpttool.families.base import (config_fields, decoder_shapes, layer_index, mtp_shapes, rope_theta_of,
                                    state_fields)
from ckpttool.families.keymap import EXPERT, LINEAR, KeyMap
from ckpttool.errors import InputError, PlanError

MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2")
V3_ARCHITECTURE = ("deepseek_v3", "deepseek_v32", "kimi_k2")
"""model types with DeepSeek-V3's router: sigmoid scores, e_score_correction_bias, grouped top-k (noaux_tc)"""

_SHARED_DEFAULTS = {
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "moe_layer_freq": 1,
}
CONFIG_DEFAULTS: dict[str, dict] = {
    "deepseek_v2": {**_SHARED_DEFAULTS, "vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008,
                    "moe_intermediate_size": 1407, "num_hidden_layers": 32, "num_attention_heads": 32,
                    "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": None,
                    "first_k_dense_replace": 0, "num_nextn_predict_layers": 0, "topk_method": "greedy",
                    "scoring_func": "softmax", "n_group": None, "topk_group": None, "norm_topk_prob": False,
                    "routed_scaling_factor": 1.0, "max_position_embeddings": 2048},
    "deepseek_v3": {**_SHARED_DEFAULTS, "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
                    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
                    "first_k_dense_replace": 3, "num_nextn_predict_layers": 1, "topk_method": "noaux_tc",
                    "scoring_func": "sigmoid", "n_group": 8, "topk_group": 4, "norm_topk_prob": True,
                    "routed_scaling_factor": 2.5, "rope_interleave": True, "max_position_embeddings": 4096},
}
"""What transformers' DeepseekV2Config / DeepseekV3Config hold for a field config.json leaves out (and what
their models do: V2 routes softmax greedy or group-limited, V3 noaux_tc over sigmoid). Kimi-K2 is the V3
architecture under its own model_type. tests/test_config_reading.py holds these to the installed classes."""
CONFIG_DEFAULTS["kimi_k2"] = CONFIG_DEFAULTS["deepseek_v3"]
CONFIG_DEFAULTS["deepseek_v32"] = {**CONFIG_DEFAULTS["deepseek_v3"], "num_nextn_predict_layers": 0,
                                   "max_position_embeddings": 163840, "index_topk": 2048, "index_head_dim": 128,
                                   "index_n_heads": 64, "attention_bias": False}
"""DeepSeek-V3.2 (transformers' DeepseekV32Config): V3 plus the sparse-attention indexer; the class has no
MTP field (published configs state num_nextn_predict_layers) and reads `mlp_layer_types` if given."""


DEFAULT_ROPE_THETA = 10000.0  # DeepseekV2Config's and DeepseekV3Config's
ROUTING_FIELDS = ("topk_method", "scoring_func", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor",
                  "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "first_k_dense_replace",
                  "moe_layer_freq")
"""What the HF outputs state explicitly (Family.explicit_config): transformers 5 saves a V3 config without
topk_method / scoring_func (its model hard-codes noaux_tc over sigmoid), and vLLM and llama.cpp then route
with softmax, or fail on the correction bias."""


def with_defaults(raw: dict) -> dict:
    """config.json's fields over transformers' defaults for its model_type (an explicit null stays null)."""
    return {**CONFIG_DEFAULTS.get(raw.get("model_type"), {}), **raw}


def explicit_config(raw: dict, source: object = "config.json") -> dict:
    """config.json with the routing fields and rope_theta its model type defaults to stated."""
    DeepseekConfig.from_dict(raw, source)  # refuse what the planner would refuse, with its message
    defaults = CONFIG_DEFAULTS.get(raw.get("model_type"), {})
    return state_fields(raw, {k: defaults.get(k) for k in ROUTING_FIELDS},
                        theta=rope_theta_of(raw, DEFAULT_ROPE_THETA))

_ATTN = [
    ("self_attn.q_proj.weight", "attn.wq.weight", 0, LINEAR),
    ("self_attn.q_a_proj.weight", "attn.wq_a.weight", None, LINEAR),
    ("self_attn.q_a_layernorm.weight", "attn.q_norm.weight", None),
    ("self_attn.q_b_proj.weight", "attn.wq_b.weight", 0, LINEAR),
    ("self_attn.kv_a_proj_with_mqa.weight", "attn.wkv_a.weight", None, LINEAR),
    ("self_attn.kv_a_layernorm.weight", "attn.kv_norm.weight", None),
    ("self_attn.kv_b_proj.weight", "attn.wkv_b.weight", 0, LINEAR),
    ("self_attn.o_proj.weight", "attn.wo.weight", 1, LINEAR),
    # DeepSeek-V3.2's indexer: replicated on every rank (its wq_b is not MLA's wq_b, which is split)
    ("self_attn.indexer.wq_b.weight", "attn.indexer.wq_b.weight", None, LINEAR),
    ("self_attn.indexer.wk.weight", "attn.indexer.wk.weight", None, LINEAR),
    ("self_attn.indexer.k_norm.weight", "attn.indexer.k_norm.weight", None),
    ("self_attn.indexer.k_norm.bias", "attn.indexer.k_norm.bias", None),
    ("self_attn.indexer.weights_proj.weight", "attn.indexer.weights_proj.weight", None),
]
_MLP = [("gate_proj.weight", "w1.weight", 0, LINEAR), ("down_proj.weight", "w2.weight", 1, LINEAR),
        ("up_proj.weight", "w3.weight", 0, LINEAR)]
_MTP = [
    ("enorm.weight", "enorm.weight", None),
    ("hnorm.weight", "hnorm.weight", None),
    ("eh_proj.weight", "eh_proj.weight", None, LINEAR),
    ("embed_tokens.weight", "embed.weight", 0),
    ("shared_head.norm.weight", "shared_head.norm.weight", None),
    ("shared_head.head.weight", "shared_head.head.weight", 0),
]


def _layer_rows() -> list[tuple[str, str, object]]:
    hf, nat = "model.layers.{layer}.", "layers.{layer}."
    rows = [
        (hf + "input_layernorm.weight", nat + "attn_norm.weight", None),
        (hf + "post_attention_layernorm.weight", nat + "ffn_norm.weight", None),
        (hf + "mlp.gate.weight", nat + "ffn.gate.weight", None),
        (hf + "mlp.gate.e_score_correction_bias", nat + "ffn.gate.bias", None),
    ]
    rows += [(hf + a, nat + b, *rest) for a, b, *rest in _ATTN]
    rows += [(hf + "mlp." + a, nat + "ffn." + b, *rest) for a, b, *rest in _MLP]
    rows += [(hf + "mlp.shared_experts." + a, nat + "ffn.shared_experts." + b, *rest) for a, b, *rest in _MLP]
    rows += [(hf + "mlp.experts.{expert}." + a, nat + "ffn.experts.{expert}." + b, EXPERT, LINEAR) for a, b, *_ in _MLP]
    rows += [(hf + a, nat + b, *rest) for a, b, *rest in _MTP]
    return rows


KEY_TABLE: list[tuple] = [
    ("model.embed_tokens.weight", "embed.weight", 0),
    ("model.norm.weight", "norm.weight", None),
    ("lm_head.weight", "head.weight", 0),
    *_layer_rows(),
]
"""Weights only; each `*.weight` row implies its FP8 scale row (`*.weight_scale_inv` -> `*.scale`)."""
KEY_MAP = KeyMap(KEY_TABLE)


@dataclass(kw_only=True, slots=True, frozen=True)
class DeepseekConfig:
    """The fields of an HF DeepSeek V2/V3 config.json that decide tensor names, shapes and routing."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    moe_layer_freq: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_nextn_predict_layers: int
    has_correction_bias: bool
    tie_word_embeddings: bool
    index_n_heads: int = 0  # DeepSeek-V3.2's indexer; 0: none
    index_head_dim: int = 0
    mlp_layer_types: tuple[str, ...] | None = None  # V3.2: "dense" / "sparse" per layer, when given

    @classmethod
    def from_dict(cls, raw: dict, source: object = "config.json") -> "DeepseekConfig":
        raw = with_defaults(raw)
        with config_fields(source):
            model_type = raw["model_type"]
            cfg = cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                moe_intermediate_size=int(raw["moe_intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=int(raw["num_attention_heads"]),
                n_routed_experts=int(raw["n_routed_experts"]),
                n_shared_experts=int(raw.get("n_shared_experts") or 0),
                num_experts_per_tok=int(raw["num_experts_per_tok"]),
                first_k_dense_replace=int(raw.get("first_k_dense_replace", 0)),
                moe_layer_freq=int(raw.get("moe_layer_freq", 1)),
                q_lora_rank=int(raw["q_lora_rank"]) if raw.get("q_lora_rank") else None,
                kv_lora_rank=int(raw["kv_lora_rank"]),
                qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
                qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
                v_head_dim=int(raw["v_head_dim"]),
                num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers", 0)),
                has_correction_bias=model_type in V3_ARCHITECTURE or raw.get("topk_method") == "noaux_tc",
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                index_n_heads=int(raw["index_n_heads"]) if model_type == "deepseek_v32" else 0,
                index_head_dim=int(raw["index_head_dim"]) if model_type == "deepseek_v32" else 0,
                mlp_layer_types=_mlp_layer_types(raw, source) if model_type == "deepseek_v32" else None,
            )
        if cfg.n_routed_experts and not 0 < cfg.num_experts_per_tok <= cfg.n_routed_experts:
            raise InputError(f"num_experts_per_tok ({cfg.num_experts_per_tok}) is not in 1..{cfg.n_routed_experts} "
                             "(n_routed_experts)", file=source, fix="use the config.json published with the checkpoint")
        return cfg

    def is_moe_layer(self, layer: int) -> bool:
        if self.mlp_layer_types is not None and layer < len(self.mlp_layer_types):
            return self.mlp_layer_types[layer] == "sparse"
        return (
            self.n_routed_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % max(self.moe_layer_freq, 1) == 0
        )

    def is_mtp_layer(self, layer: int) -> bool:
        return layer >= self.num_hidden_layers


def _mlp_layer_types(raw: dict, source: object) -> tuple[str, ...] | None:
    types = raw.get("mlp_layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != int(raw["num_hidden_layers"]) or set(types) - {"dense", "sparse"}:
        raise InputError(f"mlp_layer_types {types!r} is not one of 'dense' / 'sparse' per layer", file=source,
                        fix="use the config.json published with the checkpoint")
    return tuple(types)


def hf_tensor_shapes(cfg: DeepseekConfig, *, with_mtp: bool = True) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF DeepSeek checkpoint of this config holds (weights only, no FP8 scales)."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    qk_head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    n_layers = cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if with_mtp else 0)
    shapes, prefixes = decoder_shapes(cfg.vocab_size, h, n_layers, tie_word_embeddings=cfg.tie_word_embeddings)
    for layer, p in enumerate(prefixes):
        if cfg.q_lora_rank:
            shapes[p + "self_attn.q_a_proj.weight"] = (cfg.q_lora_rank, h)
            shapes[p + "self_attn.q_a_layernorm.weight"] = (cfg.q_lora_rank,)
            shapes[p + "self_attn.q_b_proj.weight"] = (heads * qk_head, cfg.q_lora_rank)
        else:
            shapes[p + "self_attn.q_proj.weight"] = (heads * qk_head, h)
        shapes[p + "self_attn.kv_a_proj_with_mqa.weight"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h)
        shapes[p + "self_attn.kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
        shapes[p + "self_attn.kv_b_proj.weight"] = (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        shapes[p + "self_attn.o_proj.weight"] = (h, heads * cfg.v_head_dim)
        if cfg.index_n_heads:
            d = cfg.index_head_dim
            shapes[p + "self_attn.indexer.wq_b.weight"] = (cfg.index_n_heads * d, cfg.q_lora_rank)
            shapes[p + "self_attn.indexer.wk.weight"] = (d, h)
            shapes[p + "self_attn.indexer.k_norm.weight"] = (d,)
            shapes[p + "self_attn.indexer.k_norm.bias"] = (d,)
            shapes[p + "self_attn.indexer.weights_proj.weight"] = (cfg.index_n_heads, h)
        if cfg.is_moe_layer(layer) or cfg.is_mtp_layer(layer):
            inter = cfg.moe_intermediate_size
            shapes[p + "mlp.gate.weight"] = (cfg.n_routed_experts, h)
            if cfg.has_correction_bias:
                shapes[p + "mlp.gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
            for e in range(cfg.n_routed_experts):
                _mlp_shapes(shapes, f"{p}mlp.experts.{e}.", h, inter)
            if cfg.n_shared_experts:
                _mlp_shapes(shapes, p + "mlp.shared_experts.", h, inter * cfg.n_shared_experts)
        else:
            _mlp_shapes(shapes, p + "mlp.", h, cfg.intermediate_size)
        if cfg.is_mtp_layer(layer):
            mtp_shapes(shapes, p, cfg.vocab_size, h)
    return shapes


def _mlp_shapes(shapes: dict, prefix: str, hidden: int, inter: int) -> None:
    shapes[prefix + "gate_proj.weight"] = (inter, hidden)
    shapes[prefix + "up_proj.weight"] = (inter, hidden)
    shapes[prefix + "down_proj.weight"] = (hidden, inter)


def is_fp8_in_published_checkpoint(hf_name: str) -> bool:
    """Which weights DeepSeek publishes as FP8 e4m3 with a 128x128 `weight_scale_inv`: the linear
    projections of attention and MLP/experts (and MTP's eh_proj), the key table's LINEAR rows; not
    embeddings, norms, router or head."""
    return KEY_MAP.is_linear(hf_name)


def is_mtp_tensor(cfg: DeepseekConfig, hf_name: str) -> bool:
    layer = layer_index(hf_name)
    return layer is not None and cfg.is_mtp_layer(layer)


def check_mp(cfg: DeepseekConfig, mp: int) -> None:
    """Heads, routed experts and the vocabulary must split evenly; a size that divides is not enough
    when it would cut a head (q_b rows are heads x 192)."""
    for what, size in (("num_attention_heads", cfg.num_attention_heads), ("n_routed_experts", cfg.n_routed_experts),
                       ("vocab_size", cfg.vocab_size)):
        if size % mp:
            raise PlanError(f"{what} ({size}) is not divisible by mp={mp}", file="config.json",
                            fix=f"choose an --mp that divides {size}")
