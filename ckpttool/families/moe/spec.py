"""Mixture-of-experts decoders with Llama-style GQA attention: Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE,
GLM-4.5/4.6 (glm4_moe), MiniMax-M2 and ERNIE-4.5-MoE. Config, tensor shapes and the HF <-> mp key tables.

One mp layout serves every model type: the dense family's names (`tok_embeddings`,
`layers.{layer}.attention.wq`, `feed_forward.w1`, `output`) plus `feed_forward.gate` (the router; its
`bias` is the `e_score_correction_bias`), `feed_forward.experts.{expert}.w1/w2/w3` (whole experts on
the rank owning a contiguous range, as DeepSeek's layout does), `feed_forward.shared_experts.w1/w2/w3`
and `feed_forward.shared_expert_gate`. The HF names differ by model type (Mixtral and MiniMax-M2 say
`block_sparse_moe.experts.E.w1`, the others `mlp.experts.E.gate_proj`), so each type has its own key
table (`Family.keys(cfg)`), with the names transformers' own modules use as aliases (`KeyMap.canonical`).

Each model type's differences are a row of data (types.py): its names, the fields it reads and their
defaults (held to the installed transformers classes by tests/test_moe.py), its numerics switches. The code
here reads every type through its row.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpttool.errors import InputError, PlanError
from ckpttool.families.base import (KV_HEADS, O_HEADS, Q_HEADS, check_gqa_heads, config_fields, layer_index,
                                    rope_theta_of, state_fields)
from ckpttool.families.shapes import attention_shapes, decoder_shapes, mlp_shapes
from ckpttool.families.keymap import EXPERT, LINEAR, KeyMap
from ckpttool.families.moe.types import MODEL_TYPES, QWEN_LEAVES, ROUTING_FIELDS, TYPES, MoeType


def explicit_config(raw: dict, source: object = "config.json") -> dict:
    """config.json with the routing and rope fields its transformers class defaults (or hard-codes) stated:
    the expert count, top-k and its normalisation, groups, scaling, scoring, the partial rotary share, rope_theta."""
    cfg = MoeConfig.from_dict(raw, source)
    t = cfg.type
    fields = {k: t.defaults[k] for k in ROUTING_FIELDS if k in t.defaults}
    if not any(k in raw for k in t.expert_count):
        fields[t.expert_count[0]] = cfg.num_experts
    fields.update(t.hard_coded_routing)
    if t.partial_rotary is not None:
        fields["partial_rotary_factor"] = cfg.partial_rotary_factor
    if t.rotary_dim:
        fields["rotary_dim"] = round(cfg.partial_rotary_factor * cfg.head_dim)
    return state_fields(raw, fields, theta=rope_theta_of(raw, t.default_theta))


def _layer_rows(f: MoeType, hf: str, nat: str, *, moe: bool) -> list[tuple]:
    """The rows of one decoder layer under the prefixes `hf` / `nat`: attention, norms, the dense MLP (Qwen's
    names under `mlp`, biases where the type has them) and, for a layer that may be MoE, the router, the routed
    experts, their correction bias and the shared expert."""
    norm_split = (Q_HEADS, KV_HEADS) if f.qk_norm == "full" else (None, None)
    rows = [
        (hf + "input_layernorm.weight", nat + "attention_norm.weight", None),
        (hf + "post_attention_layernorm.weight", nat + "ffn_norm.weight", None),
        (hf + "self_attn.o_proj.weight", nat + "attention.wo.weight", O_HEADS, LINEAR),
        (hf + "self_attn.o_proj.bias", nat + "attention.wo.bias", None),  # added once, after the all-reduce
        (hf + "self_attn.q_norm.weight", nat + "attention.q_norm.weight", norm_split[0]),
        (hf + "self_attn.k_norm.weight", nat + "attention.k_norm.weight", norm_split[1]),
    ]
    for a, b, split in (("q_proj", "wq", Q_HEADS), ("k_proj", "wk", KV_HEADS), ("v_proj", "wv", KV_HEADS)):
        rows += [(f"{hf}self_attn.{a}.weight", f"{nat}attention.{b}.weight", split, LINEAR),
                 (f"{hf}self_attn.{a}.bias", f"{nat}attention.{b}.bias", split)]
    rows += _mlp_rows(f"{hf}mlp.", f"{nat}feed_forward.")
    if not moe:
        return rows
    rows.append((hf + f.block + ".gate.weight", nat + "feed_forward.gate.weight", None))
    rows += [(f"{hf}{f.block}.experts.{{expert}}.{a}.weight", f"{nat}feed_forward.experts.{{expert}}.{b}.weight",
              EXPERT, LINEAR) for a, b in zip(f.expert_leaves, ("w1", "w3", "w2"))]
    if f.correction_bias:
        rows.append((f"{hf}{f.block}.{f.correction_bias}", nat + "feed_forward.gate.bias", None))
    if f.shared:
        rows += _mlp_rows(f"{hf}mlp.{f.shared}.", f"{nat}feed_forward.shared_experts.")
    if f.shared_gate:
        rows.append((hf + "mlp.shared_expert_gate.weight", nat + "feed_forward.shared_expert_gate.weight", None))
    return rows


def _mlp_rows(hf: str, nat: str) -> list[tuple]:
    """A tensor-parallel SwiGLU MLP: gate and up cut on their rows, down on its columns (its bias added once)."""
    rows = []
    for a, b, split in zip(QWEN_LEAVES, ("w1", "w3", "w2"), (0, 0, 1)):
        rows += [(f"{hf}{a}.weight", f"{nat}{b}.weight", split, LINEAR),
                 (f"{hf}{a}.bias", f"{nat}{b}.bias", split if split == 0 else None)]
    return rows


def key_table(model_type: str) -> list[tuple]:
    """(hf template, native template, split[, LINEAR]) rows of one model type."""
    f = TYPES[model_type]
    rows = [
        ("model.embed_tokens.weight", "tok_embeddings.weight", 0),
        ("model.norm.weight", "norm.weight", None),
        ("lm_head.weight", "output.weight", 0),
        ("lm_head.bias", "output.bias", 0),
        *_layer_rows(f, "model.layers.{layer}.", "layers.{layer}.", moe=True),
    ]
    if f.mtp is not None:
        if not f.mtp.after_main:  # MTP layers under names of their own (ERNIE); else the rows above serve
            rows += _layer_rows(f, f.mtp.layer, f.mtp.native, moe=f.mtp.moe)
        rows += [(hf, nat, 0 if shape[0] == "V" else None, *((LINEAR,) if shape == ("H", "2H") else ()))
                 for hf, nat, shape in f.mtp.extras]
    return rows


def _aliases(model_type: str) -> tuple[tuple[str, str], ...]:
    return tuple(("model.layers.{layer}." + own, "model.layers.{layer}." + published)
                 for own, published in TYPES[model_type].transformers_names)


KEY_MAPS = {t: KeyMap(key_table(t), aliases=_aliases(t)) for t in MODEL_TYPES}


@dataclass(kw_only=True, slots=True, frozen=True)
class MoeConfig:
    """The fields of a config.json that decide tensor names, shapes and the model's numerics."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP layers
    expert_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    sparse_step: int  # Qwen's decoder_sparse_step: layer i is MoE when (i + 1) % step == 0 (0: none is)
    dense_layers: frozenset[int]  # Qwen's mlp_only_layers
    first_moe_layer: int  # GLM's first_k_dense_replace, ERNIE's moe_layer_start_index
    last_moe_layer: int | None  # ERNIE's moe_layer_end_index
    shared_intermediate_size: int  # 0: no shared expert
    scoring: str  # "softmax" or "sigmoid"
    norm_topk_prob: bool
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    qk_norm: str  # "none", "head" or "full" (model/decoder.QK_NORMS)
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool  # dense and shared MLPs
    lm_head_bias: bool
    clip_qkv: float | None
    partial_rotary_factor: float
    num_nextn_predict_layers: int
    tie_word_embeddings: bool
    rms_norm_eps: float

    @property
    def type(self) -> MoeType:
        return TYPES[self.model_type]

    @property
    def has_dense_layers(self) -> bool:
        n = self.num_hidden_layers
        return n > 0 and (self.num_experts == 0 or self.first_moe_layer > 0 or self.sparse_step != 1
                          or any(i < n for i in self.dense_layers)
                          or (self.last_moe_layer is not None and self.last_moe_layer < n - 1))

    def is_moe_layer(self, layer: int) -> bool:
        """Routed experts (True) or a dense MLP, as each transformers model decides it per layer: a rule,
        not a per-layer list, so a config counting 10^12 layers costs nothing before it is refused."""
        step = self.sparse_step
        last = self.last_moe_layer
        return (self.num_experts > 0 and layer >= self.first_moe_layer and layer not in self.dense_layers
                and step > 0 and (layer + 1) % step == 0 and (last is None or layer <= last))

    @classmethod
    def from_dict(cls, raw: dict, source: object = "config.json") -> "MoeConfig":
        model_type = raw.get("model_type")
        if model_type not in TYPES:
            raise InputError(f"model_type {model_type!r} is not one of {', '.join(MODEL_TYPES)}", file=source)
        t = TYPES[model_type]
        d = {**t.defaults, **raw}
        with config_fields(source):
            heads, hidden, layers = int(d["num_attention_heads"]), int(d["hidden_size"]), int(d["num_hidden_layers"])
            if d.get("hidden_act") != "silu":
                raise InputError(f"hidden_act {d.get('hidden_act')!r} is not supported", file=source,
                                 fix="ckpttool's MoE model uses SiLU-gated experts")
            n_group, topk_group = t.groups(d)
            cfg = cls(
                model_type=model_type, vocab_size=int(d["vocab_size"]), hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]), expert_intermediate_size=int(d[t.expert_width]),
                num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                num_experts=_aliased(t.expert_count, "the expert count", raw, d, source),
                num_experts_per_tok=_aliased(t.top_k, "the experts per token", raw, d, source),
                sparse_step=t.sparse_step(d), dense_layers=t.dense_layers(d), first_moe_layer=t.first_moe_layer(d),
                last_moe_layer=t.last_moe_layer(d),
                shared_intermediate_size=t.shared_width(d), scoring=t.scoring, norm_topk_prob=t.norm_topk_prob(d),
                n_group=n_group, topk_group=topk_group, routed_scaling_factor=t.routed_scaling_factor(d),
                qk_norm=t.qk_norm if t.qk_norm_switch is None or d[t.qk_norm_switch] else "none",
                qkv_bias=t.qkv_bias(d), o_bias=t.o_bias(d), mlp_bias=t.mlp_bias(d), lm_head_bias=t.lm_head_bias(d),
                clip_qkv=t.clip_qkv(d),
                partial_rotary_factor=_partial_rotary(t, model_type, raw, d, source),
                num_nextn_predict_layers=t.mtp_layers(d),
                tie_word_embeddings=bool(d["tie_word_embeddings"]), rms_norm_eps=float(d["rms_norm_eps"]))
        _check(cfg, source)
        return cfg


