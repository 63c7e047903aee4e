"""The MLA family (DeepSeek V2 / V3 / V3.2, Kimi-K2, GLM-5, Mistral 4, Mistral Large 4): config, tensor shapes
and the HF <-> reference-mp key table. Each model type's differences are a row of types.py, read here by one
code path.

The key table carries rename and shard together, exactly as the reference convert.py does:
`(hf template, native template, split)` where split is a dim to cut for tensor parallelism,
`EXPERT` for routed experts (whole tensors, distributed by contiguous expert range) or None
(replicated). `{layer}` and `{expert}` are the only placeholders.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ckpttool.errors import InputError, PlanError
from ckpttool.families.base import config_fields, layer_index, rope_theta_of, state_fields
from ckpttool.families.shapes import decoder_shapes, mlp_shapes, mtp_shapes
from ckpttool.families.deepseek.types import MODEL_TYPES, ROUTING_FIELDS, TYPES, MlaType
from ckpttool.families.keymap import EXPERT, LINEAR, KeyMap

CONFIG_DEFAULTS: dict[str, dict] = {t: row.defaults for t, row in TYPES.items()}
"""What each transformers config class holds for a field config.json leaves out, by model_type (types.py)."""
DEFAULT_ROPE_THETA = 10000.0  # every MLA config class's


def with_defaults(raw: dict) -> dict:
    """config.json's fields over transformers' defaults for its model_type (an explicit null stays null)."""
    return {**CONFIG_DEFAULTS.get(raw.get("model_type"), {}), **raw}


def explicit_config(raw: dict, source: object = "config.json") -> dict:
    """config.json with the routing fields and rope_theta its model type defaults to (or hard-codes) stated."""
    DeepseekConfig.from_dict(raw, source)  # refuse what the planner would refuse, with its message
    row = TYPES[raw["model_type"]]
    defaults = {**row.defaults, **row.hard_coded}
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
    # attention_bias: the replicated projections' biases, and o_proj's, added once after the all-reduce
    ("self_attn.q_a_proj.bias", "attn.wq_a.bias", None),
    ("self_attn.kv_a_proj_with_mqa.bias", "attn.wkv_a.bias", None),
    ("self_attn.o_proj.bias", "attn.wo.bias", None),
    # the DSA indexer (DeepSeek-V3.2, GLM-5): replicated on every rank (its wq_b is not MLA's wq_b, which is split)
    ("self_attn.indexer.wq_b.weight", "attn.indexer.wq_b.weight", None, LINEAR),
    ("self_attn.indexer.wk.weight", "attn.indexer.wk.weight", None, LINEAR),
    ("self_attn.indexer.k_norm.weight", "attn.indexer.k_norm.weight", None),
    ("self_attn.indexer.k_norm.bias", "attn.indexer.k_norm.bias", None),
    ("self_attn.indexer.weights_proj.weight", "attn.indexer.weights_proj.weight", None),
    # Mistral Large 4: per-head query scaling, cut with the heads; its indexer's query norm and scaling, replicated
    ("self_attn.softmax_scaling.scale", "attn.softmax_scaling.scale", 0),
    ("self_attn.softmax_scaling.bias", "attn.softmax_scaling.bias", 0),
    ("self_attn.indexer.q_input_norm.weight", "attn.indexer.q_norm.weight", None),
    ("self_attn.indexer.q_input_norm.bias", "attn.indexer.q_norm.bias", None),
    ("self_attn.indexer.softmax_scaling.scale", "attn.indexer.softmax_scaling.scale", None),
    ("self_attn.indexer.softmax_scaling.bias", "attn.indexer.softmax_scaling.bias", None),
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
    ("model.rotary_emb.alpha", "rope_alpha", None),  # Mistral Large 4's learned rotary frequencies (LeRoPE)
    *_layer_rows(),
]
"""Weights only; each `*.weight` row implies its FP8 scale row (`*.weight_scale_inv` -> `*.scale`)."""
KEY_MAP = KeyMap(KEY_TABLE)


@dataclass(kw_only=True, slots=True, frozen=True)
class DeepseekConfig:
    """The fields of an MLA config.json that decide tensor names, shapes and routing, read through the
    model type's row (types.py)."""

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
    attention_bias: bool = False  # q_a_proj, kv_a_proj_with_mqa and o_proj carry biases
    index_n_heads: int = 0  # the DSA indexer (DeepSeek-V3.2, GLM-5); 0: none
    index_head_dim: int = 0
    mlp_layer_types: tuple[str, ...] | None = None  # "dense" / "sparse" per layer, when given
    indexer_types: tuple[bool, ...] | None = None  # GLM-5: whether each layer runs its own indexer, when listed
    index_topk_freq: int = 1  # else: layer i runs one where max(i - offset + 1, 0) % freq == 0
    index_skip_topk_offset: int = 2
    rope_layers: tuple[bool, ...] | None = None  # Mistral Large 4: whether each layer rotates (no_rope_layers)
    kv_sources: tuple[int, ...] | None = None  # Mistral Large 4: the layer whose latent KV each layer attends to

    @property
    def type(self) -> MlaType:
        return TYPES[self.model_type]

    @classmethod
    def from_dict(cls, raw: dict, source: object = "config.json") -> "DeepseekConfig":
        model_type = raw.get("model_type")
        if model_type not in TYPES:
            raise InputError(f"model_type {model_type!r} is not one of {', '.join(MODEL_TYPES)}", file=source)
        t = TYPES[model_type]
        d = with_defaults(raw)
        with config_fields(source):
            layers = int(d["num_hidden_layers"])
            indexer = t.indexer and int(d["index_n_heads"]) > 0
            cfg = cls(
                model_type=model_type,
                vocab_size=int(d["vocab_size"]),
                hidden_size=int(d["hidden_size"]),
                intermediate_size=int(d["intermediate_size"]),
                moe_intermediate_size=int(d["moe_intermediate_size"]),
                num_hidden_layers=layers,
                num_attention_heads=int(d["num_attention_heads"]),
                n_routed_experts=int(d["n_routed_experts"]),
                n_shared_experts=int(d.get("n_shared_experts") or 0),
                num_experts_per_tok=int(d["num_experts_per_tok"]),
                first_k_dense_replace=int(d.get("first_k_dense_replace") or 0),
                moe_layer_freq=int(d.get("moe_layer_freq", 1)) if t.moe_layer_freq else 1,
                q_lora_rank=int(d["q_lora_rank"]) if d.get("q_lora_rank") else None,
                kv_lora_rank=int(d["kv_lora_rank"]),
                qk_nope_head_dim=int(d["qk_nope_head_dim"]),
                qk_rope_head_dim=int(d["qk_rope_head_dim"]),
                v_head_dim=int(d["v_head_dim"]),
                num_nextn_predict_layers=int(d.get("num_nextn_predict_layers") or 0),
                has_correction_bias=t.correction_bias,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias") or False),
                index_n_heads=int(d["index_n_heads"]) if indexer else 0,
                index_head_dim=int(d["index_head_dim"]) if indexer else 0,
                mlp_layer_types=_per_layer(d, "mlp_layer_types", ("dense", "sparse"), layers, source)
                if t.mlp_layer_types else None,
                **(_indexer_schedule(d, layers, source) if indexer and t.shared_indexers else {}),
                rope_layers=_rope_layers(d, layers, source) if t.nope_layers else None,
                kv_sources=_kv_sources(d, layers, source) if t.kv_sharing else None,
            )
            if not t.q_lora:  # the class has no query LoRA, whatever config.json says
                cfg = replace(cfg, q_lora_rank=None)
            if t.kv_sharing and int(d.get("num_key_value_heads", cfg.num_attention_heads)) != cfg.num_attention_heads:
                raise InputError(f"num_key_value_heads ({d['num_key_value_heads']}) is not num_attention_heads "
                                 f"({cfg.num_attention_heads})", file=source,
                                 fix="transformers' model expands the latent KV to every head; use the config.json "
                                     "published with the checkpoint")
        if t.needs_q_lora and not cfg.q_lora_rank:
            raise InputError(f"{model_type} without q_lora_rank is not supported", file=source,
                             fix=f"transformers' {model_type} model always projects queries through q_lora_rank; "
                                 "use the config.json published with the checkpoint")
        if cfg.n_routed_experts and not 0 < cfg.num_experts_per_tok <= cfg.n_routed_experts:
            raise InputError(f"num_experts_per_tok ({cfg.num_experts_per_tok}) is not in 1..{cfg.n_routed_experts} "
                             "(n_routed_experts)", file=source, fix="use the config.json published with the checkpoint")
        check_kv_sharing(cfg, source)
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

    def rotates(self, layer: int) -> bool:
        """Whether a layer applies RoPE (Mistral Large 4's NoPE layers do not)."""
        return self.rope_layers is None or layer >= len(self.rope_layers) or self.rope_layers[layer]

    def kv_source(self, layer: int) -> int:
        """The layer whose latent KV this one attends to (itself, but where Mistral Large 4 shares it)."""
        return layer if self.kv_sources is None or layer >= len(self.kv_sources) else self.kv_sources[layer]

    def has_indexer(self, layer: int) -> bool:
        """Whether a layer runs (and holds) its own indexer: every layer of a type with one, but GLM-5's
        "shared" layers, which reuse the previous full layer's top-k. MTP layers run their own."""
        if not self.index_n_heads:
            return False
        if self.indexer_types is not None:
            return layer >= len(self.indexer_types) or self.indexer_types[layer]
        return layer >= self.num_hidden_layers or \
            max(layer - self.index_skip_topk_offset + 1, 0) % self.index_topk_freq == 0


