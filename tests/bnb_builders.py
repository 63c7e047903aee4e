"""Tiny bitsandbytes checkpoints written by bitsandbytes and transformers, and bitsandbytes' own dequantization as
the oracle.

`saved`: transformers quantizes a tiny BF16 model with BitsAndBytesConfig on the CPU (bitsandbytes 0.50's CPU
backend) and save_pretrained writes it: what a user downloads. `functional`: each linear weight quantized by
`bitsandbytes.functional.quantize_4bit` (any block size; transformers' config has no block size) and stored as
Linear4bit._save_to_state_dict stores it (`X.weight` and `X.weight.<key>` of QuantState.as_dict(packed=True)),
config.json's quantization_config from BitsAndBytesConfig.to_dict(). `by_hand`: the same layout from random bytes
and a quant state written here, for the GPU tests (no bitsandbytes there).

Oracle: QuantState.from_dict + functional.dequantize_4bit (what transformers' dequantize_bnb_weight calls) in the
output dtype, or int8_vectorwise_dequant then the cast. bitsandbytes' CPU kernels disagree with themselves in two
places (kernels/bnb_cpu.py's docstring): FP4's code 8 is -0.0 on its scalar path and in CUDA (+0.0 in its
table, its AVX-512 path and here; times the absmax), and its AVX-512 path reads the wrong absmax where a row is not whole blocks. So `dequant_4bit`
answers with the public function where the rows are whole blocks (FP4's -0.0 at code 8 read as +0.0), and with
its default backend's torch kernel (`_dequantize_4bit_compute`, the flat-block arithmetic every other path
shares) where they are not. (The absmax of a double-quant block can be negative, so code 8 gives -0.0 there.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from quant_builders import load_all, write_like

LINEAR = re.compile(r"model\.layers\.\d+\..*_proj\.weight")


def bnb_config(kind: str, **extra) -> dict:
    """config.json's quantization_config for `nf4`, `nf4-dq`, `fp4`, `fp4-dq` or `int8`, as transformers writes it."""
    from transformers import BitsAndBytesConfig

    if kind == "int8":
        cfg = BitsAndBytesConfig(load_in_8bit=True)
    else:
        qt, *dq = kind.split("-")
        cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=qt, bnb_4bit_use_double_quant=bool(dq),
                                 bnb_4bit_compute_dtype=torch.bfloat16)
    return {**cfg.to_dict(), **extra}