def _aliased(names: tuple[str, ...], what: str, raw: dict, d: dict, source: object) -> int:
    """A count under any of the names the config class aliases (the first is its own); two that disagree are
    refused."""
    given = {k: int(raw[k]) for k in names if raw.get(k) is not None}
    if len(set(given.values())) > 1:
        raise InputError(f"config.json names {what} twice, differently: {given}", file=source,
                         fix="use the config.json published with the checkpoint")
    return next(iter(given.values())) if given else int(d[names[0]])


def _partial_rotary(t: MoeType, model_type: str, raw: dict, d: dict, source: object) -> float:
    """transformers' precedence: rope_parameters' (or rope_scaling's) partial_rotary_factor, then a top-level
    one, then the class default (MiniMax-M2: rotary_dim / head_dim). Types whose transformers model rotates
    the whole head refuse a factor other than 1."""
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    default = t.partial_rotary or 1.0
    if t.rotary_dim and d.get("rotary_dim") is not None:
        default = int(d["rotary_dim"]) / int(d.get("head_dim") or 128)
    factor = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", default))
                   if isinstance(rope, dict) else default)
    if t.partial_rotary is None and not t.rotary_dim and factor != 1.0:
        raise InputError(f"partial_rotary_factor {factor} is not used by transformers' {model_type} model", file=source,
                         fix="remove it from config.json, or report this checkpoint")
    if not 0 < factor <= 1:
        raise InputError(f"partial_rotary_factor {factor} is not in (0, 1]", file=source)
    return factor


