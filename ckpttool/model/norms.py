"""RMSNorm as transformers computes it for Llama, Qwen and DeepSeek (gpt-oss has its own order), and Gemma's."""

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
