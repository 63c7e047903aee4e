"""safetensors dtype codes: each one's numpy carrier, size and torch dtype.

The carrier has the element's size (and is the element type itself where numpy has one): the CPU
data path moves and slices tensors as numpy arrays and never needs torch, whose import costs seconds
at every start. bf16 has no numpy dtype and is carried as uint16; FP8 codes as uint8.
"""

from __future__ import annotations

import functools
import importlib.util

import numpy as np

# dtype code -> (numpy carrier, torch dtype name)
_DTYPE_TABLE: dict[str, tuple[type, str]] = {
    "BOOL": (np.bool_, "bool"),
    "U8": (np.uint8, "uint8"),
    "I8": (np.int8, "int8"),
    "F8_E4M3": (np.uint8, "float8_e4m3fn"),
    "F8_E5M2": (np.uint8, "float8_e5m2"),
    "F8_E8M0": (np.uint8, "float8_e8m0fnu"),
    "I16": (np.int16, "int16"),
    "U16": (np.uint16, "uint16"),
    "F16": (np.float16, "float16"),
    "BF16": (np.uint16, "bfloat16"),
    "I32": (np.int32, "int32"),
    "U32": (np.uint32, "uint32"),
    "F32": (np.float32, "float32"),
    "I64": (np.int64, "int64"),
    "U64": (np.uint64, "uint64"),
    "F64": (np.float64, "float64"),
}
CARRIERS: dict[str, np.dtype] = {code: np.dtype(c) for code, (c, _) in _DTYPE_TABLE.items()}
ITEMSIZES: dict[str, int] = {code: c.itemsize for code, c in CARRIERS.items()}


def itemsize(dtype: str) -> int:
    return ITEMSIZES[dtype]


def torch_dtype(dtype: str):
    """The torch dtype of a safetensors code (torch imported on first use; F8_E8M0 is uint8 on a
    torch without float8_e8m0fnu)."""
    import torch

    return getattr(torch, _DTYPE_TABLE[dtype][1], torch.uint8)


@functools.lru_cache(maxsize=None)
def dtype_code(torch_dtype_) -> str | None:
    """The safetensors code of a torch dtype (the inverse of torch_dtype), or None. Cached: it is on every
    CUDA dequant call's path, where a small tensor's kernel takes less time than its host work."""
    name = str(torch_dtype_).removeprefix("torch.")
    return next((code for code, (_, n) in _DTYPE_TABLE.items() if n == name), None)


def torch_installed() -> bool:
    """Whether torch can be imported, without importing it (seconds of start-up): the core install
    has none, and the commands that need it say which extra brings it."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False
