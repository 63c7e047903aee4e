"""The shell the bundled decoder-only models share around their layers: a vocabulary-parallel embedding, the
final norm, and a vocabulary-parallel output whose slices are all-gathered (tied embeddings reuse the
embedding's rows; ERNIE's head keeps a bias even then). A model subclasses `VocabParallelLM`, builds its
layers, calls `setup_rope` (where it has one set of rotary tables) when it sets up its caches, and `positions`
and `logits` around its layers in its forward; the `output` and `tok_embeddings` names are the mp checkpoint's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ckpttool.model.parallel import Linear, ParallelContext, ParallelEmbedding


def rope_angles(max_seq_len: int, inv_freq, *, interleaved: bool = False) -> torch.Tensor:
    """Float32 [max_seq_len, 2 * len(inv_freq)] on the CPU: each position times each frequency, the frequencies
    as two halves or, `interleaved`, each twice in a row (the rotary tables are its cos and sin)."""
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), torch.tensor(inv_freq))
    return angles.repeat_interleave(2, dim=-1) if interleaved else torch.cat([angles, angles], dim=-1)


class VocabParallelLM(nn.Module):
    def __init__(self, ctx: ParallelContext, vocab_size: int, hidden_size: int, norm: nn.Module, dtype: torch.dtype,
                 *, tie_word_embeddings: bool, head_bias: bool = False):
        super().__init__()
        self.ctx, self.dtype = ctx, dtype
        self.tie_word_embeddings, self.head_bias = tie_word_embeddings, head_bias
        self.tok_embeddings = ParallelEmbedding(ctx, vocab_size, hidden_size, dtype)
        self.norm = norm
        local_vocab = ctx.split(vocab_size, "vocab_size")
        if not tie_word_embeddings:
            self.output = Linear(hidden_size, local_vocab, dtype)
        if head_bias:
            if tie_word_embeddings:
                self.output = nn.Module()
            self.output.bias = nn.Parameter(torch.empty(local_vocab, dtype=dtype), requires_grad=False)
        self.max_seq_len = 0

    @property
    def embed(self) -> ParallelEmbedding:
        """The name model.generate looks for."""
        return self.tok_embeddings

    def positions(self, tokens: torch.Tensor, start_pos: int) -> int:
        """The end position of `tokens` [B, S] placed at start_pos, which the caches must hold."""
        end = start_pos + tokens.shape[1]
        if end > self.max_seq_len:
            raise ValueError(f"position {end} exceeds the cache of {self.max_seq_len}; call setup_caches")
        return end

    def setup_rope(self, max_seq_len: int, inv_freq, scaling: float, *, interleaved: bool = False) -> None:
        """The rotary tables `cos` and `sin` [max_seq_len, 2 * len(inv_freq)] times `scaling`, the frequencies as two
        halves or, `interleaved`, each twice in a row; and the length the caches are set up for."""
        self.max_seq_len = max_seq_len
        emb = rope_angles(max_seq_len, inv_freq, interleaved=interleaved)
        device = self.tok_embeddings.weight.device
        self.register_buffer("cos", (emb.cos() * scaling).to(device), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(device), persistent=False)

    def logits(self, h: torch.Tensor, all_positions: bool) -> torch.Tensor:
        """The final norm and the head over every rank's vocabulary: float32 [B, V] (last position) or [B, S, V]."""
        h = self.norm(h)
        if not all_positions:
            h = h[:, -1]
        weight = self.tok_embeddings.weight if self.tie_word_embeddings else self.output.dense_weight()
        bias = self.output.bias if self.head_bias else None
        return self.ctx.all_gather_last_dim(F.linear(h, weight, bias)).float()


def causal_mask(start_pos: int, end: int, like: torch.Tensor) -> torch.Tensor:
    """An additive [S, T] mask: 0 where a query at start_pos.. may see a key at 0..end-1, -inf elsewhere."""
    allowed = torch.arange(end, device=like.device)[None, :] <= torch.arange(start_pos, end, device=like.device)[:, None]
    return torch.zeros(allowed.shape, dtype=like.dtype, device=like.device).masked_fill(~allowed, float("-inf"))
