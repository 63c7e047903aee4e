"""DeepSeek-V4's config.json, read exactly as transformers 5.24's DeepseekV4Config reads it.

Both forms are read: DeepSeek's own (`compress_ratios` per layer, `num_hash_layers`, `qk_rope_head_dim`,
`rope_scaling`), which the class folds into its fields in `__post_init__`, and what the class itself
saves (`layer_types`, `mlp_layer_types`, `compress_rates`, `rope_parameters` keyed `main` / `compress`).
A config.json stating `layer_types` was written by transformers, whose save_pretrained also names the
tensors its own way: `spelling` records which of the two key tables (spec.py) the checkpoint uses.

What neither transformers' DeepseekV4 nor the bundled model implements is refused, not approximated:
other rope types, routing scores other than sqrtsoftplus / sigmoid, biases, tied embeddings, more than
one KV head or shared expert, a non-positive swiglu_limit, unnormalised top-k weights (transformers
always normalises), and the DSpark draft stages and DeepSeek-V4.1 parts some configs add.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ckpttool.errors import InputError
from ckpttool.families.base import config_fields

MODEL_TYPE = "deepseek_v4"
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
RATIO_TO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
"""DeepSeek's per-layer compress ratio -> transformers' layer type (its _COMPRESS_RATIO_TO_LAYER_TYPE)"""
HASH_MOE, MOE = "hash_moe", "moe"
DEFAULT_NUM_HASH_LAYERS = 3
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
SCORING = ("sqrtsoftplus", "sigmoid")
"""the router scores transformers' DeepseekV4 computes (its ACT2FN has no softmax)"""

CONFIG_DEFAULTS: dict = {
    "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 43,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1024,
    "num_experts_per_tok": 6, "n_routed_experts": 256, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True, "routed_scaling_factor": 1.5, "max_position_embeddings": 1048576, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1.0e-6, "swiglu_limit": 10.0,
    "sliding_window": 128, "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "num_nextn_predict_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1.0e-6,
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
}
"""DeepseekV4Config's class defaults (tests/test_deepseek_v4.py holds them to the installed class)."""

_REFUSED_FIELDS = {
    "dspark_block_size": "DSpark draft stages (DeepSeek-V4-Flash-0731's MTP)",
    "dspark_target_layer_ids": "DSpark draft stages (DeepSeek-V4-Flash-0731's MTP)",
    "kv_source_layer_ids": "KV shared across layers (DeepSeek-V4.1)",
    "kv_source_layers": "KV shared across layers (DeepSeek-V4.1)",
    "index_source_layer_ids": "indexers shared across layers (DeepSeek-V4.1)",
    "engram_layer_ids": "Engram n-gram tables (DeepSeek-V4.1)",
}
"""non-empty fields naming parts transformers 5.24's DeepseekV4 does not build: a checkpoint with them
has tensors neither it nor ckpttool's model knows"""


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """One of V4's two rotary embeddings (`main`: sliding-window layers; `compress`: compressed layers,
    their compressors and indexers): theta, rotated dims, and YaRN's parameters when scaled."""

    theta: float
    dim: int
    yarn: tuple[float, int, float, float, float] | None = None  # factor, original length, beta_fast, beta_slow,
    # attention factor