def _check(cfg: MoeConfig, source: object) -> None:
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise InputError(f"num_attention_heads ({cfg.num_attention_heads}) is not a multiple of num_key_value_heads "
                         f"({cfg.num_key_value_heads})", file=source)
    if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
        raise InputError(f"num_experts_per_tok ({cfg.num_experts_per_tok}) is not in 1..{cfg.num_experts}", file=source)
    if cfg.n_group < 1 or cfg.num_experts % cfg.n_group or not 0 < cfg.topk_group <= cfg.n_group:
        raise InputError(f"n_group {cfg.n_group} / topk_group {cfg.topk_group} do not divide {cfg.num_experts} experts",
                         file=source)
    if cfg.type.needs_shared and cfg.shared_intermediate_size <= 0:
        raise InputError(f"{cfg.model_type} needs n_shared_experts >= 1 (transformers always builds the shared expert)",
                         file=source)


def _layer_shapes(shapes: dict, cfg: MoeConfig, p: str, *, moe: bool) -> None:
    """One decoder layer's attention and feed-forward (routed experts when `moe`, else the dense MLP)."""
    f, h, d = cfg.type, cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    attention_shapes(shapes, p, h, q, kv, qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias)
    if cfg.qk_norm != "none":
        shapes[p + "self_attn.q_norm.weight"] = (d if cfg.qk_norm == "head" else q,)
        shapes[p + "self_attn.k_norm.weight"] = (d if cfg.qk_norm == "head" else kv,)
    if not moe:
        mlp_shapes(shapes, p + "mlp.", h, cfg.intermediate_size, QWEN_LEAVES, bias=cfg.mlp_bias)
        return
    b = f"{p}{f.block}."
    shapes[b + "gate.weight"] = (cfg.num_experts, h)
    if f.correction_bias:
        shapes[b + f.correction_bias] = (1, cfg.num_experts) if f.correction_bias_rows else (cfg.num_experts,)
    for e in range(cfg.num_experts):
        mlp_shapes(shapes, f"{b}experts.{e}.", h, cfg.expert_intermediate_size, f.expert_leaves)
    if f.shared:
        mlp_shapes(shapes, f"{p}mlp.{f.shared}.", h, cfg.shared_intermediate_size, QWEN_LEAVES, bias=cfg.mlp_bias)
    if f.shared_gate:
        shapes[p + "mlp.shared_expert_gate.weight"] = (1, h)


