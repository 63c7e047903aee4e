"""LongCat-Flash (longcat_flash): each decoder layer holds two MLA attention sublayers (a query LoRA, and LoRA
scaling: the query and the normed latent multiplied by sqrt(hidden / rank)), two dense MLPs, and a shortcut MoE
fed by the first sublayer's post-attention norm and added after the second. Its router scores routed experts
and zero experts (identity: the token itself, weighted) with one softmax, picks with a correction bias, and
scales the unnormalised weights. Config, tensor shapes and the HF <-> mp key tables.

Zero experts are counted as experts: the router's width and the expert ranges each rank owns are
`n_routed_experts + zero_expert_num` (zero experts last), so check_mp holds mp to whole ranges of that total, and
the rank owning a zero expert adds its identity term. They hold no weights in the published checkpoints (the hub
spelling); transformers 5.24's save_pretrained writes a gate and an up projection for each of them (its stacked
`gate_up_proj` has a block per expert, zero experts included; no computation reads them): that spelling carries
them to their owning rank under the routed experts' names, so merge writes them back byte for byte. The tensor
names tell the two apart (`spelled`); config.json does not. transformers' own stacked form
(save_original_format=False) is read as its per-expert spelling (`stacked_experts`); merge writes that.

Names: `layers.{layer}.attn.{sub}.<the HF leaf>`, `.attention_norm.{sub}`, `.ffn_norm.{sub}`, `.mlps.{sub}.w1/w2/w3`,
`.moe.gate` (router), `.moe.gate.bias` (correction bias), `.moe.experts.{expert}.w1/w2/w3`; `tok_embeddings`,
`norm`, `output`. q_b_proj and kv_b_proj are cut on whole heads (rows), o_proj on its columns, the low-rank
down-projections and their norms replicated.

MTP: the published checkpoints' MTP layer (`model.mtp.*`: an embedding, `eh_proj`, `enorm`/`hnorm`, one MLA
attention and one dense MLP under `transformer_layer.mlp`, a final norm) is what vLLM and SGLang load for
speculative decoding; transformers ignores it. It is handled as every family here handles MTP layers: kept in HF
outputs, dropped from mp shards unless --keep-mtp, and then cut like a decoder layer under `mtp.` names
(`mtp.embed_tokens`, `mtp.norm`, `mtp.layers.0.{eh_proj,enorm,hnorm,attention_norm,ffn_norm}`,
`mtp.layers.0.attn.<leaf>`, `mtp.layers.0.mlp.w1/w2/w3`), so merge gives it back byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ckpttool.errors import InputError, PlanError
from ckpttool.families.base import config_fields, read_rope
from ckpttool.families.shapes import mlp_shapes
from ckpttool.families.keymap import EXPERT, LINEAR, KeyMap

MODEL_TYPES = ("longcat_flash",)
MTP_PREFIX, MTP_NATIVE = "model.mtp.", "mtp."
MTP_LAYERS = 1
"""the MTP layers the published checkpoints hold (`model.mtp.layers.0.*`); vLLM's and SGLang's LongCat MTP models
build exactly one, whatever config.json says, and transformers' config has no field for them"""
DEFAULT_THETA = 10000000.0
DEFAULTS = dict(vocab_size=131072, hidden_size=6144, num_layers=28, num_attention_heads=64, num_key_value_heads=None,
                hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
                ffn_hidden_size=12288, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                head_dim=64, v_head_dim=128, qk_head_dim=None, moe_topk=12, n_routed_experts=512, zero_expert_num=256,
                expert_ffn_hidden_size=2048, routed_scaling_factor=6.0)
"""LongcatFlashConfig's class defaults of the fields read here, under the names it stores them by"""
ALIASES = {"n_routed_experts": "num_local_experts", "moe_topk": "num_experts_per_tok",
           "ffn_hidden_size": "intermediate_size", "expert_ffn_hidden_size": "moe_intermediate_size"}
"""the class's attribute_map, stored name -> the other name it accepts (that one wins where both are given)"""
UNSUPPORTED = {"router_bias": False, "mla_scale_q_lora": True, "mla_scale_kv_lora": True,
               "zero_expert_type": "identity", "hidden_act": "silu"}
"""fields whose other values describe a model transformers 5.24's longcat_flash does not build as stated (it
ignores a router bias, always applies both LoRA scalings and identity zero experts) or ckpttool's model does not
implement"""


