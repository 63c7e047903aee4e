"""Greedy decoding with the KV cache, and the teacher-forced logits a reference run is compared on."""

from __future__ import annotations

import torch
from torch import nn


def greedy_generate(model: nn.Module, prompt_ids: list[int], max_new_tokens: int,
                    eos_ids: tuple[int, ...] = ()) -> tuple[list[int], torch.Tensor]:
    """Prefill the prompt, then one token per step. Returns the new ids (an EOS included, then stop)
    and the float32 logits that chose each of them: [len(new ids), vocab]. Every rank sees the same
    gathered logits, so every rank picks the same token."""
    device = model.embed.weight.device
    model.setup_caches(1, len(prompt_ids) + max_new_tokens)
    tokens = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    start, generated, step_logits = 0, [], []
    for _ in range(max_new_tokens):
        logits = model(tokens[:, start:], start)  # [1, vocab]
        step_logits.append(logits[0].cpu())
        next_id = int(logits[0].argmax())
        generated.append(next_id)
        if next_id in eos_ids:
            break
        start = tokens.shape[1]
        tokens = torch.cat([tokens, torch.tensor([[next_id]], device=device)], dim=1)
    if not step_logits:
        return [], torch.empty(0, model.args.vocab_size)
    return generated, torch.stack(step_logits)


def teacher_forced_logits(model: nn.Module, prompt_ids: list[int], generated: list[int]) -> torch.Tensor:
    """One forward pass over prompt + generated[:-1]: the logits at the positions that chose each
    generated id, [len(generated), vocab], comparable row for row with greedy_generate's."""
    sequence = prompt_ids + generated[:-1]
    model.setup_caches(1, len(sequence))
    tokens = torch.tensor([sequence], dtype=torch.long, device=model.embed.weight.device)
    logits = model(tokens, 0, all_positions=True)[0]  # [len(sequence), vocab]
    return logits[len(prompt_ids) - 1:].cpu()
