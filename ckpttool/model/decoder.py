"""The GQA decoder the Llama-style families share (dense Llama/Mistral/Qwen, and the MoE families that
keep that attention: Qwen2/3-MoE, Mixtral, OLMoE, GLM-4.5, MiniMax-M2, ERNIE-4.5), with tensor parallelism.

Parameter names are the llama / gpt-fast mp names (`tok_embeddings`, `layers.{i}.attention.wq`,
`attention_norm`, `ffn_norm`, `feed_forward`, `norm`, `output`); a family supplies each layer's
feed-forward module. Numerics follow transformers: RMSNorm in float32, rotate-half RoPE on the first
`rotary_dim` dims of each head (or, `rope_interleaved`, on adjacent pairs in float32), float32 softmax. Shapes: B batch, S new tokens, T cached positions,
H local query heads, K local KV heads, D head_dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ckpttool.errors import InputError
from ckpttool.model.lm import VocabParallelLM
from ckpttool.model.norms import GemmaRMSNorm, RMSNorm
from ckpttool.model.parallel import Linear, ParallelContext

ROPE_TYPES = ("default", "linear", "llama3")
"""the rope types rope_inv_freq implements"""
QK_NORMS = ("none", "head", "full")
"""q/k RMSNorm: none; "head" over each head's D values (Qwen3, GLM); "full" over the whole projection,
all heads at once (OLMoE, MiniMax-M2), which a sharded model reduces across ranks"""


@dataclass(kw_only=True, slots=True, frozen=True)
class DecoderShape:
    """What the shared decoder needs of a family's config."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    qkv_bias: bool
    o_bias: bool
    qk_norm: str
    norm_eps: float
    inv_freq: tuple[float, ...]  # RoPE inverse frequencies (rotary_dim / 2 of them), after any scaling
    attention_scaling: float
    sliding_windows: tuple[int | None, ...]  # per layer
    tie_word_embeddings: bool
    fp8: bool
    clip_qkv: float | None = None
    rope_interleaved: bool = False
    """RoPE on adjacent pairs (x0, x1), (x2, x3)... in float32 (ERNIE-4.5, Llama-4), not on the two halves of each head"""
    lm_head_bias: bool = False
    attention_chunks: tuple[int | None, ...] = ()
    """per layer: attention only within aligned chunks of this many positions (Llama-4); empty: none"""
    gemma_norms: bool = False  # every RMSNorm scales by 1 + weight (model/norms.GemmaRMSNorm: MiniMax-M3)

    def norm(self, dim: int, dtype: torch.dtype) -> RMSNorm:
        return (GemmaRMSNorm if self.gemma_norms else RMSNorm)(dim, self.norm_eps, dtype)

    @property
    def rotary_dim(self) -> int:
        return 2 * len(self.inv_freq)


def rope_inv_freq(rope, head_dim: int, partial_rotary_factor: float = 1.0) -> tuple[torch.Tensor, float]:
    """transformers' default / linear / llama3 RoPE inverse frequencies (float32) and attention scaling,
    over the first int(head_dim * partial_rotary_factor) dims. `rope` is a families.base.Rope, read
    with types=ROPE_TYPES."""
    params, theta, kind = rope.params, rope.theta, rope.type
    dim = int(head_dim * partial_rotary_factor)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if kind == "llama3":
        factor, low, high = float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    raise AssertionError(kind)  # read_rope refused every other type


def sliding_windows(raw: dict, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's attention window, as transformers reads `sliding_window`, `use_sliding_window` and
    `layer_types` (a window of 0 or null is no window)."""
    window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    types = raw.get("layer_types") or ["sliding_attention" if window else "full_attention"] * num_layers
    return tuple(int(window) if t == "sliding_attention" and window else None for t in types)


class DenseLinear(Linear):
    """Linear with an optional bias. Row-parallel (`row_ctx` given): partial products are all-reduced
    and the (replicated) bias is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, fp8: bool, bias: bool = False,
                 row_ctx: ParallelContext | None = None):
        super().__init__(in_features, out_features, dtype, fp8)
        self.row_ctx = row_ctx
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_ctx is None:
            return F.linear(x, self.dense_weight(), self.bias)
        y = self.row_ctx.all_reduce(F.linear(x, self.dense_weight()))
        return y if self.bias is None else y + self.bias