def key_table() -> list[tuple]:
    """(hf template, native template, split[, LINEAR]) rows, for both spellings: they name every tensor alike
    (transformers' merely holds more experts' gate and up projections)."""
    hf, nat = "model.layers.{layer}.", "layers.{layer}."
    attn = [("q_a_proj.weight", None, LINEAR), ("q_a_layernorm.weight", None), ("q_b_proj.weight", 0, LINEAR),
            ("kv_a_proj_with_mqa.weight", None, LINEAR), ("kv_a_layernorm.weight", None),
            ("kv_b_proj.weight", 0, LINEAR), ("o_proj.weight", 1, LINEAR),
            # attention_bias: the replicated down-projections' biases, and o_proj's (added once, after the sum)
            ("q_a_proj.bias", None), ("kv_a_proj_with_mqa.bias", None), ("o_proj.bias", None)]
    mlp = (("gate_proj", "w1", 0), ("up_proj", "w3", 0), ("down_proj", "w2", 1))
    return [("model.embed_tokens.weight", "tok_embeddings.weight", 0), ("model.norm.weight", "norm.weight", None),
            ("lm_head.weight", "output.weight", 0),
            (hf + "input_layernorm.{sub}.weight", nat + "attention_norm.{sub}.weight", None),
            (hf + "post_attention_layernorm.{sub}.weight", nat + "ffn_norm.{sub}.weight", None),
            *[(f"{hf}self_attn.{{sub}}.{leaf}", f"{nat}attn.{{sub}}.{leaf}", *rest) for leaf, *rest in attn],
            *[(f"{hf}mlps.{{sub}}.{a}.weight", f"{nat}mlps.{{sub}}.{b}.weight", split, LINEAR) for a, b, split in mlp],
            (hf + "mlp.router.classifier.weight", nat + "moe.gate.weight", None),
            (hf + "mlp.router.e_score_correction_bias", nat + "moe.gate.bias", None),
            *[(f"{hf}mlp.experts.{{expert}}.{a}.weight", f"{nat}moe.experts.{{expert}}.{b}.weight", EXPERT, LINEAR)
              for a, b, _ in mlp],
            *_mtp_rows(attn, mlp)]


def _mtp_rows(attn: list[tuple], mlp: tuple) -> list[tuple]:
    """The published checkpoints' MTP layer, named as vLLM's and SGLang's LongCat MTP models load it; cut as the
    decoder's tensors are (one MLA attention, one dense MLP), its embedding on the vocabulary, the rest replicated."""
    hf, nat = MTP_PREFIX + "layers.{layer}.", MTP_NATIVE + "layers.{layer}."
    return [(MTP_PREFIX + "embed_tokens.weight", MTP_NATIVE + "embed_tokens.weight", 0),
            (MTP_PREFIX + "norm.weight", MTP_NATIVE + "norm.weight", None),
            (hf + "eh_proj.weight", nat + "eh_proj.weight", None, LINEAR),
            (hf + "enorm.m.weight", nat + "enorm.weight", None), (hf + "hnorm.m.weight", nat + "hnorm.weight", None),
            (hf + "input_layernorm.weight", nat + "attention_norm.weight", None),
            (hf + "post_attention_layernorm.weight", nat + "ffn_norm.weight", None),
            *[(f"{hf}self_attn.{leaf}", f"{nat}attn.{leaf}", *rest) for leaf, *rest in attn],
            *[(f"{hf}transformer_layer.mlp.{a}.weight", f"{nat}mlp.{b}.weight", split, LINEAR) for a, b, split in mlp]]


KEY_MAP = KeyMap(key_table())