def _per_layer(d: dict, key: str, values: tuple[str, ...], layers: int, source: object) -> tuple[str, ...] | None:
    """A per-layer list field (`mlp_layer_types`), when given: one of `values` for each layer."""
    types = d.get(key)
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != layers or set(types) - set(values):
        raise InputError(f"{key} {types!r} is not one of {' / '.join(map(repr, values))} per layer", file=source,
                         fix="use the config.json published with the checkpoint")
    return tuple(types)


def _indexer_schedule(d: dict, layers: int, source: object) -> dict:
    """GlmMoeDsaConfig's per-layer indexer mode: `indexer_types`, else `index_topk_pattern` ("F"/"S" per layer,
    or a list), else the rule of `index_topk_freq` and `index_skip_topk_offset` (kept as a rule, not a list)."""
    types = d.get("indexer_types")
    if types is None and isinstance(pattern := d.get("index_topk_pattern"), str):
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
    elif types is None and pattern is not None:
        types = pattern
    if types is not None:
        listed = _per_layer({"indexer_types": types}, "indexer_types", ("full", "shared"), layers, source)
        if listed and listed[0] != "full":
            raise InputError("indexer_types starts with a 'shared' layer, which has no earlier top-k to reuse",
                             file=source, fix="use the config.json published with the checkpoint")
        return {"indexer_types": tuple(t == "full" for t in listed)}
    freq = max(int(d.get("index_topk_freq", 1)), 1)
    return {"index_topk_freq": freq, "index_skip_topk_offset": int(d.get("index_skip_topk_offset", 2))}