def hf_tensor_shapes(cfg: MoeConfig, *, with_mtp: bool = True) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this config holds (weights and biases, no FP8 scales)."""
    n, h, mtp = cfg.num_hidden_layers, cfg.hidden_size, cfg.type.mtp
    shapes, prefixes = decoder_shapes(cfg.vocab_size, h, n, tie_word_embeddings=cfg.tie_word_embeddings)
    if cfg.lm_head_bias:
        shapes["lm_head.bias"] = (cfg.vocab_size,)
    for layer, p in enumerate(prefixes):
        _layer_shapes(shapes, cfg, p, moe=cfg.is_moe_layer(layer))
    units = {"H": h, "2H": 2 * h, "V": cfg.vocab_size}
    for i in range(cfg.num_nextn_predict_layers if with_mtp and mtp is not None else 0):
        names = dict(layer=n + i, mtp=i)
        p = mtp.layer.format(**names)
        shapes[p + "input_layernorm.weight"] = shapes[p + "post_attention_layernorm.weight"] = (h,)
        _layer_shapes(shapes, cfg, p, moe=mtp.moe)
        shapes.update({hf.format(**names): tuple(units[u] for u in shape) for hf, _, shape in mtp.extras})
    return shapes


def is_mtp_tensor(cfg: MoeConfig, hf_name: str) -> bool:
    mtp = cfg.type.mtp
    if mtp is None:
        return False
    if mtp.after_main:
        layer = layer_index(hf_name)
        return layer is not None and layer >= cfg.num_hidden_layers
    return any(hf_name.startswith(t.split("{")[0]) for t in (mtp.layer, *(hf for hf, _, _ in mtp.extras)))


def check_mp(cfg: MoeConfig, mp: int) -> None:
    """Query heads split evenly, KV heads split or replicate (not when a norm spans all KV heads), and
    experts, the vocabulary and the dense and shared MLP widths divide."""
    check_gqa_heads(cfg, mp)
    if cfg.qk_norm == "full" and cfg.num_key_value_heads % mp:
        raise PlanError(f"{cfg.model_type}'s k norm spans all {cfg.num_key_value_heads} KV heads, which mp={mp} would "
                        "replicate", file="config.json", fix="choose an --mp that divides num_key_value_heads")
    sizes = [("num_experts", cfg.num_experts), ("vocab_size", cfg.vocab_size)]
    if cfg.has_dense_layers or (cfg.num_nextn_predict_layers and cfg.type.mtp is not None and not cfg.type.mtp.moe):
        sizes.append(("intermediate_size", cfg.intermediate_size))
    if cfg.shared_intermediate_size:
        sizes.append(("shared expert width", cfg.shared_intermediate_size))
    for what, size in sizes:
        if size % mp:
            raise PlanError(f"{what} ({size}) is not divisible by mp={mp}", file="config.json",
                            fix=f"choose an --mp that divides {size}")
