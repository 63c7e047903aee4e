"""The Gated DeltaNet hybrids for verify (Qwen3-Next, Qwen3.5 MoE), numerics as transformers' torch code
computes them: zero-centred RMSNorms, gated full attention with per-head q/k norms and partial rotary,
Gated DeltaNet layers (model/delta.py), routed experts with a sigmoid-gated shared expert (model/moe.py).

Parameter names are the mp names of families/gated_deltanet/spec.py, so `model{i}-mp{N}.safetensors` loads
into `HybridTransformer(args, ParallelContext(i, N))` one to one. MTP layers are not part of it.
Shapes: B batch, S new tokens, H local heads, D head_dim; for linear attention, G local key heads, R value
heads per key head, K/V key/value head dims.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ckpttool.errors import InputError
from ckpttool.families.base import ConfigArgs, eos_ids, read_rope
from ckpttool.families.gated_deltanet.spec import HybridConfig
from ckpttool.model.decoder import (ROPE_TYPES, DenseLinear, FeedForward, apply_rope, attend_cached, kv_cache,
                                    rope_inv_freq)
from ckpttool.model.delta import ShortConv, delta_rule, l2norm
from ckpttool.model.lm import VocabParallelLM, causal_mask
from ckpttool.model.moe import MoE, Routing
from ckpttool.model.norms import GatedRMSNorm, GemmaRMSNorm
from ckpttool.model.parallel import ParallelContext


@dataclass(kw_only=True, slots=True, frozen=True)
class HybridArgs(ConfigArgs):
    cfg: HybridConfig
    inv_freq: tuple[float, ...]
    attention_scaling: float
    routing: Routing
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, raw: dict, source: object = "config.json") -> "HybridArgs":
        cfg = HybridConfig.from_dict(raw, source)
        if raw.get("quantization_config") is not None:
            raise InputError(f"ckpttool's {cfg.model_type} model reads BF16/F16/F32 weights, and config.json declares "
                             "a quantization_config", file=source,
                             fix="convert with --dtype bf16 (dequantize) and verify that output")
        rope = read_rope(raw, source, default_theta=cfg.type.default_theta, types=ROPE_TYPES)
        inv_freq, scaling = rope_inv_freq(rope, cfg.head_dim, cfg.partial_rotary_factor)
        routing = Routing(experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, normalize=cfg.norm_topk_prob)
        return cls(cfg=cfg, inv_freq=tuple(inv_freq.tolist()), attention_scaling=scaling, routing=routing,
                   eos_token_ids=eos_ids(raw))


class GatedAttention(nn.Module):
    """GQA whose q_proj gives each head's queries and then its output gate: out * sigmoid(gate) before o_proj."""

    def __init__(self, c: HybridConfig, ctx: ParallelContext, dtype: torch.dtype):
        super().__init__()
        d, h, bias = c.head_dim, c.hidden_size, c.attention_bias
        self.n_heads = ctx.split(c.num_attention_heads, "num_attention_heads")
        self.n_kv_heads = max(1, c.num_key_value_heads // ctx.world_size)  # fewer than ranks: the one its queries use
        self.head_dim, self.scale = d, d ** -0.5
        self.wq = DenseLinear(h, self.n_heads * 2 * d, dtype, False, bias)
        self.wk = DenseLinear(h, self.n_kv_heads * d, dtype, False, bias)
        self.wv = DenseLinear(h, self.n_kv_heads * d, dtype, False, bias)
        self.wo = DenseLinear(self.n_heads * d, h, dtype, False, bias, row_ctx=ctx)
        self.q_norm = GemmaRMSNorm(d, c.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(d, c.rms_norm_eps, dtype)

    def setup_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device: torch.device) -> None:
        kv_cache(self, (batch, max_seq_len, self.n_kv_heads, self.head_dim), dtype, device)

    def forward(self, x: torch.Tensor, start_pos: int, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q, gate = self.wq(x).view(bsz, seqlen, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)  # [B, S, H, D] each
        q = self.q_norm(q)
        k = self.k_norm(self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim))
        v = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        cos, sin = cos[:, None, :].to(q.dtype), sin[:, None, :].to(q.dtype)  # [S, 1, rotary_dim]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attend_cached(self, q, k, v, start_pos, mask)
        return self.wo(out * torch.sigmoid(gate.reshape(bsz, seqlen, -1)))


class GatedDeltaNet(nn.Module):
    """Linear attention over this rank's key heads and the value heads that read them: projections, a short
    conv per q/k/v, the gated delta rule with its state, a gated norm, and out_proj summed over ranks."""

    def __init__(self, c: HybridConfig, ctx: ParallelContext, dtype: torch.dtype):
        super().__init__()
        h = c.hidden_size
        g = self.groups = ctx.split(c.linear_num_key_heads, "linear_num_key_heads")
        r = self.per_key = c.linear_num_value_heads // c.linear_num_key_heads
        dk, dv = self.key_dim, self.value_dim = c.linear_key_head_dim, c.linear_value_head_dim
        self.fused = c.type.fused_projections
        if self.fused:  # rows of each key head's group: [q, k, v x R, z x R], and [b x R, a x R]
            self.in_proj_qkvz = DenseLinear(h, g * (2 * dk + 2 * r * dv), dtype, False)
            self.in_proj_ba = DenseLinear(h, g * 2 * r, dtype, False)
        else:
            self.in_proj_q = DenseLinear(h, g * dk, dtype, False)
            self.in_proj_k = DenseLinear(h, g * dk, dtype, False)
            self.in_proj_v = DenseLinear(h, g * r * dv, dtype, False)
            self.in_proj_z = DenseLinear(h, g * r * dv, dtype, False)
            self.in_proj_b = DenseLinear(h, g * r, dtype, False)
            self.in_proj_a = DenseLinear(h, g * r, dtype, False)
        self.conv_q = ShortConv(g * dk, c.linear_conv_kernel_dim, dtype)
        self.conv_k = ShortConv(g * dk, c.linear_conv_kernel_dim, dtype)
        self.conv_v = ShortConv(g * r * dv, c.linear_conv_kernel_dim, dtype)
        self.dt_bias = nn.Parameter(torch.empty(g * r, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(g * r, dtype=dtype), requires_grad=False)
        self.norm = GatedRMSNorm(dv, c.rms_norm_eps, dtype)
        self.out_proj = DenseLinear(g * r * dv, h, dtype, False, row_ctx=ctx)

    def setup_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device: torch.device) -> None:
        for conv in (self.conv_q, self.conv_k, self.conv_v):
            conv.setup_cache(batch, device)
        shape = (batch, self.groups * self.per_key, self.key_dim, self.value_dim)
        self.register_buffer("state", torch.zeros(shape, dtype=torch.float32, device=device), persistent=False)

    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k [B, S, G*K], v, z [B, S, G*R*V], b, a [B, S, G*R]: each group's rows in head order."""
        bsz, seqlen, _ = x.shape
        g, r, dk, dv = self.groups, self.per_key, self.key_dim, self.value_dim
        if not self.fused:
            return tuple(p(x) for p in (self.in_proj_q, self.in_proj_k, self.in_proj_v, self.in_proj_z,
                                        self.in_proj_b, self.in_proj_a))
        qkvz = self.in_proj_qkvz(x).view(bsz, seqlen, g, -1).split([dk, dk, r * dv, r * dv], dim=-1)
        ba = self.in_proj_ba(x).view(bsz, seqlen, g, -1).split([r, r], dim=-1)
        return tuple(t.reshape(bsz, seqlen, -1) for t in (*qkvz, *ba))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        r, dk, dv = self.per_key, self.key_dim, self.value_dim
        q, k, v, z, b, a = self._projections(x)
        q = self.conv_q(q).view(bsz, seqlen, -1, dk)  # [B, S, G, K]
        k = self.conv_k(k).view(bsz, seqlen, -1, dk)
        v = self.conv_v(v).view(bsz, seqlen, -1, dv)  # [B, S, G*R, V]
        beta = b.sigmoid()
        decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [B, S, G*R], log space
        q, k = (l2norm(t.float().repeat_interleave(r, dim=2)) for t in (q, k))  # each value head's key head
        out = delta_rule(q * dk ** -0.5, k, v.float(), decay.unsqueeze(-1), beta.float(), self.state).to(x.dtype)
        out = self.norm(out, z.view(bsz, seqlen, -1, dv))
        return self.out_proj(out.reshape(bsz, seqlen, -1))


class HybridLayer(nn.Module):
    def __init__(self, args: HybridArgs, layer: int, ctx: ParallelContext, dtype: torch.dtype):
        super().__init__()
        c = args.cfg
        self.attention_norm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.ffn_norm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.linear = c.layer_types[layer] == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(c, ctx, dtype)
        else:
            self.attention = GatedAttention(c, ctx, dtype)
        if c.is_moe_layer(layer):
            self.feed_forward = MoE(args.routing, c.hidden_size, c.expert_intermediate_size, ctx, dtype, False,
                                    shared_inter=c.shared_intermediate_size, shared_gate=True)
        else:
            self.feed_forward = FeedForward(c.hidden_size, c.intermediate_size, dtype, False, ctx=ctx)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.linear else self.attention

    def forward(self, x, start_pos, cos, sin, mask):
        h = self.attention_norm(x)
        x = x + (self.linear_attn(h) if self.linear else self.attention(h, start_pos, cos, sin, mask))
        return x + self.feed_forward(self.ffn_norm(x))


class HybridTransformer(VocabParallelLM):
    """The layers between model/lm.py's embedding and head."""

    def __init__(self, args: HybridArgs, ctx: ParallelContext, *, dtype: torch.dtype = torch.bfloat16):
        c = args.cfg
        super().__init__(ctx, c.vocab_size, c.hidden_size, GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, dtype), dtype,
                         tie_word_embeddings=c.tie_word_embeddings)
        self.args = args
        self.layers = nn.ModuleList(HybridLayer(args, i, ctx, dtype) for i in range(c.num_hidden_layers))

    def setup_caches(self, batch: int, max_seq_len: int) -> None:
        """Rotary tables, KV caches, and zeroed conv and recurrent states: a new sequence starts here."""
        self.setup_rope(max_seq_len, self.args.inv_freq, self.args.attention_scaling)
        for layer in self.layers:
            layer.mixer.setup_cache(batch, max_seq_len, self.dtype, self.tok_embeddings.weight.device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int = 0, *, all_positions: bool = False) -> torch.Tensor:
        """tokens: [B, S] at positions start_pos.. (the states hold every earlier one) -> float32 logits
        [B, V] (last position) or [B, S, V]."""
        end = self.positions(tokens, start_pos)
        h = self.tok_embeddings(tokens)
        cos, sin = self.cos[start_pos:end], self.sin[start_pos:end]
        mask = causal_mask(start_pos, end, h)
        for layer in self.layers:
            h = layer(h, start_pos, cos, sin, mask)
        return self.logits(h, all_positions)