@dataclass(kw_only=True, slots=True, frozen=True)
class DeepseekV4Config:
    model_type: str
    spelling: str  # "deepseek" (DeepSeek's own tensor names) or "transformers" (what its save_pretrained writes)
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    num_experts_per_tok: int
    n_routed_experts: int
    scoring_func: str
    routed_scaling_factor: float
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rates: dict
    main_rope: RopeSpec
    compress_rope: RopeSpec
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_nextn_predict_layers: int
    mtp_layer_types: tuple[str, ...]  # the MTP layers' attention (DeepSeek's compress_ratios past the last layer)
    rms_norm_eps: float

    def layer_type(self, layer: int) -> str:
        """The attention of a layer; indices past the model are its MTP layers."""
        n = self.num_hidden_layers
        return self.layer_types[layer] if layer < n else self.mtp_layer_types[layer - n]

    def is_hash(self, layer: int) -> bool:
        return layer < self.num_hidden_layers and self.mlp_layer_types[layer] == HASH_MOE

    @classmethod
    def from_dict(cls, raw: dict, source: object = "config.json") -> "DeepseekV4Config":
        for name, what in _REFUSED_FIELDS.items():
            if raw.get(name):
                raise InputError(f"config.json's {name} asks for {what}, which transformers 5.24's DeepseekV4 "
                                 "and ckpttool's model do not implement", file=source,
                                 fix="convert the DeepSeek-V4 checkpoints transformers implements (V4-Flash, V4-Pro)")
        c = {**CONFIG_DEFAULTS, **raw}
        with config_fields(source):
            n = int(c["num_hidden_layers"])
            rates = _compress_rates(c)
            head_dim = int(c["head_dim"])
            rope_factor = _partial_rotary_factor(c, head_dim)
            main, compress = _ropes(c, head_dim, rope_factor, source)
            cfg = cls(
                model_type=c["model_type"], spelling="transformers" if "layer_types" in raw else "deepseek",
                vocab_size=int(c["vocab_size"]), hidden_size=int(c["hidden_size"]),
                moe_intermediate_size=int(c["moe_intermediate_size"]), num_hidden_layers=n,
                num_attention_heads=int(c["num_attention_heads"]), head_dim=head_dim,
                q_lora_rank=int(c["q_lora_rank"]), num_experts_per_tok=int(c["num_experts_per_tok"]),
                n_routed_experts=int(c["n_routed_experts"]), scoring_func=c["scoring_func"],
                routed_scaling_factor=float(c["routed_scaling_factor"]),
                layer_types=_layer_types(c, n, source), mlp_layer_types=_mlp_layer_types(c, n, source),
                compress_rates=rates, main_rope=main, compress_rope=compress,
                hc_mult=int(c["hc_mult"]), hc_sinkhorn_iters=int(c["hc_sinkhorn_iters"]), hc_eps=float(c["hc_eps"]),
                swiglu_limit=float(c["swiglu_limit"]), sliding_window=int(c["sliding_window"]),
                o_groups=int(c["o_groups"]), o_lora_rank=int(c["o_lora_rank"]),
                index_n_heads=int(c["index_n_heads"]), index_head_dim=int(c["index_head_dim"]),
                index_topk=int(c["index_topk"]),
                num_nextn_predict_layers=int(c.get("num_nextn_predict_layers") or 0),
                mtp_layer_types=_mtp_layer_types(c, n, source), rms_norm_eps=float(c["rms_norm_eps"]),
            )
        _refuse_unimplemented(cfg, c, source)
        return cfg


def _compress_rates(c: dict) -> dict:
    """`compress_rates`, else the defaults with the legacy `compress_rate_csa` / `compress_rate_hca` folded in."""
    rates = dict(c["compress_rates"]) if c.get("compress_rates") is not None else dict(DEFAULT_COMPRESS_RATES)
    for kind, legacy in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):
        if c.get(legacy) is not None:
            rates[kind] = int(c[legacy])
    return {k: int(v) for k, v in rates.items()}


def _types(ratios: list, source: object, what: str) -> list[str]:
    bad = [r for r in ratios if r not in RATIO_TO_LAYER_TYPE]
    if bad:
        raise InputError(f"{what} holds {bad[:3]}, not one of the compress ratios {sorted(RATIO_TO_LAYER_TYPE)}",
                         file=source, fix="use the config.json published with the checkpoint")
    return [RATIO_TO_LAYER_TYPE[r] for r in ratios]


def _layer_types(c: dict, n: int, source: object) -> tuple[str, ...]:
    """Explicit `layer_types` > DeepSeek's `compress_ratios` > V4-Pro's default (2 HCA, then HCA / CSA)."""
    types = c.get("layer_types")
    if types is None and c.get("compress_ratios") is not None:
        types = _types(list(c["compress_ratios"]), source, "compress_ratios")
    if types is None:
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    return _checked(list(types)[:n], n, (SLIDING, CSA, HCA), "layer_types", source)


def _mlp_layer_types(c: dict, n: int, source: object) -> tuple[str, ...]:
    """Explicit `mlp_layer_types`, else `num_hash_layers` (default 3) hash-routed layers, then top-k."""
    types = c.get("mlp_layer_types")
    if types is None:
        n_hash = int(c["num_hash_layers"]) if c.get("num_hash_layers") is not None else DEFAULT_NUM_HASH_LAYERS
        types = [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)
    return _checked(list(types)[:n], n, (HASH_MOE, MOE), "mlp_layer_types", source)


def _checked(types: list, n: int, allowed: tuple[str, ...], name: str, source: object) -> tuple[str, ...]:
    if len(types) != n or any(t not in allowed for t in types):
        raise InputError(f"{name} must be {n} entries of {', '.join(allowed)}, got {types[:4]}...", file=source,
                         fix="use the config.json published with the checkpoint")
    return tuple(types)


def _mtp_layer_types(c: dict, n: int, source: object) -> tuple[str, ...]:
    """The MTP layers' attention: DeepSeek's compress_ratios run on past the last layer (V4-Flash: one 0);
    a config without them (transformers saves none, and builds no MTP) gives sliding-window layers."""
    ratios = list(c.get("compress_ratios") or [])[n:]
    mtp = int(c.get("num_nextn_predict_layers") or 0)
    return tuple(_types(ratios[:mtp], source, "compress_ratios") + [SLIDING] * max(0, mtp - len(ratios)))


