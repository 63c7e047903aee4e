"""gpt-oss (openai/gpt-oss-20b, -120b): config, tensor names/shapes, MXFP4 -> BF16 layout and the
HF <-> per-rank (mp) key table.

Published (MXFP4) form, per layer `model.layers.{layer}.`, E experts, H hidden, I intermediate:
    mlp.experts.gate_up_proj_blocks  u8   [E, 2I, H/32, 16]   two e2m1 codes per byte, low nibble first
    mlp.experts.gate_up_proj_scales  u8   [E, 2I, H/32]       e8m0 exponent (bias 127) per 32 values
    mlp.experts.gate_up_proj_bias    bf16 [E, 2I]
    mlp.experts.down_proj_blocks     u8   [E, H, I/32, 16]
    mlp.experts.down_proj_scales     u8   [E, H, I/32]
    mlp.experts.down_proj_bias       bf16 [E, H]
Everything else (attention with biases and per-head `sinks`, router, norms, embeddings, head) is BF16.

BF16 form, what transformers' GptOssExperts loads (and what its own MXFP4 dequantization builds):
    mlp.experts.gate_up_proj  [E, H, 2I] = dequant(gate_up_proj_blocks, gate_up_proj_scales).transpose(1, 2)
    mlp.experts.down_proj     [E, I, H]  = dequant(down_proj_blocks, down_proj_scales).transpose(1, 2)
i.e. the stored MXFP4 rows are output features (nn.Linear's [out, in]); transformers computes
`x @ W[e]` with W[e] = [in, out]. Gate and up stay *interleaved* along 2I: output column 2j is gate j,
2j+1 is up j (`gate_up[..., ::2]`, `gate_up[..., 1::2]`); nothing is de-interleaved. Biases and every
non-expert tensor keep their names, shapes and dtypes.

Per-rank (mp N) format, `model{rank}-mp{N}.safetensors`: the native names of KEY_TABLE; attention
q/k/v (weights, biases) and `sinks` are cut along heads (dim 0), o_proj along its input (dim 1, bias
replicated and added once after the all-reduce), embedding and head along the vocabulary (dim 0);
experts stay stacked and rank r holds the contiguous range `expert_range(cfg, r, N)` of dim 0 (the
BF16 [E, H, 2I] / [E, I, H] weights, or the MXFP4 blocks/scales when not dequantized); router and
norms are replicated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ckpttool.families.base import config_fields, read_rope
from ckpttool.families.shapes import attention_shapes, decoder_shapes
from ckpttool.families.keymap import KeyMap
from ckpttool.errors import InputError, PlanError
from ckpttool.formats import MXFP4
from ckpttool.kernels.mxfp4 import VALUES_PER_BLOCK, check_mxfp4, dequant_mxfp4

MXFP4_BLOCKS = MXFP4.values.text
"""`{proj}_blocks`: the suffix of an expert weight's MXFP4 values (formats.MXFP4)"""
MXFP4_SCALES = MXFP4.side("scale").name.text

if TYPE_CHECKING:
    import torch

EXPERTS = 0
"""Stacked expert tensors [E, ...] are cut along dim 0: rank r gets a contiguous range of experts."""
MXFP4_PROJS = ("gate_up_proj", "down_proj")
"""The expert weights gpt-oss publishes as MXFP4; `{proj}_blocks` + `{proj}_scales` -> `{proj}`."""

