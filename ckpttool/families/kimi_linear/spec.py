"""Kimi-Linear (kimi_linear): KDA linear-attention layers beside MLA full-attention layers (no rotary at all),
DeepSeek-V3 routing (sigmoid scores, correction bias, expert groups) over routed and shared experts, dense
layers first. Config, tensor shapes and the HF <-> mp key tables.

The mp layout cuts every attention on whole heads. A KDA layer's rank holds `linear_num_heads` / mp heads:
their q/k/v projection rows and conv channels (the checkpoint stores the three convs apart), forget-gate and
output-gate up-projections, dt_bias, A_log and beta rows; the low-rank down-projections (`f_a_proj`,
`g_a_proj`) and the per-head-dim output norm are replicated, o_proj cut on its columns. An MLA layer as
DeepSeek's: q_proj and kv_b_proj on whole heads, kv_a_proj_with_mqa and its norm replicated, o_proj on
columns. Both attentions name their projections q_proj and o_proj, so those rows cut evenly (dim 0 / 1)
and check_mp holds mp to whole heads of both kinds. Names: `tok_embeddings`, `layers.{layer}.attention_norm`,
`.attn.<the HF leaf>`, `.ffn_norm`, `.feed_forward.*` (as families/moe), `norm`, `output`.

Two spellings: the published checkpoints put dense layers under `mlp.` and MoE layers under
`block_sparse_moe.`; transformers' save_pretrained writes both under `block_sparse_moe.` (its load renames
`block_sparse_moe` to `mlp`; saving reverses that for every layer). Its config.json states `mlp_layer_types`,
which the published one (Moonshot's own config class) does not: that picks the table.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpttool.errors import InputError, PlanError
from ckpttool.families.base import config_fields
from ckpttool.families.shapes import mlp_shapes
from ckpttool.families.keymap import EXPERT, LINEAR, KeyMap

MODEL_TYPES = ("kimi_linear",)
LAYER_TYPES = ("linear_attention", "full_attention")
MLP_TYPES = ("dense", "sparse")
DEFAULTS = dict(vocab_size=163840, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024,
                num_hidden_layers=27, num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=512, q_lora_rank=None,
                qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, hidden_act="silu", rms_norm_eps=1e-5,
                tie_word_embeddings=False, attention_bias=False, routed_scaling_factor=2.446, topk_group=1,
                linear_head_dim=128, linear_num_heads=32, linear_conv_kernel_dim=4,
                num_experts=256, num_experts_per_token=8, moe_renormalize=True, num_expert_group=1, num_shared_experts=1)
"""KimiLinearConfig's class defaults of the fields read here, under the names it stores them by"""
ALIASES = {"num_experts": "num_local_experts", "num_experts_per_token": "num_experts_per_tok",
           "moe_renormalize": "norm_topk_prob", "num_expert_group": "n_group", "num_shared_experts": "n_shared_experts"}
"""the class's attribute_map, stored name -> the other name it accepts (the stored name wins where both are given)"""
LINEAR_ATTN = {"head_dim": "linear_head_dim", "num_heads": "linear_num_heads",
               "short_conv_kernel_size": "linear_conv_kernel_dim"}
"""`linear_attn_config` (the published configs' sub-dict) entries, which win over the top-level fields"""
UNSUPPORTED = {"mla_use_nope": True, "mla_use_output_gate": False, "moe_router_activation_func": "sigmoid",
               "moe_layer_freq": 1, "num_nextn_predict_layers": 0, "use_full_rank_gate": False,
               "attn_res_block_size": None, "gate_lower_bound": None}
"""fields of Moonshot's own config class (and its Kimi-K3 relatives) that transformers' model ignores: a value
other than this one describes a model it does not build (and ckpttool does not either)"""