@dataclass(kw_only=True, slots=True, frozen=True)
class LongcatFlashConfig:
    """The fields of a config.json that decide tensor names, shapes and the model's numerics."""

    model_type: str
    spelling: str  # "hub" or "transformers" (module docstring); bound from the tensor names by `spelled`
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int  # the decoder layers in the file (transformers' num_layers; its num_hidden_layers is twice)
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    ffn_hidden_size: int
    expert_ffn_hidden_size: int
    n_routed_experts: int
    zero_expert_num: int
    moe_topk: int
    routed_scaling_factor: float
    rope_theta: float
    tie_word_embeddings: bool
    rms_norm_eps: float
    attention_bias: bool  # biases on q_a_proj, kv_a_proj_with_mqa and o_proj (transformers' LongcatFlashMLA)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_experts(self) -> int:
        """Routed and zero experts: the router's width and what ranks own ranges of."""
        return self.n_routed_experts + self.zero_expert_num

    @classmethod
    def from_dict(cls, raw: dict, source: object = "config.json") -> "LongcatFlashConfig":
        if raw.get("model_type") not in MODEL_TYPES:
            raise InputError(f"model_type {raw.get('model_type')!r} is not longcat_flash", file=source)
        for field, expected in UNSUPPORTED.items():
            if raw.get(field, expected) != expected:
                raise InputError(f"config.json's {field} = {raw[field]!r} is not supported", file=source,
                                 fix=f"ckpttool's LongCat-Flash model reads {field} = {expected!r}, as the "
                                     "published LongCat-Flash checkpoints state it")
        d = {**DEFAULTS, **raw, **{stored: raw[alias] for stored, alias in ALIASES.items() if alias in raw}}
        rope = read_rope(raw, source, default_theta=DEFAULT_THETA, types=("default",))
        with config_fields(source):
            heads = int(d["num_attention_heads"])
            # the class's num_hidden_layers setter (two sublayers a layer) wins over num_layers
            layers = int(raw["num_hidden_layers"]) // 2 if "num_hidden_layers" in raw else int(d["num_layers"])
            cfg = cls(model_type="longcat_flash", spelling="hub", vocab_size=int(d["vocab_size"]),
                      hidden_size=int(d["hidden_size"]), num_hidden_layers=layers, num_attention_heads=heads,
                      q_lora_rank=int(d["q_lora_rank"]), kv_lora_rank=int(d["kv_lora_rank"]),
                      qk_nope_head_dim=int(d["qk_nope_head_dim"]), qk_rope_head_dim=int(d["qk_rope_head_dim"]),
                      v_head_dim=int(d["v_head_dim"]), ffn_hidden_size=int(d["ffn_hidden_size"]),
                      expert_ffn_hidden_size=int(d["expert_ffn_hidden_size"]),
                      n_routed_experts=int(d["n_routed_experts"]), zero_expert_num=int(d["zero_expert_num"]),
                      moe_topk=int(d["moe_topk"]), routed_scaling_factor=float(d["routed_scaling_factor"]),
                      rope_theta=rope.theta, tie_word_embeddings=bool(d["tie_word_embeddings"]),
                      rms_norm_eps=float(d["rms_norm_eps"]), attention_bias=_flag(d, "attention_bias", source))
            kv_heads = heads if d["num_key_value_heads"] is None else int(d["num_key_value_heads"])
            qk_head_dim = cfg.qk_head_dim if d["qk_head_dim"] is None else int(d["qk_head_dim"])
            head_dim = int(d["head_dim"])
        bad = [f"{k} = {getattr(cfg, k)}" for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                      "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                                                      "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                                      "n_routed_experts") if getattr(cfg, k) <= 0]
        if kv_heads != heads:
            bad.append(f"num_key_value_heads ({kv_heads}) differs from num_attention_heads (transformers' MLA "
                       "expands the latent to every head)")
        if qk_head_dim != cfg.qk_head_dim:
            bad.append(f"qk_head_dim ({qk_head_dim}) is not qk_nope_head_dim + qk_rope_head_dim ({cfg.qk_head_dim})")
        if head_dim != cfg.qk_rope_head_dim:  # transformers' rotary embedding takes its width from head_dim
            bad.append(f"head_dim ({head_dim}, the rotary width) differs from qk_rope_head_dim ({cfg.qk_rope_head_dim})")
        if not 0 < cfg.moe_topk <= cfg.num_experts or cfg.zero_expert_num < 0:
            bad.append(f"routing of {cfg.moe_topk} of {cfg.n_routed_experts} + {cfg.zero_expert_num} experts")
        if bad:
            raise InputError(f"config.json describes no LongCat-Flash model: {'; '.join(bad)}", file=source,
                             fix="use the config.json published with the checkpoint")
        return cfg


def _flag(d: dict, field: str, source: object) -> bool:
    if not isinstance(d[field], bool):
        raise InputError(f"config.json's {field} = {d[field]!r} is not true or false", file=source,
                         fix="use the config.json published with the checkpoint")
    return d[field]