_ATTN = [
    ("self_attn.q_proj.weight", "attn.wq.weight", 0),
    ("self_attn.q_proj.bias", "attn.wq.bias", 0),
    ("self_attn.k_proj.weight", "attn.wk.weight", 0),
    ("self_attn.k_proj.bias", "attn.wk.bias", 0),
    ("self_attn.v_proj.weight", "attn.wv.weight", 0),
    ("self_attn.v_proj.bias", "attn.wv.bias", 0),
    ("self_attn.o_proj.weight", "attn.wo.weight", 1),
    ("self_attn.o_proj.bias", "attn.wo.bias", None),
    ("self_attn.sinks", "attn.sinks", 0),
]
_MOE = [
    ("mlp.router.weight", "ffn.gate.weight", None),
    ("mlp.router.bias", "ffn.gate.bias", None),
    ("mlp.experts.gate_up_proj", "ffn.experts.w13", EXPERTS),
    ("mlp.experts.gate_up_proj_bias", "ffn.experts.b13", EXPERTS),
    ("mlp.experts.down_proj", "ffn.experts.w2", EXPERTS),
    ("mlp.experts.down_proj_bias", "ffn.experts.b2", EXPERTS),
    ("mlp.experts.gate_up_proj_blocks", "ffn.experts.w13_blocks", EXPERTS),
    ("mlp.experts.gate_up_proj_scales", "ffn.experts.w13_scales", EXPERTS),
    ("mlp.experts.down_proj_blocks", "ffn.experts.w2_blocks", EXPERTS),
    ("mlp.experts.down_proj_scales", "ffn.experts.w2_scales", EXPERTS),
]


def _layer_rows() -> list[tuple[str, str, object]]:
    hf, nat = "model.layers.{layer}.", "layers.{layer}."
    rows = [
        (hf + "input_layernorm.weight", nat + "attn_norm.weight", None),
        (hf + "post_attention_layernorm.weight", nat + "ffn_norm.weight", None),
    ]
    rows += [(hf + a, nat + b, d) for a, b, d in _ATTN]
    rows += [(hf + a, nat + b, d) for a, b, d in _MOE]
    return rows


KEY_TABLE: list[tuple] = [
    ("model.embed_tokens.weight", "embed.weight", 0),
    ("model.norm.weight", "norm.weight", None),
    ("lm_head.weight", "head.weight", 0),
    *_layer_rows(),
]
"""(hf template, native template, split): split is a dim cut evenly across ranks (EXPERTS, dim 0 of a
stacked expert tensor, gives each rank a contiguous expert range) or None (replicated). `{layer}` is the only
placeholder. Holds both the MXFP4 rows (`*_blocks`, `*_scales`) and their BF16 result rows."""


KEY_MAP = KeyMap(KEY_TABLE)


def to_native(hf_name: str) -> tuple[str, object]:
    """(native name, split) of an HF gpt-oss tensor name; an unknown name is a PlanError."""
    mapped = KEY_MAP.to_native(hf_name)
    if mapped is None:
        raise PlanError("no gpt-oss mp rule for this tensor", tensor=hf_name,
                        fix="is this a gpt-oss checkpoint? `ckpttool inspect` lists its tensors")
    return mapped.name, mapped.split


def to_hf(native_name: str) -> str:
    """The inverse of to_native, derived from the same table."""
    mapped = KEY_MAP.to_hf(native_name)
    if mapped is None:
        raise PlanError("not a gpt-oss mp tensor name", tensor=native_name)
    return mapped.name


def shard_for_rank(hf_tensors: dict[str, torch.Tensor], rank: int, mp: int) -> dict[str, torch.Tensor]:
    """The tensors of `model{rank}-mp{mp}.safetensors`: renamed and cut by KEY_TABLE. A reference for
    the streaming shard stage and the loader of tests; holds every input tensor in memory."""
    out = {}
    for name, t in hf_tensors.items():
        native, split = to_native(name)
        if split is not None:
            dim = split
            if t.shape[dim] % mp:
                raise PlanError(f"dim {dim} ({t.shape[dim]}) is not divisible by mp={mp}", tensor=name,
                                fix="choose an --mp that divides it")
            t = t.chunk(mp, dim)[rank]
        out[native] = t.contiguous()
    return out


