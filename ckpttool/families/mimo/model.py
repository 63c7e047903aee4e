"""MiMo-V2-Flash for verify: the shared GQA decoder (model/decoder.py) with MiMo's two kinds of attention layer
and the MoE family's router and experts (model/moe.py), numerics as transformers' MiMoV2FlashForCausalLM.

Each layer's attention holds its own kind's shapes and rope: sliding-window layers have twice the KV heads
and a sink logit per head; values are `v_head_dim` wide and scaled by attention_value_scale before the
cache; RoPE (rotate-half, on the first int(head_dim * partial_rotary_factor) dims) uses the theta of the
layer's kind. Routing: sigmoid scores, correction bias and group limit for the choice, normalised top-k
weights times routed_scaling_factor, no shared expert. Parameter names are the mp names of
families/mimo/spec.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from ckpttool.families.base import ConfigArgs, Rope, eos_ids
from ckpttool.families.mimo.spec import MiMoConfig
from ckpttool.formats import declares_fp8_block
from ckpttool.model.decoder import Attention, Decoder, DecoderShape, DenseLinear, FeedForward, apply_rope, rope_inv_freq
from ckpttool.model.lm import rope_angles
from ckpttool.model.moe import MoE, Routing
from ckpttool.model.parallel import ParallelContext


@dataclass(kw_only=True, slots=True, frozen=True)
class MiMoArgs(ConfigArgs):
    cfg: MiMoConfig
    shape: DecoderShape
    routing: Routing
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, raw: dict, source: object = "config.json") -> "MiMoArgs":
        cfg = MiMoConfig.from_dict(raw, source)
        n = cfg.num_hidden_layers
        shape = DecoderShape(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=n, heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, qkv_bias=cfg.attention_bias, o_bias=False,
            qk_norm="none", norm_eps=cfg.rms_norm_eps, inv_freq=inv_freq(cfg, "full_attention"), attention_scaling=1.0,
            sliding_windows=tuple(cfg.sliding_window if cfg.is_sliding(i) else None for i in range(n)),
            tie_word_embeddings=cfg.tie_word_embeddings, fp8=declares_fp8_block(raw.get("quantization_config"), source))
        routing = Routing(experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, scoring="sigmoid",
                          correction_bias=True, groups=cfg.n_group, topk_groups=cfg.topk_group,
                          normalize=cfg.norm_topk_prob, scale=cfg.routed_scaling_factor)
        return cls(cfg=cfg, shape=shape, routing=routing, eos_token_ids=eos_ids(raw))


def inv_freq(cfg: MiMoConfig, kind: str) -> tuple[float, ...]:
    rope = cfg.rope[kind]
    freqs, _ = rope_inv_freq(Rope(rope.theta, "default", {}), cfg.head_dim, rope.partial_rotary_factor)
    return tuple(freqs.tolist())


class MiMoAttention(Attention):
    """One layer's attention of its kind (see the module docstring); its rope tables are its own."""

    def __init__(self, cfg: MiMoConfig, layer: int, s: DecoderShape, ctx: ParallelContext, dtype: torch.dtype):
        super().__init__(replace(s, kv_heads=cfg.kv_heads(layer)), ctx, dtype)
        self.v_dim, self.v_scale = cfg.v_head_dim, cfg.attention_value_scale
        self.wv = DenseLinear(s.hidden_size, self.n_kv_heads * self.v_dim, dtype, s.fp8, cfg.attention_bias)
        self.wo = DenseLinear(self.n_heads * self.v_dim, s.hidden_size, dtype, s.fp8, False, row_ctx=ctx)
        if cfg.is_sliding(layer):
            self.sinks = nn.Parameter(torch.empty(self.n_heads, dtype=dtype), requires_grad=False)
        self.inv_freq = inv_freq(cfg, "sliding_attention" if cfg.is_sliding(layer) else "full_attention")

    def setup_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device: torch.device) -> None:
        k, v = (batch, max_seq_len, self.n_kv_heads, self.head_dim), (batch, max_seq_len, self.n_kv_heads, self.v_dim)
        self.register_buffer("k_cache", torch.zeros(k, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(v, dtype=dtype, device=device), persistent=False)
        emb = rope_angles(max_seq_len, self.inv_freq).to(device)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x: torch.Tensor, start_pos: int, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)  # [B, S, H, D]
        k = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)  # [B, S, K, D]
        v = (self.wv(x) * self.v_scale).view(bsz, seqlen, self.n_kv_heads, self.v_dim)  # [B, S, K, Dv]
        end = start_pos + seqlen
        cos, sin = self.cos[start_pos:end, None, :].to(q.dtype), self.sin[start_pos:end, None, :].to(q.dtype)
        return self.attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, start_pos, mask)


class MiMoTransformer(Decoder):
    def __init__(self, args: MiMoArgs, ctx: ParallelContext, *, dtype: torch.dtype = torch.bfloat16):
        c, fp8 = args.cfg, args.shape.fp8

        def feed_forward(layer: int) -> nn.Module:
            if c.is_moe_layer(layer):
                return MoE(args.routing, c.hidden_size, c.moe_intermediate_size, ctx, dtype, fp8)
            return FeedForward(c.hidden_size, c.intermediate_size, dtype, fp8, ctx=ctx)

        super().__init__(args.shape, ctx, dtype, feed_forward,
                         attention=lambda layer: MiMoAttention(c, layer, args.shape, ctx, dtype))
        self.args = args
