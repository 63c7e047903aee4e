"""Dense llama / mistral / qwen2 / qwen3 decoder with tensor parallelism, for verify.

Parameter names are the dense mp names of families/dense/spec.py, so `model{i}-mp{N}.safetensors` loads
into `DenseTransformer(args, ParallelContext(i, N))` one to one. Numerics follow transformers (RMSNorm
in float32, rotate-half RoPE, float32 softmax). Shapes: B batch, S new tokens, T cached positions,
H local query heads, K local KV heads, D head_dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ckpttool.errors import InputError
from ckpttool.families.base import eos_ids, read_rope
from ckpttool.families.dense.spec import DenseConfig
from ckpttool.formats import declares_fp8_block
from ckpttool.model.norms import RMSNorm
from ckpttool.model.parallel import Linear, ParallelContext, ParallelEmbedding


@dataclass(kw_only=True, slots=True, frozen=True)
class DenseArgs:
    cfg: DenseConfig
    norm_eps: float
    inv_freq: tuple[float, ...]  # RoPE inverse frequencies, after any rope scaling
    attention_scaling: float
    sliding_windows: tuple[int | None, ...]  # per layer
    fp8: bool
    eos_token_ids: tuple[int, ...]

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def n_layers(self) -> int:
        return self.cfg.num_hidden_layers

    @classmethod
    def from_hf_config(cls, raw: dict, source: object = "config.json") -> "DenseArgs":
        cfg = DenseConfig.from_dict(raw, source)
        if raw.get("hidden_act", "silu") != "silu":
            raise InputError(f"hidden_act {raw['hidden_act']!r} is not supported", file=source,
                             fix="verify's dense model uses SiLU-gated MLPs")
        inv_freq, scaling = _rope(raw, cfg.head_dim, source)
        window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        types = raw.get("layer_types") or ["sliding_attention" if window else "full_attention"] * cfg.num_hidden_layers
        return cls(cfg=cfg, norm_eps=float(raw.get("rms_norm_eps", 1e-6)), inv_freq=tuple(inv_freq.tolist()),
                   attention_scaling=scaling,
                   sliding_windows=tuple(int(window) if t == "sliding_attention" and window else None for t in types),
                   fp8=declares_fp8_block(raw.get("quantization_config"), source),
                   eos_token_ids=eos_ids(raw))


def _rope(raw: dict, dim: int, source: object) -> tuple[torch.Tensor, float]:
    """transformers' default / linear / llama3 RoPE inverse frequencies (float32) and attention scaling."""
    parsed = read_rope(raw, source, default_theta=10000.0, types=("default", "linear", "llama3"))
    rope, theta, kind = parsed.params, parsed.theta, parsed.type
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(rope["factor"]), 1.0
    if kind == "llama3":
        factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_len = float(rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    raise AssertionError(kind)  # read_rope refused every other type


class DenseLinear(Linear):
    """Linear with an optional bias. Row-parallel (`ctx` given): partial products are all-reduced
    and the (replicated) bias is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, fp8: bool, bias: bool,
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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, args: DenseArgs, ctx: ParallelContext, dtype: torch.dtype):
        super().__init__()
        c = args.cfg
        d = c.head_dim
        self.n_heads = ctx.split(c.num_attention_heads, "num_attention_heads")
        # fewer KV heads than ranks: each rank holds the one KV head its query heads use
        self.n_kv_heads = max(1, c.num_key_value_heads // ctx.world_size)
        if c.num_key_value_heads < ctx.world_size and ctx.world_size % c.num_key_value_heads:
            raise InputError(f"num_key_value_heads ({c.num_key_value_heads}) neither divides nor is divided by "
                             f"mp={ctx.world_size}")
        self.head_dim, self.scale = d, d ** -0.5
        self.wq = DenseLinear(c.hidden_size, self.n_heads * d, dtype, args.fp8, c.qkv_bias)
        self.wk = DenseLinear(c.hidden_size, self.n_kv_heads * d, dtype, args.fp8, c.qkv_bias)
        self.wv = DenseLinear(c.hidden_size, self.n_kv_heads * d, dtype, args.fp8, c.qkv_bias)
        self.wo = DenseLinear(self.n_heads * d, c.hidden_size, dtype, args.fp8, c.o_bias, row_ctx=ctx)
        if c.qk_norm:
            self.q_norm = RMSNorm(d, args.norm_eps, dtype)
            self.k_norm = RMSNorm(d, args.norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None

    def setup_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (batch, max_seq_len, self.n_kv_heads, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def forward(self, x: torch.Tensor, start_pos: int, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        end = start_pos + seqlen
        q = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)  # [B, S, H, D]
        k = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)  # [B, S, K, D]
        v = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos[:, None, :].to(q.dtype), sin[:, None, :].to(q.dtype)  # [S, 1, D]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        self.k_cache[:bsz, start_pos:end] = k
        self.v_cache[:bsz, start_pos:end] = v
        rep = self.n_heads // self.n_kv_heads
        keys = self.k_cache[:bsz, :end].repeat_interleave(rep, dim=2)  # [B, T, H, D]
        values = self.v_cache[:bsz, :end].repeat_interleave(rep, dim=2)
        scores = torch.einsum("bshd,bthd->bhst", q, keys) * self.scale + mask  # [B, H, S, T]
        probs = scores.float().softmax(dim=-1).to(q.dtype)
        out = torch.einsum("bhst,bthd->bshd", probs, values)
        return self.wo(out.reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, args: DenseArgs, ctx: ParallelContext, dtype: torch.dtype):
        super().__init__()
        c = args.cfg
        inter = ctx.split(c.intermediate_size, "intermediate_size")
        self.w1 = DenseLinear(c.hidden_size, inter, dtype, args.fp8, c.mlp_bias)
        self.w3 = DenseLinear(c.hidden_size, inter, dtype, args.fp8, c.mlp_bias)
        self.w2 = DenseLinear(inter, c.hidden_size, dtype, args.fp8, c.mlp_bias, row_ctx=ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, args: DenseArgs, ctx: ParallelContext, dtype: torch.dtype):
        super().__init__()
        self.attention_norm = RMSNorm(args.cfg.hidden_size, args.norm_eps, dtype)
        self.attention = Attention(args, ctx, dtype)
        self.ffn_norm = RMSNorm(args.cfg.hidden_size, args.norm_eps, dtype)
        self.feed_forward = FeedForward(args, ctx, dtype)

    def forward(self, x, start_pos, cos, sin, mask):
        x = x + self.attention(self.attention_norm(x), start_pos, cos, sin, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class DenseTransformer(nn.Module):
    """Vocabulary-parallel embedding, blocks, final norm and a vocabulary-parallel output whose
    slices are all-gathered; with tied embeddings the output reuses the embedding's rows."""

    def __init__(self, args: DenseArgs, ctx: ParallelContext, *, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        c = args.cfg
        self.args, self.ctx, self.dtype = args, ctx, dtype
        self.tok_embeddings = ParallelEmbedding(ctx, c.vocab_size, c.hidden_size, dtype)
        self.layers = nn.ModuleList(Block(args, ctx, dtype) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, args.norm_eps, dtype)
        if not c.tie_word_embeddings:
            self.output = Linear(c.hidden_size, ctx.split(c.vocab_size, "vocab_size"), dtype)
        self.max_seq_len = 0

    @property
    def embed(self) -> ParallelEmbedding:
        """The name model.generate looks for (the DeepSeek model's)."""
        return self.tok_embeddings

    def setup_caches(self, batch: int, max_seq_len: int) -> None:
        device = self.tok_embeddings.weight.device
        self.max_seq_len = max_seq_len
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), torch.tensor(self.args.inv_freq))
        emb = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", (emb.cos() * self.args.attention_scaling).to(device), persistent=False)
        self.register_buffer("sin", (emb.sin() * self.args.attention_scaling).to(device), persistent=False)
        for block in self.layers:
            block.attention.setup_cache(batch, max_seq_len, self.dtype, device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int = 0, *, all_positions: bool = False) -> torch.Tensor:
        """tokens: [B, S] at positions start_pos.. -> float32 logits [B, V] (last position) or [B, S, V]."""
        seqlen = tokens.shape[1]
        end = start_pos + seqlen
        if end > self.max_seq_len:
            raise ValueError(f"position {end} exceeds the cache of {self.max_seq_len}; call setup_caches")
        h = self.tok_embeddings(tokens)
        cos, sin = self.cos[start_pos:end], self.sin[start_pos:end]
        q_pos = torch.arange(start_pos, end, device=tokens.device)[:, None]
        k_pos = torch.arange(end, device=tokens.device)[None, :]
        masks = {}
        for window in set(self.args.sliding_windows):
            allowed = k_pos <= q_pos
            if window is not None:
                allowed &= q_pos - k_pos < window
            masks[window] = torch.zeros(allowed.shape, dtype=h.dtype, device=h.device).masked_fill(~allowed, float("-inf"))
        for block, window in zip(self.layers, self.args.sliding_windows):
            h = block(h, start_pos, cos, sin, masks[window])
        h = self.norm(h)
        if not all_positions:
            h = h[:, -1]
        weight = self.tok_embeddings.weight if self.args.cfg.tie_word_embeddings else self.output.dense_weight()
        return self.ctx.all_gather_last_dim(F.linear(h, weight)).float()