def _rope_layers(d: dict, layers: int, source: object) -> tuple[bool, ...]:
    """MistralLarge4TextConfig's `no_rope_layers` (1: RoPE, 0: NoPE, at least one per layer), else its rule: every
    `no_rope_layer_interval`-th layer (4) is NoPE."""
    listed = d.get("no_rope_layers")
    if listed is None:
        interval = int(d.get("no_rope_layer_interval", 4))
        return tuple((i + 1) % interval != 0 for i in range(layers))
    if not isinstance(listed, list) or len(listed) < layers or any(v not in (0, 1) for v in listed):
        raise InputError(f"no_rope_layers {listed!r} is not a 1 (RoPE) or 0 (NoPE) for each of the {layers} layers",
                         file=source, fix="use the config.json published with the checkpoint")
    return tuple(bool(v) for v in listed[:layers])


def _kv_sources(d: dict, layers: int, source: object) -> tuple[int, ...]:
    """`kv_source_layers` as MistralLarge4TextConfig validates it: one entry per layer, each the layer itself or
    an earlier layer that is its own source."""
    listed = d.get("kv_source_layers")
    if listed is None:
        return tuple(range(layers))
    if not isinstance(listed, list) or len(listed) != layers or \
            any(not isinstance(s, int) or not 0 <= s <= i or listed[s] != s for i, s in enumerate(listed)):
        raise InputError(f"kv_source_layers {listed!r} is not, for each of the {layers} layers, the layer itself or "
                         "an earlier layer that owns its latent KV", file=source,
                         fix="use the config.json published with the checkpoint")
    return tuple(listed)


