"""gpt-oss transformer (GQA with attention sinks, alternating sliding/full attention, top-k softmax MoE
with clamped SwiGLU) with tensor/expert parallelism, for verify.

Parameter names are the native names of families/gpt_oss/spec.py KEY_TABLE, so `model{i}-mp{N}.safetensors`
loads into `Transformer(cfg, ParallelContext(i, N))` one to one. Expert weights are BF16 in transformers'
layout ([E, H, 2I] with gate/up interleaved, [E, I, H]). Numerics follow transformers' GptOss, the
oracle of the tests. Shapes: B batch, S new tokens, T cached positions, H local heads, D head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ckpttool.families.gpt_oss.spec import GptOssConfig
from ckpttool.model.decoder import kv_cache
from ckpttool.model.parallel import ColumnParallelLinear, ParallelContext, ParallelEmbedding, RowParallelLinear


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    """Normalise and scale in float32, then cast back (gpt-oss keeps its norms in float32)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = _param(dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


class BiasedColumnLinear(ColumnParallelLinear):
    """Column-parallel with its bias cut the same way as the output features."""

    def __init__(self, ctx: ParallelContext, in_features: int, out_features: int, dtype: torch.dtype, what: str):
        super().__init__(ctx, in_features, out_features, dtype, what=what)
        self.bias = _param(self.weight.shape[0], dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dense_weight(), self.bias)


class BiasedRowLinear(RowParallelLinear):
    """Row-parallel with a replicated bias, added once after the partial sums are reduced."""

    def __init__(self, ctx: ParallelContext, in_features: int, out_features: int, dtype: torch.dtype, what: str):
        super().__init__(ctx, in_features, out_features, dtype, what=what)
        self.bias = _param(out_features, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.bias


# -- rotary embedding --------------------------------------------------------------------------------
def rope_cos_sin(cfg: GptOssConfig, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [max_seq_len, D/2] cos and sin, YaRN-scaled as transformers computes them."""
    dim, base = cfg.head_dim, cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    attention_factor = 1.0
    yarn = cfg.rope_scaling
    if yarn is not None:
        factor = float(yarn["factor"])
        original = yarn["original_max_position_embeddings"]
        beta_fast, beta_slow = yarn.get("beta_fast") or 32, yarn.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if yarn.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        # high-frequency dims keep their frequency (extrapolate), low-frequency dims are divided by factor
        inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
        attention_factor = yarn.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all = yarn.get("mscale"), yarn.get("mscale_all_dim")

            def get_mscale(scale: float, m: float = 1.0) -> float:
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

            attention_factor = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all) if mscale and mscale_all
                                else get_mscale(factor))
    angles = torch.arange(max_seq_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, S, H, D]; pairs are (x_i, x_{i + D/2}); cos/sin: [S, D/2] in x's dtype."""
    first, second = x.chunk(2, dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


# -- attention ---------------------------------------------------------------------------------------
class Attention(nn.Module):
    """GQA, heads split across ranks (q/k/v by column, o by row). Each head has a learned sink logit:
    a softmax column that takes probability mass but contributes no value."""

    def __init__(self, layer: int, cfg: GptOssConfig, ctx: ParallelContext, dtype: torch.dtype):
        super().__init__()
        d = cfg.head_dim
        self.head_dim = d
        self.n_local_heads = ctx.split(cfg.num_attention_heads, "num_attention_heads")
        self.n_local_kv_heads = ctx.split(cfg.num_key_value_heads, "num_key_value_heads")
        self.sliding_window = cfg.sliding_window if cfg.is_sliding(layer) else None
        self.wq = BiasedColumnLinear(ctx, cfg.hidden_size, cfg.num_attention_heads * d, dtype, "num_attention_heads")
        self.wk = BiasedColumnLinear(ctx, cfg.hidden_size, cfg.num_key_value_heads * d, dtype, "num_key_value_heads")
        self.wv = BiasedColumnLinear(ctx, cfg.hidden_size, cfg.num_key_value_heads * d, dtype, "num_key_value_heads")
        self.wo = BiasedRowLinear(ctx, cfg.num_attention_heads * d, cfg.hidden_size, dtype, "num_attention_heads")
        self.sinks = _param(self.n_local_heads, dtype=dtype)

    def setup_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device: torch.device) -> None:
        kv_cache(self, (batch, max_seq_len, self.n_local_kv_heads, self.head_dim), dtype, device)

    def forward(self, x: torch.Tensor, start_pos: int, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        end = start_pos + seqlen
        q = apply_rope(self.wq(x).view(bsz, seqlen, self.n_local_heads, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(bsz, seqlen, self.n_local_kv_heads, self.head_dim), cos, sin)
        self.k_cache[:bsz, start_pos:end] = k
        self.v_cache[:bsz, start_pos:end] = self.wv(x).view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        group = self.n_local_heads // self.n_local_kv_heads
        keys = self.k_cache[:bsz, :end].repeat_interleave(group, dim=2)  # [B, T, H, D]
        values = self.v_cache[:bsz, :end].repeat_interleave(group, dim=2)
        scores = torch.einsum("bshd,bthd->bhst", q, keys) * self.head_dim ** -0.5  # [B, H, S, T]
        scores = scores + mask.to(scores.dtype)
        sinks = self.sinks.to(scores.dtype).view(1, -1, 1, 1).expand(bsz, -1, seqlen, 1)
        probs = torch.cat([scores, sinks], dim=-1).softmax(dim=-1)[..., :-1]  # the sink column is dropped
        out = torch.einsum("bhst,bthd->bshd", probs.to(values.dtype), values)
        return self.wo(out.flatten(2))  # [B, S, hidden], summed over ranks


# -- mixture of experts ------------------------------------------------------------------------------
class Router(nn.Module):
    """Linear router with bias; top-k over the logits, softmax over those k only."""

    def __init__(self, cfg: GptOssConfig, dtype: torch.dtype):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.weight = _param(cfg.num_local_experts, cfg.hidden_size, dtype=dtype)
        self.bias = _param(cfg.num_local_experts, dtype=dtype)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight, self.bias)  # [N, experts]
        top, indices = logits.topk(self.top_k, dim=-1)
        return top.softmax(dim=-1), indices


class Experts(nn.Module):
    """This rank's contiguous range of experts, stacked: w13 [E, H, 2I] (gate at even columns, up at
    odd), w2 [E, I, H], both applied as x @ W."""

    def __init__(self, cfg: GptOssConfig, ctx: ParallelContext, dtype: torch.dtype):
        super().__init__()
        n_local = ctx.split(cfg.num_local_experts, "num_local_experts")
        self.first_expert = ctx.rank * n_local
        h, inter = cfg.hidden_size, cfg.intermediate_size
        self.w13 = _param(n_local, h, 2 * inter, dtype=dtype)
        self.b13 = _param(n_local, 2 * inter, dtype=dtype)
        self.w2 = _param(n_local, inter, h, dtype=dtype)
        self.b2 = _param(n_local, h, dtype=dtype)
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit

    def expert(self, local: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = x @ self.w13[local] + self.b13[local]  # [N, 2I]
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return ((up + 1) * glu) @ self.w2[local] + self.b2[local]  # the +1 on up is gpt-oss's

    def forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Partial sum over the routes that land on this rank's experts; the caller all-reduces."""
        y = torch.zeros_like(x)
        for local in range(self.w13.shape[0]):
            token, slot = torch.where(indices == self.first_expert + local)
            if token.numel():
                y.index_add_(0, token, (self.expert(local, x[token]) * weights[token, slot, None]).to(x.dtype))
        return y


class MoE(nn.Module):
    def __init__(self, cfg: GptOssConfig, ctx: ParallelContext, dtype: torch.dtype):
        super().__init__()
        self.ctx = ctx
        self.gate = Router(cfg, dtype)
        self.experts = Experts(cfg, ctx, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [N, hidden]
        weights, indices = self.gate(flat)
        return self.ctx.all_reduce(self.experts(flat, weights, indices)).view_as(x)


# -- the model ---------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, layer: int, cfg: GptOssConfig, ctx: ParallelContext, dtype: torch.dtype):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = Attention(layer, cfg, ctx, dtype)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.ffn = MoE(cfg, ctx, dtype)

    def forward(self, x: torch.Tensor, start_pos: int, cos: torch.Tensor, sin: torch.Tensor,
                masks: dict[int | None, torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), start_pos, cos, sin, masks[self.attn.sliding_window])
        return x + self.ffn(self.ffn_norm(x))


def attention_mask(start_pos: int, seqlen: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[S, T] additive mask: new token i (absolute p = start_pos + i) sees cached t <= p, and with a
    sliding window only t > p - window (the window counts the token itself)."""
    p = torch.arange(start_pos, start_pos + seqlen, device=device)[:, None]
    t = torch.arange(start_pos + seqlen, device=device)[None, :]
    visible = t <= p
    if window is not None:
        visible &= t > p - window
    return torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))


class Transformer(nn.Module):
    """Embedding, blocks, final norm and a vocabulary-parallel head whose slices are all-gathered."""

    def __init__(self, cfg: GptOssConfig, ctx: ParallelContext, *, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.cfg, self.ctx, self.dtype = cfg, ctx, dtype
        self.embed = ParallelEmbedding(ctx, cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(Block(i, cfg, ctx, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.head = ColumnParallelLinear(ctx, cfg.hidden_size, cfg.vocab_size, dtype, what="vocab_size")
        self.max_seq_len = 0

    def setup_caches(self, batch: int, max_seq_len: int) -> None:
        """Allocate KV caches and rope tables; call after loading weights, before forward."""
        device = self.embed.weight.device
        self.max_seq_len = max_seq_len
        cos, sin = rope_cos_sin(self.cfg, max_seq_len)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)
        for block in self.layers:
            block.attn.setup_cache(batch, max_seq_len, self.dtype, device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int = 0, *, all_positions: bool = False) -> torch.Tensor:
        """tokens: [B, S] at positions start_pos.. -> float32 logits [B, V] for the last position,
        or [B, S, V] for every position."""
        seqlen = tokens.shape[1]
        end = start_pos + seqlen
        if end > self.max_seq_len:
            raise ValueError(f"position {end} exceeds the cache of {self.max_seq_len}; call setup_caches")
        h = self.embed(tokens)
        cos, sin = self.rope_cos[start_pos:end].to(h.dtype), self.rope_sin[start_pos:end].to(h.dtype)
        masks = {w: attention_mask(start_pos, seqlen, w, tokens.device)
                 for w in {block.attn.sliding_window for block in self.layers}}
        for block in self.layers:
            h = block(h, start_pos, cos, sin, masks)
        h = self.norm(h)
        if not all_positions:
            h = h[:, -1]
        return self.ctx.all_gather_last_dim(self.head(h)).float()