def key_table(spelling: str) -> list[tuple]:
    """(hf template, native template, split[, LINEAR]) rows; `spelling` is "hub" or "transformers"."""
    hf, nat = "model.layers.{layer}.", "layers.{layer}."
    attn = [("q_proj.weight", 0, LINEAR), ("k_proj.weight", 0, LINEAR), ("v_proj.weight", 0, LINEAR),
            ("o_proj.weight", 1, LINEAR), ("q_conv1d.weight", 0), ("k_conv1d.weight", 0), ("v_conv1d.weight", 0),
            ("f_a_proj.weight", None), ("f_b_proj.weight", 0), ("dt_bias", 0), ("A_log", 2), ("b_proj.weight", 0),
            ("g_a_proj.weight", None), ("g_b_proj.weight", 0), ("o_norm.weight", None),
            ("kv_a_proj_with_mqa.weight", None), ("kv_a_layernorm.weight", None), ("kv_b_proj.weight", 0, LINEAR)]
    dense = "mlp." if spelling == "hub" else "block_sparse_moe."
    mlp = (("gate_proj", "w1", 0), ("up_proj", "w3", 0), ("down_proj", "w2", 1))
    moe = hf + "block_sparse_moe."
    return [("model.embed_tokens.weight", "tok_embeddings.weight", 0), ("model.norm.weight", "norm.weight", None),
            ("lm_head.weight", "output.weight", 0),
            (hf + "input_layernorm.weight", nat + "attention_norm.weight", None),
            (hf + "post_attention_layernorm.weight", nat + "ffn_norm.weight", None),
            *[(f"{hf}self_attn.{leaf}", f"{nat}attn.{leaf}", *rest) for leaf, *rest in attn],
            (moe + "gate.weight", nat + "feed_forward.gate.weight", None),
            (moe + "gate.e_score_correction_bias", nat + "feed_forward.gate.bias", None),
            *[(f"{hf}{dense}{a}.weight", f"{nat}feed_forward.{b}.weight", split, LINEAR) for a, b, split in mlp],
            *[(f"{moe}shared_experts.{a}.weight", f"{nat}feed_forward.shared_experts.{b}.weight", split, LINEAR)
              for a, b, split in mlp],
            *[(f"{moe}experts.{{expert}}.{b}.weight", f"{nat}feed_forward.experts.{{expert}}.{b}.weight", EXPERT, LINEAR)
              for b in ("w1", "w2", "w3")]]


KEY_MAPS = {s: KeyMap(key_table(s)) for s in ("hub", "transformers")}


@dataclass(kw_only=True, slots=True, frozen=True)
class KimiLinearConfig:
    """The fields of a config.json that decide tensor names, shapes and the model's numerics."""

    model_type: str
    spelling: str  # "hub" or "transformers" (module docstring)
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    norm_topk_prob: bool
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    tie_word_embeddings: bool
    rms_norm_eps: float

    @property
    def head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == "sparse"

    @classmethod
    def from_dict(cls, raw: dict, source: object = "config.json") -> "KimiLinearConfig":
        if raw.get("model_type") not in MODEL_TYPES:
            raise InputError(f"model_type {raw.get('model_type')!r} is not kimi_linear", file=source)
        _refuse_unsupported(raw, source)
        d = _fields(raw, source)
        with config_fields(source):
            layers, heads = int(d["num_hidden_layers"]), int(d["num_attention_heads"])
            first_dense = int(raw.get("first_k_dense_replace", 1))
            cfg = cls(
                model_type="kimi_linear", spelling="transformers" if "mlp_layer_types" in raw else "hub",
                vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]), num_hidden_layers=layers,
                layer_types=_listed(raw, "layer_types", LAYER_TYPES, layers, source, _layer_types(raw, layers, source)),
                mlp_layer_types=_listed(raw, "mlp_layer_types", MLP_TYPES, layers, source,
                                        ["dense" if i < first_dense else "sparse" for i in range(layers)]),
                num_attention_heads=heads, num_key_value_heads=int(d["num_key_value_heads"] or heads),
                kv_lora_rank=int(d["kv_lora_rank"]), qk_nope_head_dim=int(d["qk_nope_head_dim"]),
                qk_rope_head_dim=int(d["qk_rope_head_dim"]), v_head_dim=int(d["v_head_dim"]),
                linear_num_heads=int(d["linear_num_heads"]), linear_head_dim=int(d["linear_head_dim"]),
                linear_conv_kernel_dim=int(d["linear_conv_kernel_dim"]), intermediate_size=int(d["intermediate_size"]),
                moe_intermediate_size=int(d["moe_intermediate_size"]), num_experts=int(d["num_experts"]),
                num_experts_per_tok=int(d["num_experts_per_token"]), n_shared_experts=int(d["num_shared_experts"]),
                norm_topk_prob=bool(d["moe_renormalize"]), n_group=int(d["num_expert_group"]),
                topk_group=int(d["topk_group"]), routed_scaling_factor=float(d["routed_scaling_factor"]),
                tie_word_embeddings=bool(d["tie_word_embeddings"]), rms_norm_eps=float(d["rms_norm_eps"]))
        _check(cfg, source)
        return cfg