class FeedForward(nn.Module):
    """SwiGLU MLP (w1 gate, w3 up, w2 down). With `ctx` it is tensor-parallel (w1/w3 column, w2 row,
    all-reduced); without, it is whole on this rank (a routed expert). `swiglu` (alpha, limit): gpt-oss's
    clamped activation instead of SiLU, (up + 1) * gate * sigmoid(alpha * gate) (MiniMax-M3)."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, fp8: bool, *, ctx: ParallelContext | None,
                 bias: bool = False, swiglu: tuple[float, float] | None = None):
        super().__init__()
        local = inter if ctx is None else ctx.split(inter, "intermediate_size")
        self.w1 = DenseLinear(hidden, local, dtype, fp8, bias)
        self.w3 = DenseLinear(hidden, local, dtype, fp8, bias)
        self.w2 = DenseLinear(local, hidden, dtype, fp8, bias, row_ctx=ctx)
        self.swiglu = swiglu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x), self.w3(x)
        if self.swiglu is None:
            return self.w2(F.silu(gate) * up)
        alpha, limit = self.swiglu
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return self.w2((up + 1.0) * (gate * torch.sigmoid(gate * alpha)))


class ParallelRMSNorm(RMSNorm):
    """RMSNorm over a dimension cut across ranks: the mean of squares is summed over every rank's
    slice (all-reduce) before normalising the local slice."""

    def __init__(self, local_dim: int, full_dim: int, eps: float, dtype: torch.dtype, ctx: ParallelContext):
        super().__init__(local_dim, eps, dtype)
        self.full_dim, self.ctx = full_dim, ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        sq = self.ctx.all_reduce(h.pow(2).sum(-1, keepdim=True))
        h = h * torch.rsqrt(sq / self.full_dim + self.eps)
        return self.weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...): the rotation of interleaved RoPE."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def apply_rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE over the whole head, in float32 (cos/sin repeat each frequency twice)."""
    return (x.float() * cos + rotate_pairs(x).float() * sin).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of each head; the rest pass through (partial rotary)."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)


def kv_cache(module: nn.Module, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """Zeroed `k_cache` and `v_cache` buffers [B, T, K, D] on an attention module (not saved)."""
    module.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
    module.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)


