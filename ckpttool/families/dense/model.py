"""Dense llama / mistral / qwen2 / qwen3 decoder with tensor parallelism, for verify: the shared GQA
decoder (model/decoder.py) with a SwiGLU MLP in every layer.

Parameter names are the dense mp names of families/dense/spec.py, so `model{i}-mp{N}.safetensors` loads
into `DenseTransformer(args, ParallelContext(i, N))` one to one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ckpttool.errors import InputError
from ckpttool.families.base import ConfigArgs, eos_ids, read_rope
from ckpttool.families.dense.spec import DenseConfig
from ckpttool.formats import declares_fp8_block
from ckpttool.model.decoder import ROPE_TYPES, Decoder, DecoderShape, FeedForward, rope_inv_freq, sliding_windows
from ckpttool.model.parallel import ParallelContext


@dataclass(kw_only=True, slots=True, frozen=True)
class DenseArgs(ConfigArgs):
    cfg: DenseConfig
    shape: DecoderShape
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, raw: dict, source: object = "config.json") -> "DenseArgs":
        cfg = DenseConfig.from_dict(raw, source)
        if raw.get("hidden_act", "silu") != "silu":
            raise InputError(f"hidden_act {raw['hidden_act']!r} is not supported", file=source,
                             fix="verify's dense model uses SiLU-gated MLPs")
        rope = read_rope(raw, source, default_theta=10000.0, types=ROPE_TYPES)
        inv_freq, scaling = rope_inv_freq(rope, cfg.head_dim)
        shape = DecoderShape(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers,
            heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
            qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias, qk_norm="head" if cfg.qk_norm else "none",
            norm_eps=float(raw.get("rms_norm_eps", 1e-6)), inv_freq=tuple(inv_freq.tolist()),
            attention_scaling=scaling, sliding_windows=sliding_windows(raw, cfg.num_hidden_layers),
            tie_word_embeddings=cfg.tie_word_embeddings,
            fp8=declares_fp8_block(raw.get("quantization_config"), source))
        return cls(cfg=cfg, shape=shape, eos_token_ids=eos_ids(raw))


class DenseTransformer(Decoder):
    def __init__(self, args: DenseArgs, ctx: ParallelContext, *, dtype: torch.dtype = torch.bfloat16):
        c = args.cfg
        super().__init__(args.shape, ctx, dtype, lambda layer: FeedForward(
            c.hidden_size, c.intermediate_size, dtype, args.shape.fp8, ctx=ctx, bias=c.mlp_bias))
        self.args = args
