"""The parts of a linear-attention layer (Gated DeltaNet in Qwen3-Next and Qwen3.5, KDA in Kimi-Linear) as
transformers' own torch fallback computes them, with the state a decode step carries.

- `ShortConv`: the depthwise causal convolution over the projected q, k and v channels (SiLU after it).
  Each channel is independent, so a rank convolves only its own heads' channels. Its state is the last
  `kernel - 1` inputs of each channel; a step sees them before its own tokens, zeros before the first.
- `delta_rule`: the gated delta rule, token by token in float32 (transformers'
  `torch_recurrent_gated_delta_rule` and `recurrent_kimi_delta_attention`). transformers runs its chunked
  form over a prompt and this one per decode step; the two are the same sum in another order (they agree
  to float32 rounding), and a prompt of a verify run is short, so this form serves both.

Shapes: B batch, S new tokens, H local value heads, K key head dim, V value head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def l2norm(x: torch.Tensor, eps: float = 1e-6, *, divide: bool = False) -> torch.Tensor:
    """x / ||x|| over the last dim, eps inside the root: as x * rsqrt (Qwen's form) or x / sqrt (Kimi's)."""
    sq = (x * x).sum(dim=-1, keepdim=True) + eps
    return x / torch.sqrt(sq) if divide else x * torch.rsqrt(sq)


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor) -> torch.Tensor:
    """q, k [B, S, H, K] (normalised and scaled), v [B, S, H, V], log_decay [B, S, H, 1] (one gate per head,
    Gated DeltaNet) or [B, S, H, K] (per key channel, KDA), beta [B, S, H], all float32; `state` [B, H, K, V]
    float32 is updated in place. Returns the outputs [B, S, H, V] in float32."""
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    s = state
    for t in range(q.shape[1]):
        s = s * log_decay[:, t].exp().unsqueeze(-1)  # [B, H, K, V] decayed per head or per key channel
        remembered = (s * k[:, t].unsqueeze(-1)).sum(dim=-2)  # [B, H, V]: what the state recalls for k_t
        delta = (v[:, t] - remembered) * beta[:, t].unsqueeze(-1)
        s = s + k[:, t].unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, t] = (s * q[:, t].unsqueeze(-1)).sum(dim=-2)
    state.copy_(s)
    return out


class ShortConv(nn.Module):
    """Depthwise causal convolution of `channels` inputs over the last `kernel` positions, then SiLU; the
    weight is [channels, 1, kernel] as nn.Conv1d stores it."""

    def __init__(self, channels: int, kernel: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=dtype), requires_grad=False)

    def setup_cache(self, batch: int, device: torch.device) -> None:
        channels, _, kernel = self.weight.shape
        self.register_buffer("conv_state", torch.zeros(batch, channels, kernel - 1, dtype=self.weight.dtype,
                                                        device=device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S, C] -> [B, S, C]; the state moves on by S positions."""
        bsz, seqlen, channels = x.shape
        window = torch.cat([self.conv_state[:bsz], x.transpose(1, 2).to(self.weight.dtype)], dim=-1)
        self.conv_state[:bsz] = window[:, :, window.shape[-1] - self.conv_state.shape[-1]:]
        out = F.conv1d(window, self.weight, groups=channels)  # [B, C, S]
        return F.silu(out).to(x.dtype).transpose(1, 2)