def attend_cached(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int,
                  mask: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Cache k, v [B, S, K, D] at start_pos.. in `attn`'s kv_cache, attend with q [B, S, H, D] (each KV head serving
    n_heads // n_kv_heads query heads, scores times `attn.scale`): [B, S, H * D], before the output projection."""
    bsz, seqlen = q.shape[:2]
    end = start_pos + seqlen
    attn.k_cache[:bsz, start_pos:end] = k
    attn.v_cache[:bsz, start_pos:end] = v
    rep = attn.n_heads // attn.n_kv_heads
    keys = attn.k_cache[:bsz, :end].repeat_interleave(rep, dim=2)  # [B, T, H, D]
    values = attn.v_cache[:bsz, :end].repeat_interleave(rep, dim=2)
    scores = torch.einsum("bshd,bthd->bhst", q, keys) * attn.scale + mask  # [B, H, S, T]
    if sinks is not None:  # one more logit per head that takes probability and is dropped (MiMo)
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(bsz, -1, seqlen, 1)
        probs = torch.cat([scores, sink], dim=-1).float().softmax(dim=-1)[..., :-1].to(q.dtype)
    else:
        probs = scores.float().softmax(dim=-1).to(q.dtype)
    return torch.einsum("bhst,bthd->bshd", probs, values).reshape(bsz, seqlen, -1)


class Attention(nn.Module):
    def __init__(self, s: DecoderShape, ctx: ParallelContext, dtype: torch.dtype):
        super().__init__()
        d = s.head_dim
        self.n_heads = ctx.split(s.heads, "num_attention_heads")
        # fewer KV heads than ranks: each rank holds the one KV head its query heads use
        self.n_kv_heads = max(1, s.kv_heads // ctx.world_size)
        if s.kv_heads < ctx.world_size and ctx.world_size % s.kv_heads:
            raise InputError(f"num_key_value_heads ({s.kv_heads}) neither divides nor is divided by mp={ctx.world_size}")
        if s.qk_norm == "full" and s.kv_heads < ctx.world_size:
            raise InputError(f"a k norm over all {s.kv_heads} KV heads cannot be computed from replicated heads "
                             f"at mp={ctx.world_size}", fix="choose an --mp that divides num_key_value_heads")
        self.head_dim, self.scale, self.clip = d, d ** -0.5, s.clip_qkv
        self.wq = DenseLinear(s.hidden_size, self.n_heads * d, dtype, s.fp8, s.qkv_bias)
        self.wk = DenseLinear(s.hidden_size, self.n_kv_heads * d, dtype, s.fp8, s.qkv_bias)
        self.wv = DenseLinear(s.hidden_size, self.n_kv_heads * d, dtype, s.fp8, s.qkv_bias)
        self.wo = DenseLinear(self.n_heads * d, s.hidden_size, dtype, s.fp8, s.o_bias, row_ctx=ctx)
        self.qk_norm, self.interleaved = s.qk_norm, s.rope_interleaved
        self.register_parameter("sinks", None)  # a family's attention may give each local head a sink logit
        if s.qk_norm == "head":
            self.q_norm = s.norm(d, dtype)
            self.k_norm = s.norm(d, dtype)
        elif s.qk_norm == "full":
            self.q_norm = ParallelRMSNorm(self.n_heads * d, s.heads * d, s.norm_eps, dtype, ctx)
            self.k_norm = ParallelRMSNorm(self.n_kv_heads * d, s.kv_heads * d, s.norm_eps, dtype, ctx)

    def setup_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device: torch.device) -> None:
        kv_cache(self, (batch, max_seq_len, self.n_kv_heads, self.head_dim), dtype, device)

    def forward(self, x: torch.Tensor, start_pos: int, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q = q.view(bsz, seqlen, self.n_heads, self.head_dim)  # [B, S, H, D]
        k = k.view(bsz, seqlen, self.n_kv_heads, self.head_dim)  # [B, S, K, D]
        v = v.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.interleaved:
            cos, sin = cos[:, None, :], sin[:, None, :]
            q, k = apply_rope_pairs(q, cos, sin), apply_rope_pairs(k, cos, sin)
        else:
            cos, sin = cos[:, None, :].to(q.dtype), sin[:, None, :].to(q.dtype)  # [S, 1, rotary_dim]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.attend(q, k, v, start_pos, mask)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int,
               mask: torch.Tensor) -> torch.Tensor:
        """Cache k, v [B, S, K, D] at start_pos.., attend with q [B, S, H, D] and project out."""
        return self.wo(attend_cached(self, q, k, v, start_pos, mask, self.sinks))


class Block(nn.Module):
    def __init__(self, s: DecoderShape, ctx: ParallelContext, dtype: torch.dtype, feed_forward: nn.Module,
                 attention: nn.Module | None = None):
        super().__init__()
        self.attention_norm = s.norm(s.hidden_size, dtype)
        self.attention = Attention(s, ctx, dtype) if attention is None else attention
        self.ffn_norm = s.norm(s.hidden_size, dtype)
        self.feed_forward = feed_forward

    def forward(self, x, start_pos, cos, sin, mask):
        x = x + self.attention(self.attention_norm(x), start_pos, cos, sin, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Decoder(VocabParallelLM):
    """Blocks between model/lm.py's embedding and head. `feed_forward(i)` builds layer i's feed-forward module,
    `attention(i)` (where given) its attention."""

    def __init__(self, s: DecoderShape, ctx: ParallelContext, dtype: torch.dtype,
                 feed_forward: Callable[[int], nn.Module], attention: Callable[[int], nn.Module] | None = None):
        super().__init__(ctx, s.vocab_size, s.hidden_size, s.norm(s.hidden_size, dtype), dtype,
                         tie_word_embeddings=s.tie_word_embeddings, head_bias=s.lm_head_bias)
        self.shape = s
        self.layers = nn.ModuleList(Block(s, ctx, dtype, feed_forward(i), None if attention is None else attention(i))
                                    for i in range(s.num_layers))

    def setup_caches(self, batch: int, max_seq_len: int) -> None:
        self.setup_rope(max_seq_len, self.shape.inv_freq, self.shape.attention_scaling,
                        interleaved=self.shape.rope_interleaved)
        for block in self.layers:
            block.attention.setup_cache(batch, max_seq_len, self.dtype, self.tok_embeddings.weight.device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int = 0, *, all_positions: bool = False) -> torch.Tensor:
        """tokens: [B, S] at positions start_pos.. -> float32 logits [B, V] (last position) or [B, S, V]."""
        end = self.positions(tokens, start_pos)
        h = self.tok_embeddings(tokens)
        cos, sin = self.cos[start_pos:end], self.sin[start_pos:end]
        q_pos = torch.arange(start_pos, end, device=tokens.device)[:, None]
        k_pos = torch.arange(end, device=tokens.device)[None, :]
        kinds = list(zip(self.shape.sliding_windows, self.shape.attention_chunks or [None] * len(self.layers)))
        masks = {}
        for window, chunk in set(kinds):
            allowed = k_pos <= q_pos
            if window is not None:
                allowed &= q_pos - k_pos < window
            if chunk is not None:
                allowed &= q_pos // chunk == k_pos // chunk
            masks[window, chunk] = torch.zeros(allowed.shape, dtype=h.dtype, device=h.device).masked_fill(
                ~allowed, float("-inf"))
        for block, kind in zip(self.layers, kinds):
            h = block(h, start_pos, cos, sin, masks[kind])
        return self.logits(h, all_positions)
