"""Writing tiny real checkpoints for the demo, the tests and the benchmarks: safetensors shards with an
index, config.json and generation_config.json, and a working WordLevel tokenizer.

numpy only (`ckpttool demo` runs on the torch-free core install): BF16 and FP8 tensors are numpy
arrays of their bits (`Array`), written by `save_arrays`; builders that take torch tensors (gpt-oss,
used by tests) pass them to `write_shards` as they are."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import torch

FP8_MAX = 448.0


class Array(NamedTuple):
    """A tensor as safetensors stores it: its dtype code and a numpy array of its bits."""

    dtype: str  # "BF16" (uint16 bits), "F8_E4M3" (uint8 bits), "F32"
    data: np.ndarray


def bf16(x: np.ndarray) -> Array:
    """float32 -> BF16, rounded to nearest even (as torch's .to(torch.bfloat16))."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return Array("BF16", ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16))


def bf16_to_f32(a: Array) -> np.ndarray:
    return (a.data.astype(np.uint32) << 16).view(np.float32)


def fp8_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 within +-448 -> float8_e4m3fn codes, rounded to nearest even (torch's conversion)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    sign = ((u >> 24) & 0x80).astype(np.uint8)
    a = u & 0x7FFFFFFF
    absx = a.view(np.float32)
    # normals (>= 2^-6): drop 20 of float32's 23 mantissa bits with round-half-even, rebias 127 -> 7
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20).astype(np.int64) - ((127 - 7) << 3)
    # subnormals: multiples of 2^-9 (8 * 2^-9 is the smallest normal, code 8)
    sub = np.rint(absx * np.float32(512.0)).astype(np.int64)
    return (np.where(absx < np.float32(2.0 ** -6), sub, normal).astype(np.uint8) | sign)


def quantize_fp8_block(w: np.ndarray, block: int = 128) -> tuple[Array, Array]:
    """float32 [M, N] -> (F8_E4M3 codes, F32 scale [ceil(M/b), ceil(N/b)]), scale = amax / 448 per
    block, 1.0 for an all-zero block: the bits of kernels.fp8.quantize_fp8_block (tests compare)."""
    rows, cols = w.shape
    mb, nb = -(-rows // block), -(-cols // block)
    padded = np.zeros((mb * block, nb * block), dtype=np.float32)
    padded[:rows, :cols] = w
    blocks = padded.reshape(mb, block, nb, block)
    amax = np.abs(blocks).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)
    q = (blocks / scale[:, None, :, None]).reshape(mb * block, nb * block)[:rows, :cols]
    return Array("F8_E4M3", fp8_e4m3(q)), Array("F32", scale)


# safetensors' own order (its Dtype enum, descending): what safetensors.torch.save_file writes
_SAVE_ORDER = ("U64", "I64", "F64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "F8_E4M3", "F8_E5M2", "I8", "U8",
               "BOOL")


def save_arrays(tensors: dict[str, Array], path: Path, metadata: dict[str, str]) -> None:
    """One safetensors file laid out as safetensors.torch.save_file lays it out: tensors ordered by
    dtype (widest first), then name; contiguous offsets; header padded with spaces to 8 bytes."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    order = sorted(tensors, key=lambda n: (_SAVE_ORDER.index(tensors[n].dtype), n))
    for name in order:
        t = tensors[name]
        header[name] = {"dtype": t.dtype, "shape": list(t.data.shape), "data_offsets": [offset, offset + t.data.nbytes]}
        offset += t.data.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name in order:
            f.write(np.ascontiguousarray(tensors[name].data).tobytes())

_WORDS = ("the a an of to in is it and that for on with as was at by be this from or are not have but "
          "model weight shard expert layer token ckpt tool convert check hello world").split()


def write_shards(dst: Path, files: list[dict[str, torch.Tensor]] | list[dict[str, Array]], names: list[str]) -> None:
    """Each dict (of torch tensors, or of numpy `Array`s) as one safetensors shard, plus
    model.safetensors.index.json with its total_size."""
    weight_map, total = {}, 0
    for part, fname in zip(files, names):
        if all(isinstance(t, Array) for t in part.values()):
            save_arrays(part, dst / fname, {"format": "pt"})
        else:
            from safetensors.torch import save_file

            save_file(part, str(dst / fname), metadata={"format": "pt"})
        for name, t in part.items():
            weight_map[name] = fname
            total += t.data.nbytes if isinstance(t, Array) else t.numel() * t.element_size()
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
