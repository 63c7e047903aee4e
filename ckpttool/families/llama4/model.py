"""Llama-4's text model for verify: the shared GQA decoder (model/decoder.py) with Llama-4's attention per
layer and its MoE, numerics as transformers' Llama4ForCausalLM computes them.

Attention: interleaved RoPE in float32 (transformers' complex form, the same products), or none on the
`no_rope_layers`; on RoPE layers an L2 norm of each q and k head (no weight) after RoPE; on the others the
queries scaled by log1p(floor((position + 1) / floor_scale)) * attn_scale + 1; chunked layers attend only
inside their aligned chunk. MoE: sigmoid of the top-k router logits scales each token *before* its
expert (x * s through SwiGLU, not s * expert(x)); the experts are held stacked, [E/mp, H, 2I] and
[E/mp, I, H], rank r owning experts r*E/mp..; a shared expert (tensor parallel) is added to every token.

Parameter names are the mp names of families/llama4/spec.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ckpttool.errors import InputError
from ckpttool.families.base import ConfigArgs, eos_ids, read_rope
from ckpttool.families.llama4.spec import DEFAULT_THETA, Llama4Config
from ckpttool.model.decoder import ROPE_TYPES, Attention, Decoder, DecoderShape, FeedForward, apply_rope_pairs, rope_inv_freq
from ckpttool.model.moe import Router, Routing
from ckpttool.model.parallel import ParallelContext


@dataclass(kw_only=True, slots=True, frozen=True)
class Llama4Args(ConfigArgs):
    cfg: Llama4Config
    shape: DecoderShape
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, raw: dict, source: object = "config.json") -> "Llama4Args":
        cfg = Llama4Config.from_dict(raw, source)
        if raw.get("quantization_config"):
            raise InputError("verify's Llama-4 model reads BF16 weights; config.json declares a quantization",
                             file=source, fix="convert with --dtype bf16 and verify that")
        rope = read_rope(raw, source, default_theta=DEFAULT_THETA, types=ROPE_TYPES)
        inv_freq, scaling = rope_inv_freq(rope, cfg.head_dim)
        n = cfg.num_hidden_layers
        shape = DecoderShape(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=n, heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, qkv_bias=cfg.attention_bias,
            o_bias=cfg.attention_bias, qk_norm="none", norm_eps=cfg.rms_norm_eps, inv_freq=tuple(inv_freq.tolist()),
            attention_scaling=scaling, sliding_windows=(None,) * n, tie_word_embeddings=cfg.tie_word_embeddings,
            fp8=False, rope_interleaved=True, attention_chunks=tuple(cfg.chunk(i) for i in range(n)))
        return cls(cfg=cfg, shape=shape, eos_token_ids=eos_ids(raw))


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama4TextL2Norm: RMS-normalise each head in float32, no weight."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class Llama4Attention(Attention):
    """The decoder's GQA attention with one Llama-4 layer's choices (see the module docstring)."""

    def __init__(self, cfg: Llama4Config, layer: int, s: DecoderShape, ctx: ParallelContext, dtype: torch.dtype):
        super().__init__(s, ctx, dtype)
        self.use_rope = cfg.uses_rope(layer)
        self.l2_eps = cfg.rms_norm_eps if cfg.use_qk_norm and self.use_rope else None
        self.temperature = (cfg.floor_scale, cfg.attn_scale) if cfg.attn_temperature_tuning and not self.use_rope else None

    def forward(self, x: torch.Tensor, start_pos: int, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)  # [B, S, H, D]
        k = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)  # [B, S, K, D]
        v = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        if self.use_rope:
            cos, sin = cos[:, None, :], sin[:, None, :]
            q, k = apply_rope_pairs(q, cos, sin), apply_rope_pairs(k, cos, sin)
        if self.l2_eps is not None:
            q, k = l2_norm(q, self.l2_eps), l2_norm(k, self.l2_eps)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            positions = torch.arange(start_pos, start_pos + seqlen, device=x.device, dtype=torch.float32)
            scales = torch.log1p(torch.floor((positions + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * scales[None, :, None, None]).to(q.dtype)
        return self.attend(q, k, v, start_pos, mask)


class StackedExperts(nn.Module):
    """This rank's experts as Llama-4 stores them: `w13` [E_local, H, 2I] (gate columns, then up), `w2`
    [E_local, I, H]; y = (up * silu(gate)) @ w2 with gate, up = x @ w13."""

    def __init__(self, n_local: int, hidden: int, inter: int, dtype: torch.dtype):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(n_local, hidden, 2 * inter, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(n_local, inter, hidden, dtype=dtype), requires_grad=False)

    def forward(self, local: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ self.w13[local]).chunk(2, dim=-1)
        return (up * F.silu(gate)) @ self.w2[local]


class Llama4MoE(nn.Module):
    def __init__(self, cfg: Llama4Config, ctx: ParallelContext, dtype: torch.dtype):
        super().__init__()
        self.ctx = ctx
        n_local = ctx.split(cfg.num_experts, "num_local_experts")
        self.first = ctx.rank * n_local
        self.gate = Router(Routing(experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, scoring="sigmoid"),
                           cfg.hidden_size, dtype)
        self.experts = StackedExperts(n_local, cfg.hidden_size, cfg.intermediate_size, dtype)
        self.shared_experts = FeedForward(cfg.hidden_size, cfg.intermediate_size, dtype, False, ctx=ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [N, hidden]
        weights, indices = self.gate(flat)  # sigmoid of the chosen logits, unnormalised
        y = torch.zeros_like(flat)
        for local in range(self.experts.w13.shape[0]):
            token, slot = torch.where(indices == self.first + local)
            if token.numel():
                y.index_add_(0, token, self.experts(local, flat[token] * weights[token, slot, None]))
        return (self.shared_experts(flat) + self.ctx.all_reduce(y)).view_as(x)


class Llama4Transformer(Decoder):
    def __init__(self, args: Llama4Args, ctx: ParallelContext, *, dtype: torch.dtype = torch.bfloat16):
        c = args.cfg

        def feed_forward(layer: int) -> nn.Module:
            if c.is_moe_layer(layer):
                return Llama4MoE(c, ctx, dtype)
            return FeedForward(c.hidden_size, c.intermediate_size_mlp, dtype, False, ctx=ctx)

        super().__init__(args.shape, ctx, dtype, feed_forward,
                         attention=lambda layer: Llama4Attention(c, layer, args.shape, ctx, dtype))
        self.args = args