def saved(src: Path, dst: Path, kind: str) -> Path:
    """src (BF16) quantized by transformers + bitsandbytes on the CPU and saved by save_pretrained."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=BitsAndBytesConfig(**bnb_config(kind)),
                                                 dtype=torch.bfloat16, device_map="cpu")
    model.save_pretrained(dst)
    return dst


def functional(src: Path, dst: Path, kind: str, blocksize: int, pattern: re.Pattern = LINEAR) -> Path:
    """src (BF16) with every weight `pattern` matches quantized by bitsandbytes.functional.quantize_4bit in blocks
    of `blocksize`, stored as Linear4bit stores it."""
    import bitsandbytes.functional as F

    tensors, file_of = load_all(src)
    qt, *dq = kind.split("-")
    for name in [n for n in tensors if pattern.fullmatch(n)]:
        packed, state = F.quantize_4bit(tensors.pop(name), blocksize=blocksize, quant_type=qt,
                                        compress_statistics=bool(dq))
        for key, value in {"": packed, **{"." + k: v for k, v in state.as_dict(packed=True).items()}}.items():
            tensors[name + key], file_of[name + key] = value, file_of[name]
    write_like(src, dst, tensors, file_of)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = bnb_config(kind)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def by_hand(src: Path, dst: Path, kind: str, blocksize: int = 64, seed: int = 0, pattern: re.Pattern = LINEAR) -> Path:
    """src with every weight `pattern` matches replaced by random 4-bit codes and absmax in bitsandbytes' layout
    (double quant: random 8-bit absmax codes, a linear nested map, nested blocks of 256), written without it."""
    gen = torch.Generator().manual_seed(seed)
    tensors, file_of = load_all(src)
    qt, *dq = kind.split("-")
    from ckpttool.kernels.bnb_cpu import CODES

    for name in [n for n in tensors if pattern.fullmatch(n)]:
        w = tensors.pop(name)
        n = w.numel()
        blocks = -(-n // blocksize)
        stored = {"": torch.randint(0, 256, (n // 2, 1), dtype=torch.int32, generator=gen).to(torch.uint8),
                  ".quant_map": torch.from_numpy(CODES[qt].copy())}
        state = {"quant_type": qt, "blocksize": blocksize, "dtype": "bfloat16", "shape": list(w.shape)}
        if dq:
            stored[".absmax"] = torch.randint(0, 256, (blocks,), dtype=torch.int32, generator=gen).to(torch.uint8)
            stored[".nested_absmax"] = torch.rand(-(-blocks // 256), generator=gen) * 0.05
            stored[".nested_quant_map"] = torch.linspace(-1, 1, 256)
            state |= {"nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": 0.03125}
        else:
            stored[".absmax"] = torch.rand(blocks, generator=gen) * 0.1
        stored[f".quant_state.bitsandbytes__{qt}"] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)
        for key, value in stored.items():
            tensors[name + key], file_of[name + key] = value.contiguous(), file_of[name]
    write_like(src, dst, tensors, file_of)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": qt,
                                     "bnb_4bit_use_double_quant": bool(dq), "bnb_4bit_quant_storage": "uint8"}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def dequant_4bit(packed: torch.Tensor, state, dtype: torch.dtype, torch_kernel: bool = False) -> torch.Tensor:
    """bitsandbytes' dequantization of one 4-bit weight into `dtype` (see the module docstring for which path;
    `torch_kernel`: its default backend's always, which rounds BF16 subnormals where its AVX-512 path flushes them)."""
    import bitsandbytes.functional as F
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

    state.dtype = dtype
    absmax = (F.dequantize_blockwise(state.absmax, state.state2) + state.offset if state.nested else state.absmax).float()
    if state.shape[-1] % state.blocksize == 0 and state.shape[-1] % 16 == 0 and not torch_kernel:  # whole blocks
        out = F.dequantize_4bit(packed, state)
    else:
        compute = getattr(_dequantize_4bit_compute, "__wrapped__", _dequantize_4bit_compute)  # eager torch
        out = compute(packed.view(torch.uint8).reshape(-1), absmax, F.get_4bit_type(state.quant_type, device="cpu"),
                      state.blocksize, state.shape, dtype)
    if state.quant_type == "fp4":  # code 8: the table's +0.0 times the absmax, where bitsandbytes' scalar path
        codes = torch.stack((packed.reshape(-1) >> 4, packed.reshape(-1) & 15), dim=1).reshape(out.shape)  # has -0.0
        zero = torch.zeros(()) * absmax.repeat_interleave(state.blocksize)[: out.numel()].reshape(out.shape)
        out = torch.where(codes == 8, zero.to(dtype), out)
    return out


def dequant_int8(weight: torch.Tensor, scb: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    import bitsandbytes.functional as F

    return F.int8_vectorwise_dequant(weight, scb).to(dtype)


def oracle(dst: Path, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """bitsandbytes' dequantization of every quantized weight of `dst`, by its name."""
    import bitsandbytes.functional as F

    tensors, _ = load_all(dst)
    out = {}
    for name, t in tensors.items():
        if name + ".absmax" in tensors:
            state = F.QuantState.from_dict({k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")},
                                           device="cpu")
            out[name] = dequant_4bit(t, state, dtype)
        elif t.dtype == torch.int8:
            out[name] = dequant_int8(t, tensors[name[: -len("weight")] + "SCB"], dtype)
    return out
