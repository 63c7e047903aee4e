"""RMSNorm as transformers computes it for Llama, Qwen and DeepSeek (gpt-oss has its own order), Gemma's
(1 + weight: MiniMax-M3, Qwen3-Next, Qwen3.5), and the gated form of the linear-attention layers."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Normalise in float32, cast back, then scale (transformers' order of operations)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm (MiniMax-M3's): normalise and scale by 1 + weight, both in float32, then cast."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's values, then a gate (Gated DeltaNet's output norm: norm before gate). With
    `float_weight` the weight multiplies in float32 (Kimi-Linear's), else after the cast back (Qwen's)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, *, gate: str = "silu", float_weight: bool = False):
        super().__init__()
        self.eps, self.float_weight = eps, float_weight
        self.gate = {"silu": torch.nn.functional.silu, "sigmoid": torch.sigmoid}[gate]
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight.float() * h if self.float_weight else self.weight * h.to(x.dtype)
        return (h * self.gate(z.float())).to(x.dtype)