def check_kv_sharing(cfg: "DeepseekConfig", source: object) -> None:
    """transformers' model hands a sharing layer the latent last stored by a layer of its own kind (RoPE or NoPE),
    not the one kv_source_layers names: a config where the two differ is refused rather than read either way."""
    stores = {s for i, s in enumerate(cfg.kv_sources or ()) if s != i}
    for layer, src in enumerate(cfg.kv_sources or ()):
        if src == layer:
            continue
        same_kind = [j for j in sorted(stores) if j < layer and cfg.rotates(j) == cfg.rotates(layer)]
        if not same_kind or same_kind[-1] != src:
            raise InputError(f"kv_source_layers names layer {src} for layer {layer}, but transformers' model gives "
                             f"layer {layer} the latent KV of the last earlier sharing layer that "
                             f"{'rotates' if cfg.rotates(layer) else 'does not rotate'} "
                             f"({same_kind[-1] if same_kind else 'none'})", file=source,
                             fix="use the config.json published with the checkpoint")


def hf_tensor_shapes(cfg: DeepseekConfig, *, with_mtp: bool = True) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this config holds (weights and biases only, no FP8 scales)."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    qk_head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    n_layers = cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if with_mtp else 0)
    shapes, prefixes = decoder_shapes(cfg.vocab_size, h, n_layers, tie_word_embeddings=cfg.tie_word_embeddings)
    if cfg.type.lerope:
        shapes["model.rotary_emb.alpha"] = (cfg.qk_rope_head_dim // 2,)
    for layer, p in enumerate(prefixes):
        a = p + "self_attn."
        if cfg.q_lora_rank:
            shapes[a + "q_a_proj.weight"] = (cfg.q_lora_rank, h)
            shapes[a + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
            shapes[a + "q_b_proj.weight"] = (heads * qk_head, cfg.q_lora_rank)
        else:
            shapes[a + "q_proj.weight"] = (heads * qk_head, h)
        rope = cfg.qk_rope_head_dim if cfg.rotates(layer) else 0  # a NoPE layer's nope part is the whole qk head
        own_kv = cfg.kv_source(layer) == layer
        if own_kv:
            shapes[a + "kv_a_proj_with_mqa.weight"] = (cfg.kv_lora_rank + rope, h)
            shapes[a + "kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
        shapes[a + "kv_b_proj.weight"] = (heads * (qk_head - rope + cfg.v_head_dim), cfg.kv_lora_rank)
        shapes[a + "o_proj.weight"] = (h, heads * cfg.v_head_dim)
        if cfg.attention_bias:  # transformers' MLA: on q_a_proj (with q_lora_rank), kv_a_proj_with_mqa, o_proj
            if cfg.q_lora_rank:
                shapes[a + "q_a_proj.bias"] = (cfg.q_lora_rank,)
            if own_kv:
                shapes[a + "kv_a_proj_with_mqa.bias"] = (cfg.kv_lora_rank + rope,)
            shapes[a + "o_proj.bias"] = (h,)
        scaling = cfg.type.softmax_scaling and not cfg.is_mtp_layer(layer)
        if scaling:
            shapes[a + "softmax_scaling.scale"] = shapes[a + "softmax_scaling.bias"] = (heads,)
        if cfg.has_indexer(layer):
            d = cfg.index_head_dim
            shapes[a + "indexer.wq_b.weight"] = (cfg.index_n_heads * d, h if scaling else cfg.q_lora_rank)
            shapes[a + "indexer.wk.weight"] = (d, h)
            shapes[a + "indexer.k_norm.weight"] = (d,)
            shapes[a + "indexer.k_norm.bias"] = (d,)
            shapes[a + "indexer.weights_proj.weight"] = (cfg.index_n_heads, h)
            if scaling:  # Mistral Large 4's indexer: queries from the normalised hidden states, scaled per head
                shapes[a + "indexer.q_input_norm.weight"] = shapes[a + "indexer.q_input_norm.bias"] = (h,)
                shapes[a + "indexer.softmax_scaling.scale"] = (cfg.index_n_heads,)
                shapes[a + "indexer.softmax_scaling.bias"] = (cfg.index_n_heads,)
        if cfg.is_moe_layer(layer) or cfg.is_mtp_layer(layer):
            inter = cfg.moe_intermediate_size
            shapes[p + "mlp.gate.weight"] = (cfg.n_routed_experts, h)
            if cfg.has_correction_bias:
                shapes[p + "mlp.gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
            for e in range(cfg.n_routed_experts):
                mlp_shapes(shapes, f"{p}mlp.experts.{e}.", h, inter)
            if cfg.n_shared_experts:
                mlp_shapes(shapes, p + "mlp.shared_experts.", h, inter * cfg.n_shared_experts)
        else:
            mlp_shapes(shapes, p + "mlp.", h, cfg.intermediate_size)
        if cfg.is_mtp_layer(layer):
            mtp_shapes(shapes, p, cfg.vocab_size, h)
    return shapes


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
