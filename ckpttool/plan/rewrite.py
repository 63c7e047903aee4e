"""The non-tensor outputs: rewritten config.json, the HF index, and files copied unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import math

from ckpttool.io.layout import INDEX_NAME, MANIFEST
from ckpttool.plan.types import OutFile, TensorPlan

TORCH_DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
_HANDLED = {"config.json", INDEX_NAME, MANIFEST}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".distcp")


def floating_dtype(tensors: list[TensorPlan]) -> str | None:
    """The floating dtype (BF16, F16, F32) holding most of the output's elements: what config.json's
    `dtype` says, since transformers loads every floating parameter in it with dtype="auto". An F32
    checkpoint with nothing to dequantize stays F32, so its config must say float32, not bfloat16."""
    elements: dict[str, int] = {}
    for t in tensors:
        if t.dtype in TORCH_DTYPE_NAMES:
            elements[t.dtype] = elements.get(t.dtype, 0) + math.prod(t.shape)
    return max(sorted(elements), key=elements.__getitem__) if elements else None


def rewrite_config(config: dict, *, dequantized: bool, dtype: str | None, mtp_key: str | None, mtp_dropped: bool,
                   explicit: Callable[[dict, object], dict] | None = None, source: object = "config.json") -> dict:
    """A config that tells the truth about the output: no quantization_config once dequantized,
    the dtype its tensors are in (`dtype`, from floating_dtype), no MTP layers counted once they are
    dropped, and (`explicit`, the family's Family.explicit_config) the routing and rope fields that
    transformers leaves to its class defaults, which engines read with defaults of their own."""
    config = dict(config) if explicit is None else explicit(config, source)
    if dequantized:
        config.pop("quantization_config", None)
        if dtype is not None:
            config["torch_dtype"] = TORCH_DTYPE_NAMES[dtype]
            if "dtype" in config:
                config["dtype"] = TORCH_DTYPE_NAMES[dtype]
    if mtp_dropped and mtp_key:  # also where config.json left the count to the class default
        *path, leaf = mtp_key.split(".")  # a wrapper's is in its text config: "text_config.num_..."
        inner = config
        for key in path:
            inner[key] = dict(inner[key])
            inner = inner[key]
        inner[leaf] = 0
    return config


def hf_index(files: list[OutFile], buffers: tuple[str, ...] = ()) -> dict:
    """model.safetensors.index.json as transformers 5 writes it: `total_parameters` (the elements of every
    tensor but those its model holds as buffers, named by `buffers`, the family's name endings; quantized
    weights count their stored elements and scales, as its FP8 layers hold them), `total_size` in bytes,
    and the weight map."""
    weight_map = {p.tensor.name: f.name for f in files for p in f.tensors}
    total = sum(p.end - p.start for f in files for p in f.tensors)
    parameters = sum(math.prod(p.tensor.shape) for f in files for p in f.tensors
                     if not any(p.tensor.name == b or p.tensor.name.endswith("." + b) for b in buffers))
    return {"metadata": {"total_parameters": parameters, "total_size": total, "format": "pt"},
            "weight_map": dict(sorted(weight_map.items()))}


def files_to_copy(src: Path, names: list[str] | None = None) -> list[str]:
    """Top-level files a loader needs beside the weights (tokenizer, generation config, chat
    templates, remote code, license): everything except weights and what the plan rewrites.
    `names`: the regular files at the top of `src`, where they are known without listing it (a hub repo)."""
    if names is None:
        names = [p.name for p in sorted(src.iterdir()) if p.is_file()]
    return [n for n in sorted(names) if not (n.startswith(".") or n in _HANDLED or n.endswith(_WEIGHT_SUFFIXES))]