@dataclass(kw_only=True, slots=True, frozen=True)
class GptOssConfig:
    """The fields of an HF gpt-oss config.json that decide tensor names, shapes, routing and attention."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_local_experts: int
    num_experts_per_tok: int
    sliding_window: int | None
    layer_types: tuple[str, ...]  # "sliding_attention" | "full_attention" per layer
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # YaRN parameters as in config.json, or None for plain RoPE
    max_position_embeddings: int
    swiglu_limit: float
    swiglu_alpha: float
    attention_bias: bool
    tie_word_embeddings: bool
    mxfp4: bool  # quantization_config.quant_method == "mxfp4"

    @classmethod
    def from_dict(cls, raw: dict, source: object = "config.json") -> "GptOssConfig":
        with config_fields(source):
            if raw.get("model_type") != "gpt_oss":
                raise InputError(f"model_type is {raw.get('model_type')!r}, not 'gpt_oss'", file=source,
                                 fix="use the DeepSeek path for DeepSeek checkpoints")
            layers = int(raw["num_hidden_layers"])
            layer_types = raw.get("layer_types") or [
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
            rope = read_rope(raw, source, default_theta=150000.0, types=("default", "yarn"))  # GptOssConfig's theta
            quant = raw.get("quantization_config") or {}
            heads = int(raw["num_attention_heads"])
            cfg = cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
                num_local_experts=int(raw["num_local_experts"]),
                num_experts_per_tok=int(raw.get("num_experts_per_tok", raw.get("experts_per_token", 4))),
                sliding_window=int(raw["sliding_window"]) if raw.get("sliding_window") else None,
                layer_types=tuple(layer_types),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
                rope_theta=rope.theta,
                rope_scaling=None if rope.type == "default" else rope.params,
                max_position_embeddings=int(raw.get("max_position_embeddings", 131072)),
                swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
                swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
                attention_bias=bool(raw.get("attention_bias", True)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                mxfp4=quant.get("quant_method") == "mxfp4",
            )
        cfg._check(source)
        return cfg

    @classmethod
    def load(cls, path: Path) -> "GptOssConfig":
        return cls.from_dict(json.loads(Path(path).read_text()), path)

    def _check(self, source: object) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise InputError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers",
                             file=source)
        if bad := set(self.layer_types) - {"sliding_attention", "full_attention"}:
            raise InputError(f"unknown layer_types {sorted(bad)}", file=source)
        if not 0 < self.num_experts_per_tok <= self.num_local_experts:
            raise InputError(f"num_experts_per_tok ({self.num_experts_per_tok}) is not in 1..{self.num_local_experts} "
                             "(num_local_experts)", file=source, fix="use the config.json published with the checkpoint")
        for name, size in (("hidden_size", self.hidden_size), ("intermediate_size", self.intermediate_size)):
            if size % VALUES_PER_BLOCK:
                raise InputError(f"{name} ({size}) is not a multiple of the MXFP4 block ({VALUES_PER_BLOCK})",
                                 file=source)

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"


def hf_tensor_shapes(cfg: GptOssConfig, *, mxfp4: bool | None = None) -> dict[str, tuple[int, ...]]:
    """Every tensor of an HF gpt-oss checkpoint: the MXFP4 form as published, or the BF16 form."""
    mxfp4 = cfg.mxfp4 if mxfp4 is None else mxfp4
    h, d, e, inter = cfg.hidden_size, cfg.head_dim, cfg.num_local_experts, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes, prefixes = decoder_shapes(cfg.vocab_size, h, cfg.num_hidden_layers,
                                      tie_word_embeddings=cfg.tie_word_embeddings)
    for p in prefixes:
        attention_shapes(shapes, p, h, q, kv, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias)
        shapes[p + "self_attn.sinks"] = (cfg.num_attention_heads,)
        shapes[p + "mlp.router.weight"] = (e, h)
        shapes[p + "mlp.router.bias"] = (e,)
        x = p + "mlp.experts."
        if mxfp4:
            shapes[x + "gate_up_proj_blocks"] = (e, 2 * inter, h // VALUES_PER_BLOCK, 16)
            shapes[x + "gate_up_proj_scales"] = (e, 2 * inter, h // VALUES_PER_BLOCK)
            shapes[x + "down_proj_blocks"] = (e, h, inter // VALUES_PER_BLOCK, 16)
            shapes[x + "down_proj_scales"] = (e, h, inter // VALUES_PER_BLOCK)
        else:
            shapes[x + "gate_up_proj"] = (e, h, 2 * inter)
            shapes[x + "down_proj"] = (e, inter, h)
        shapes[x + "gate_up_proj_bias"] = (e, 2 * inter)
        shapes[x + "down_proj_bias"] = (e, h)
    return shapes


def hf_tensor_dtype(hf_name: str) -> torch.dtype:
    """The dtype gpt-oss publishes each tensor in: u8 MXFP4 blocks/scales, BF16 for the rest."""
    import torch

    return torch.uint8 if hf_name.endswith((MXFP4_BLOCKS, MXFP4_SCALES)) else torch.bfloat16


def mxfp4_source(hf_name: str) -> tuple[str, str] | None:
    """For a BF16 expert weight name, the (blocks, scales) names it is dequantized from; else None."""
    prefix, _, proj = hf_name.rpartition(".")
    if proj in MXFP4_PROJS and prefix.endswith(".mlp.experts"):
        return hf_name + MXFP4_BLOCKS, hf_name + MXFP4_SCALES
    return None


def bf16_name(hf_name: str) -> str | None:
    """`...experts.gate_up_proj_blocks` -> `...experts.gate_up_proj`; None for names that are not blocks."""
    base = hf_name.removesuffix(MXFP4_BLOCKS)
    if base != hf_name and mxfp4_source(base):
        return base
    return None


def bf16_expert_shape(blocks_shape) -> tuple[int, int, int]:
    """[E, R, G, 16] blocks -> the transposed [E, G * 32, R] BF16 weight transformers loads."""
    e, rows, groups, _ = blocks_shape
    return (e, groups * VALUES_PER_BLOCK, rows)


def dequant_expert_weight(blocks: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype | None = None,
                          *, tensor: str = "<blocks>") -> torch.Tensor:
    """MXFP4 [E, R, G, 16] + [E, R, G] -> [E, G * 32, R] in transformers' layout (BF16 by default).

    One expert at a time, so the temporary beside the output is one expert's [R, G * 32], not a
    second copy of the whole tensor.
    """
    if blocks.dim() != 4:
        raise InputError(f"gpt-oss expert blocks must be 4-D [E, R, G, 16], got {list(blocks.shape)}", tensor=tensor)
    import torch

    check_mxfp4(blocks.shape, scales.shape, tensor=tensor)
    out_dtype = out_dtype or torch.bfloat16
    out = torch.empty(bf16_expert_shape(blocks.shape), dtype=out_dtype, device=blocks.device)
    for e in range(blocks.shape[0]):
        out[e] = dequant_mxfp4(blocks[e], scales[e], out_dtype, tensor=tensor).transpose(0, 1)
    return out


def bf16_config(raw: dict) -> dict:
    """config.json of the BF16 export: no quantization_config, dtype bfloat16, the rest unchanged."""
    out = {k: v for k, v in raw.items() if k != "quantization_config"}
    out["torch_dtype"] = "bfloat16"
    if "dtype" in out:
        out["dtype"] = "bfloat16"
    return out


def expert_range(cfg: GptOssConfig, rank: int, mp: int) -> range:
    """The contiguous experts rank `rank` of `mp` holds."""
    if cfg.num_local_experts % mp:
        raise PlanError(f"num_local_experts ({cfg.num_local_experts}) is not divisible by mp={mp}",
                        fix="choose an --mp that divides the expert count")
    per = cfg.num_local_experts // mp
    return range(rank * per, (rank + 1) * per)


def check_mp(cfg: GptOssConfig, mp: int) -> None:
    """Every cut the mp format makes must be even: heads, KV heads, experts, vocabulary."""
    for what, size in (("num_attention_heads", cfg.num_attention_heads),
                       ("num_key_value_heads", cfg.num_key_value_heads),
                       ("num_local_experts", cfg.num_local_experts), ("vocab_size", cfg.vocab_size)):
        if size % mp:
            raise PlanError(f"{what} ({size}) is not divisible by mp={mp}", fix=f"choose an --mp that divides {what}")
