"""Writing tiny real checkpoints for the demo, the tests and the benchmarks: safetensors shards with an
index, config.json and generation_config.json, and a working WordLevel tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_WORDS = ("the a an of to in is it and that for on with as was at by be this from or are not have but "
          "model weight shard expert layer token ckpt tool convert check hello world").split()


def write_shards(dst: Path, files: list[dict[str, torch.Tensor]], names: list[str]) -> None:
    """Each dict as one safetensors shard, plus model.safetensors.index.json with its total_size."""
    from safetensors.torch import save_file

    weight_map, total = {}, 0
    for part, fname in zip(files, names):
        save_file(part, str(dst / fname), metadata={"format": "pt"})
        for name, t in part.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_configs(dst: Path, raw: dict, quantization_config: dict | None, generation: dict) -> None:
    """config.json (BF16, with the publisher's quantization_config if any) and generation_config.json."""
    config = dict(raw, torch_dtype="bfloat16")
    if quantization_config is not None:
        config["quantization_config"] = dict(quantization_config)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    (dst / "generation_config.json").write_text(json.dumps(generation, indent=2))


def write_tokenizer(dst: Path, vocab_size: int) -> None:
    """A real WordLevel tokenizer (tokenizer.json + tokenizer_config.json) that transformers loads."""
    tokens = ["<bos>", "<eos>", "<unk>", *_WORDS]
    tokens += [f"w{i}" for i in range(vocab_size - len(tokens))]
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, t in enumerate(tokens[:3])],
        "normalizer": {"type": "Lowercase"}, "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {t: i for i, t in enumerate(tokens)}, "unk_token": "<unk>"},
    }
    (dst / "tokenizer.json").write_text(json.dumps(tokenizer))
    (dst / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "unk_token": "<unk>", "add_bos_token": True, "model_max_length": 1024,
    }, indent=2))