def _fields(raw: dict, source: object) -> dict:
    """The class's defaults, the aliased names, then config.json's own names; `linear_attn_config` last."""
    d = {**DEFAULTS, **{stored: raw[alias] for stored, alias in ALIASES.items() if alias in raw}, **raw}
    linear = raw.get("linear_attn_config") or {}
    if not isinstance(linear, dict):
        raise InputError("linear_attn_config is not an object", file=source,
                         fix="use the config.json published with the checkpoint")
    d.update({field: linear[key] for key, field in LINEAR_ATTN.items() if key in linear})
    if d["hidden_act"] != "silu":
        raise InputError(f"hidden_act {d['hidden_act']!r} is not supported", file=source,
                         fix="ckpttool's Kimi-Linear model uses SiLU (experts, conv)")
    for field in ("q_lora_rank", "attention_bias"):
        if d[field]:
            raise InputError(f"{field} = {d[field]!r}: ckpttool's Kimi-Linear model implements MLA without a query "
                             "LoRA and without attention biases (as Kimi-Linear-48B publishes it)", file=source,
                             fix="report this checkpoint")
    return d


def _refuse_unsupported(raw: dict, source: object) -> None:
    sub = raw.get("linear_attn_config") if isinstance(raw.get("linear_attn_config"), dict) else {}
    for field, expected in UNSUPPORTED.items():
        value = raw.get(field, sub.get(field, expected))
        if value != expected:
            raise InputError(f"config.json's {field} = {value!r} describes a model transformers' kimi_linear does "
                             "not build", file=source, fix="ckpttool reads Kimi-Linear as transformers 5.24 implements it")


def _layer_types(raw: dict, layers: int, source: object) -> list:
    """The class's rule: `linear_attn_config`'s 1-based full_attn_layers and kda_layers, else every fourth
    layer (from the fifth) full attention."""
    sub = raw.get("linear_attn_config") or {}
    if "full_attn_layers" in sub and "kda_layers" in sub:
        types: list = [None] * layers
        with config_fields(source):
            for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
                for layer in sub[key]:
                    if not 1 <= int(layer) <= layers:
                        raise InputError(f"linear_attn_config.{key} names layer {layer} of {layers}", file=source)
                    types[int(layer) - 1] = kind
        return types
    return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]


def _listed(raw: dict, field: str, allowed: tuple[str, ...], layers: int, source: object, default: list) -> tuple:
    given = raw.get(field)
    value = default if given is None else given
    if not isinstance(value, list) or len(value) != layers or any(v not in allowed for v in value):
        raise InputError(f"{field} must list {layers} of {', '.join(allowed)} (one per layer)", file=source,
                         fix="use the config.json published with the checkpoint")
    return tuple(value)


