"""Tiny dense checkpoints saved by transformers itself, and transformers' greedy decoding as the oracle."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# Each exercises something different: GQA with kv heads >= and < mp, llama3 RoPE scaling, q/k/v
# biases with tied embeddings and a single KV head (replicated on every rank), qwen3's q/k norms and a
# head_dim that is not hidden/heads, mistral's sliding window shorter than the prompt.
TINY = {
    "llama": dict(cls="LlamaForCausalLM", config="LlamaConfig", vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                  tie_word_embeddings=False),
    "qwen2": dict(cls="Qwen2ForCausalLM", config="Qwen2Config", vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                  tie_word_embeddings=True),
    "qwen3": dict(cls="Qwen3ForCausalLM", config="Qwen3Config", vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=64, tie_word_embeddings=False),
    "mistral": dict(cls="MistralForCausalLM", config="MistralConfig", vocab_size=256, hidden_size=64,
                    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                    max_position_embeddings=64, sliding_window=4, tie_word_embeddings=False),
}
BLOCK_LLAMA = dict(cls="LlamaForCausalLM", config="LlamaConfig", vocab_size=256, hidden_size=256, intermediate_size=512,
                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                   max_position_embeddings=64, tie_word_embeddings=False)
"""a tiny llama whose widths 128-column groups and 128x128 blocks divide (the quantize and repack tests' model;
they override layers, KV heads or tying with `{**BLOCK_LLAMA, ...}`)"""
PROMPT = [3, 17, 42, 99, 7, 150]
NEW_TOKENS = 6


def build_hf(family: str, dst: Path, *, seed: int = 0, spec: dict | None = None) -> Path:
    """save_pretrained of a randomly initialised tiny model (BF16). Weights are drawn wider than the
    usual 0.02 so greedy decoding has clear winners rather than near-ties."""
    import transformers

    spec = dict(spec or TINY[family])
    cls, config_cls = getattr(transformers, spec.pop("cls")), getattr(transformers, spec.pop("config"))
    config = config_cls(**spec, initializer_range=0.25, bos_token_id=1, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a zero router bias would prove nothing
                b.copy_(0.3 * torch.randn_like(b))
    model.to(torch.bfloat16).save_pretrained(dst)
    return dst


def greedy_oracle(hf_dir: Path, prompt: list[int] = PROMPT, new_tokens: int = NEW_TOKENS) -> tuple[list[int], torch.Tensor]:
    """transformers' own greedy ids (and their logits) in float32 from the BF16 checkpoint."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


def config_of(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def stack_experts(tensors: dict[str, torch.Tensor], experts: int, block: str = "mlp",
                  leaves: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"), suffix: str = "weight",
                  stacked_suffix: str = "") -> dict[str, torch.Tensor]:
    """Per-expert tensors -> transformers 5's stacked form: `model.layers.L.mlp.experts.gate_up_proj`
    [E, 2I, H] (each expert's gate rows, then its up rows) and `down_proj` [E, H, I]. `suffix` /
    `stacked_suffix` pick the weights ("weight", "") or their FP8 scales ("weight_scale_inv", "_scale_inv")."""
    gate, up, down = leaves
    out = dict(tensors)
    layers = sorted({int(n.split(".")[2]) for n in tensors if f".{block}.experts.0.{gate}.{suffix}" in n})
    for layer in layers:
        p = f"model.layers.{layer}.{block}.experts."
        gate_up = [torch.cat([out.pop(f"{p}{e}.{gate}.{suffix}"), out.pop(f"{p}{e}.{up}.{suffix}")]) for e in range(experts)]
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj{stacked_suffix}"] = torch.stack(gate_up)
        out[f"model.layers.{layer}.mlp.experts.down_proj{stacked_suffix}"] = torch.stack(
            [out.pop(f"{p}{e}.{down}.{suffix}") for e in range(experts)])
    return out