def _partial_rotary_factor(c: dict, head_dim: int) -> float:
    """`partial_rotary_factor`, else DeepSeek's `qk_rope_head_dim / head_dim`, else 64 / 512."""
    if c.get("partial_rotary_factor") is not None:
        return float(c["partial_rotary_factor"])
    if c.get("qk_rope_head_dim") is not None:
        return int(c["qk_rope_head_dim"]) / head_dim
    return 64 / 512


def _ropes(c: dict, head_dim: int, factor: float, source: object) -> tuple[RopeSpec, RopeSpec]:
    """transformers' `main` / `compress` rope parameters: given nested, or built from `rope_theta`,
    `compress_rope_theta` and a flat `rope_scaling` / `rope_parameters` (which scales the compressed
    layers only, YaRN with attention factor 1 unless it says otherwise)."""
    rp = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if not isinstance(rp, dict):
        raise InputError(f"rope parameters are a JSON {type(rp).__name__}, not an object", file=source,
                         fix="use the config.json published with the checkpoint")
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, compress = rp["main"], rp["compress"]
    else:
        scaling = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": c["rope_theta"], "partial_rotary_factor": factor}
        compress = {**scaling, "rope_theta": c["compress_rope_theta"], "partial_rotary_factor": factor}
        compress["rope_type"] = compress.get("rope_type", compress.get("type", "default"))
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)
    return _rope(main, head_dim, c, source), _rope(compress, head_dim, c, source)


def _rope(p: dict, head_dim: int, c: dict, source: object) -> RopeSpec:
    kind = p.get("rope_type", p.get("type", "default"))
    theta = float(p["rope_theta"])
    dim = int(head_dim * float(p.get("partial_rotary_factor", 1.0)))
    if kind not in ("default", "yarn") or not theta > 0 or dim <= 0 or dim % 2 or dim > head_dim:
        raise InputError(f"unsupported rope: type {kind!r}, theta {theta}, {dim} rotated dims", file=source,
                         fix="ckpttool's DeepSeek-V4 model implements default and YaRN rope on an even part of "
                             "head_dim")
    if kind == "default":
        return RopeSpec(theta, dim)
    original = int(p.get("original_max_position_embeddings") or c["max_position_embeddings"])
    scale = float(p["factor"]) if p.get("factor") is not None else int(c["max_position_embeddings"]) / original
    attention = p.get("attention_factor")
    if attention is None:  # transformers' get_mscale, with mscale / mscale_all_dim when both are given
        attention = _mscale(scale, p.get("mscale")) / _mscale(scale, p.get("mscale_all_dim")) \
            if p.get("mscale") and p.get("mscale_all_dim") else _mscale(scale)
    return RopeSpec(theta, dim, (scale, original, float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1),
                                 float(attention)))


def _mscale(scale: float, m: object = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * float(m or 1.0) * math.log(scale) + 1.0


def _refuse_unimplemented(cfg: DeepseekV4Config, c: dict, source: object) -> None:
    problems = {
        "num_key_value_heads": (int(c["num_key_value_heads"]) == 1, "V4's attention has one shared KV head"),
        "n_shared_experts": (int(c.get("n_shared_experts") or 0) == 1, "V4 has one shared expert"),
        "scoring_func": (cfg.scoring_func in SCORING, f"transformers' DeepseekV4 scores with {' or '.join(SCORING)}"),
        "norm_topk_prob": (c["norm_topk_prob"] is True, "transformers' DeepseekV4 always normalises the top-k "
                                                        "weights, DeepSeek's model only when this is true"),
        "swiglu_limit": (cfg.swiglu_limit > 0, "transformers clamps at any limit, DeepSeek's model only above 0"),
        "hidden_act": (c["hidden_act"] == "silu", "V4's experts are SwiGLU"),
        "attention_bias": (not c["attention_bias"], "V4's projections have no biases"),
        "mlp_bias": (not c["mlp_bias"], "V4's projections have no biases"),
        "tie_word_embeddings": (not c["tie_word_embeddings"], "V4's head is its own tensor"),
        "compress_rates": (all(cfg.compress_rates.get(t, 0) > 0 for t in set(cfg.layer_types + cfg.mtp_layer_types)
                               if t != SLIDING), "each compressed layer type needs a positive rate"),
        "hc_mult": (cfg.hc_mult >= 1 and cfg.hc_sinkhorn_iters >= 1, "hyper-connections need a stream and an iteration"),
        "o_groups": (cfg.o_groups > 0 and cfg.num_attention_heads % cfg.o_groups == 0,
                     "the output groups must hold whole heads"),
        "index_head_dim": (CSA not in cfg.layer_types + cfg.mtp_layer_types or
                           cfg.index_head_dim >= cfg.compress_rope.dim,
                           f"the indexer rotates its last {cfg.compress_rope.dim} dims (the compressed layers' rope)"),
    }
    for name, (ok, why) in problems.items():
        if not ok:
            raise InputError(f"config.json's {name} = {c.get(name)!r} is not supported: {why}", file=source,
                             fix="use the config.json published with the checkpoint")