def _check(cfg: KimiLinearConfig, source: object) -> None:
    bad = [f"{k} = {getattr(cfg, k)}" for k in ("vocab_size", "hidden_size", "num_attention_heads", "kv_lora_rank",
                                                  "qk_nope_head_dim", "v_head_dim", "linear_num_heads",
                                                  "linear_head_dim", "linear_conv_kernel_dim") if getattr(cfg, k) <= 0]
    if cfg.num_key_value_heads != cfg.num_attention_heads:
        bad.append(f"num_key_value_heads ({cfg.num_key_value_heads}) differs from num_attention_heads "
                   "(transformers' MLA expands the latent to every head)")
    if "sparse" in cfg.mlp_layer_types and not (
            0 < cfg.num_experts_per_tok <= cfg.num_experts and cfg.n_group > 0 and cfg.num_experts % cfg.n_group == 0
            and 0 < cfg.topk_group <= cfg.n_group):
        bad.append(f"routing of {cfg.num_experts_per_tok} of {cfg.num_experts} experts in {cfg.n_group} groups "
                   f"(top {cfg.topk_group})")
    if bad:
        raise InputError(f"config.json describes no Kimi-Linear model: {'; '.join(bad)}", file=source,
                         fix="use the config.json published with the checkpoint")


def hf_tensor_shapes(cfg: KimiLinearConfig, with_mtp: bool = True) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this config holds, in its spelling."""
    h, heads, lin = cfg.hidden_size, cfg.num_attention_heads, cfg.linear_num_heads * cfg.linear_head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for layer, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        shapes[p + "input_layernorm.weight"] = shapes[p + "post_attention_layernorm.weight"] = (h,)
        if kind == "linear_attention":
            d = cfg.linear_head_dim
            shapes.update({a + "q_proj.weight": (lin, h), a + "k_proj.weight": (lin, h), a + "v_proj.weight": (lin, h),
                           a + "o_proj.weight": (h, lin), a + "f_a_proj.weight": (d, h), a + "f_b_proj.weight": (lin, d),
                           a + "g_a_proj.weight": (d, h), a + "g_b_proj.weight": (lin, d), a + "dt_bias": (lin,),
                           a + "A_log": (1, 1, cfg.linear_num_heads, 1), a + "b_proj.weight": (cfg.linear_num_heads, h),
                           a + "o_norm.weight": (d,)})
            for conv in ("q_conv1d", "k_conv1d", "v_conv1d"):
                shapes[f"{a}{conv}.weight"] = (lin, 1, cfg.linear_conv_kernel_dim)
        else:
            shapes.update({a + "q_proj.weight": (heads * cfg.head_dim, h),
                           a + "kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
                           a + "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
                           a + "kv_b_proj.weight": (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
                           a + "o_proj.weight": (h, heads * cfg.v_head_dim)})
        if not cfg.is_moe_layer(layer):
            mlp_shapes(shapes, p + ("mlp." if cfg.spelling == "hub" else "block_sparse_moe."), h, cfg.intermediate_size)
            continue
        moe = p + "block_sparse_moe."
        shapes[moe + "gate.weight"] = (cfg.num_experts, h)
        shapes[moe + "gate.e_score_correction_bias"] = (cfg.num_experts,)
        mlp_shapes(shapes, moe + "shared_experts.", h, cfg.moe_intermediate_size * cfg.n_shared_experts)
        for e in range(cfg.num_experts):
            i = cfg.moe_intermediate_size
            shapes.update({f"{moe}experts.{e}.w1.weight": (i, h), f"{moe}experts.{e}.w3.weight": (i, h),
                           f"{moe}experts.{e}.w2.weight": (h, i)})
    return shapes


def check_mp(cfg: KimiLinearConfig, mp: int) -> None:
    """Whole heads of both attentions (their q_proj and o_proj rows cut evenly), whole experts, and the
    vocabulary and the dense and shared widths divide."""
    sizes = [("num_attention_heads", cfg.num_attention_heads), ("linear_num_heads", cfg.linear_num_heads),
             ("vocab_size", cfg.vocab_size)]
    if "sparse" in cfg.mlp_layer_types:
        sizes += [("num_experts", cfg.num_experts),
                  ("the shared experts' width", cfg.moe_intermediate_size * cfg.n_shared_experts)]
    if "dense" in cfg.mlp_layer_types:
        sizes.append(("intermediate_size", cfg.intermediate_size))
    for what, size in sizes:
        if size % mp:
            raise PlanError(f"{what} ({size}) is not divisible by mp={mp}", file="config.json",
                            fix=f"choose an --mp that divides {size}")