def spelled(cfg: LongcatFlashConfig, names) -> LongcatFlashConfig:
    """The spelling the tensor names use: transformers' save_pretrained holds the first zero expert's gate
    projection (HF names: a checkpoint; mp names: shards), or, in its own stacked form, `gate_up_proj` with a
    slot for every zero expert (`stacked_experts`)."""
    if not cfg.zero_expert_num:
        return cfg
    e = cfg.n_routed_experts
    names = set(names)
    saved = {f"model.layers.0.mlp.experts.{e}.gate_proj.weight", f"layers.0.moe.experts.{e}.w1.weight",
             "model.layers.0.mlp.experts.gate_up_proj"} & names
    return replace(cfg, spelling="transformers" if saved else "hub")


def stacked_experts(cfg: LongcatFlashConfig) -> dict[str, int]:
    """transformers' own form (save_original_format=False, as LongcatFlashExperts holds them): `gate_up_proj`
    [routed + zero, 2I, H], a gate/up slot for every zero expert too, beside `down_proj` [routed, H, I]; read
    one by one as the transformers spelling's per-expert tensors (families.base.unstack_experts)."""
    return {"gate_up_proj": cfg.num_experts, "down_proj": cfg.n_routed_experts}


def hf_tensor_shapes(cfg: LongcatFlashConfig, with_mtp: bool = True) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this config holds, in its spelling."""
    h, i = cfg.hidden_size, cfg.expert_ffn_hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        for sub in (0, 1):
            shapes.update({f"{p}input_layernorm.{sub}.weight": (h,), f"{p}post_attention_layernorm.{sub}.weight": (h,)})
            _attention_shapes(shapes, f"{p}self_attn.{sub}.", cfg)
            mlp_shapes(shapes, f"{p}mlps.{sub}.", h, cfg.ffn_hidden_size)
        shapes[p + "mlp.router.classifier.weight"] = (cfg.num_experts, h)
        shapes[p + "mlp.router.e_score_correction_bias"] = (cfg.num_experts,)
        held = cfg.num_experts if cfg.spelling == "transformers" else cfg.n_routed_experts
        for e in range(held):
            x = f"{p}mlp.experts.{e}."
            shapes.update({x + "gate_proj.weight": (i, h), x + "up_proj.weight": (i, h)})
            if e < cfg.n_routed_experts:
                shapes[x + "down_proj.weight"] = (h, i)
    if with_mtp:
        shapes.update({MTP_PREFIX + "embed_tokens.weight": (cfg.vocab_size, h), MTP_PREFIX + "norm.weight": (h,)})
        for layer in range(MTP_LAYERS):
            p = f"{MTP_PREFIX}layers.{layer}."
            shapes.update({p + "eh_proj.weight": (h, 2 * h), p + "enorm.m.weight": (h,), p + "hnorm.m.weight": (h,),
                           p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
            _attention_shapes(shapes, p + "self_attn.", cfg)
            mlp_shapes(shapes, p + "transformer_layer.mlp.", h, cfg.ffn_hidden_size)
    return shapes


def is_mtp_tensor(cfg: LongcatFlashConfig, hf_name: str) -> bool:
    return hf_name.startswith(MTP_PREFIX)


def _attention_shapes(shapes: dict, a: str, cfg: LongcatFlashConfig) -> None:
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    shapes.update({a + "q_a_proj.weight": (cfg.q_lora_rank, h), a + "q_a_layernorm.weight": (cfg.q_lora_rank,),
                   a + "q_b_proj.weight": (heads * cfg.qk_head_dim, cfg.q_lora_rank),
                   a + "kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
                   a + "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
                   a + "kv_b_proj.weight": (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
                   a + "o_proj.weight": (h, heads * cfg.v_head_dim)})
    if cfg.attention_bias:
        shapes.update({a + "q_a_proj.bias": (cfg.q_lora_rank,),
                       a + "kv_a_proj_with_mqa.bias": (cfg.kv_lora_rank + cfg.qk_rope_head_dim,), a + "o_proj.bias": (h,)})


def check_mp(cfg: LongcatFlashConfig, mp: int) -> None:
    """Whole heads, whole ranges of routed + zero experts, and the vocabulary and MLP width divide."""
    for what, size in (("num_attention_heads", cfg.num_attention_heads), ("vocab_size", cfg.vocab_size),
                       ("ffn_hidden_size", cfg.ffn_hidden_size),
                       ("n_routed_experts + zero_expert_num (zero experts are ranked like routed ones)",
                        cfg.num_experts)):
        if size % mp:
            raise PlanError(f"{what} ({size}) is not divisible by mp={mp}", file="config.json",
                            fix=f"choose an --mp that divides {size}")
