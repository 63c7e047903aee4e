"""Strict weight loading shared by the bundled models: every parameter present, nothing extra, shapes
equal, dtypes compatible; and the comparison of loaded weights with their slices of a reference.

The sources are one `model{rank}-mp{N}.safetensors` (mp names, already sliced) or an HF checkpoint
directory loaded whole at mp=1 through a family's key table (families/*/weights.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ckpttool.errors import InputError
from ckpttool.io.checkpoint import Checkpoint
from ckpttool.io.safetensors import SafetensorsFile, TensorInfo, read_bytes, read_header, tensor_from_bytes
from ckpttool.formats import SCALE_SUFFIX
from ckpttool.kernels.fp8 import dequant_fp8_block
from ckpttool.model.parallel import Linear

_FLOAT_FILE_DTYPES = {"BF16", "F16", "F32"}
_FP8_FILE_DTYPES = {"F8_E4M3"}
_INT_FILE_DTYPES = {"I64", "I32", "I16", "I8", "U8"}  # integer tables (DeepSeek-V4's tid2eid: I32 on the hub, I64 from transformers)
MAX_LISTED = 8


def read_shard_header(path: Path) -> SafetensorsFile:
    """The header of one rank's shard; a missing shard is an error saying how to get it."""
    if not Path(path).is_file():
        raise InputError("model-parallel shard is missing", file=path,
                         fix="convert again with the same --mp, or pass the directory that holds every rank's file")
    return read_header(Path(path))


def load_mp_shard(model: nn.Module, path: Path, skip: Callable[[str], bool] | None = None) -> int:
    """Load one reference-layout shard into `model`, checking it against the model's parameters.
    Tensors `skip` names (parts the bundled model does not run, such as MTP layers) are left out of
    the strict check; returns how many there were."""
    path = Path(path)
    header = read_shard_header(path)
    params = dict(model.named_parameters())
    found = {name: (name, info) for name, info in header.tensors.items() if skip is None or not skip(name)}
    check_tensors(params, found, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        for name, param in params.items():
            info = header.tensors[name]
            param.data.copy_(tensor_from_bytes(read_bytes(fd, info.start, info.nbytes, path), info.dtype, info.shape))
    finally:
        os.close(fd)
    return len(header.tensors) - len(found)


def reference_differences(model: nn.Module, reference: Path, shard: Path,
                          source: Callable[[str, Checkpoint], tuple[str, tuple[int, int, int] | None]],
                          limit: int = MAX_LISTED, prepare: Callable[[Checkpoint], object] | None = None) -> list[str]:
    """Compare every loaded weight with its slice of the reference HF checkpoint, as dense values
    (FP8 dequantized on either side). A lossless conversion makes them equal; returns what differs,
    at most `limit` problems. `source(name, ckpt)` names the HF tensor a parameter comes from and the
    (dim, start, length) of it this rank holds, or None for all of it; `prepare(ckpt)` runs first."""
    problems = []
    with Checkpoint(reference) as ckpt:
        if prepare is not None:  # e.g. read stacked experts per expert (families.base.unstack_experts)
            prepare(ckpt)
        for module_name, module in model.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                if param_name == "scale":
                    continue  # compared through its weight's dequantized values
                name = f"{module_name}.{param_name}" if module_name else param_name
                mine = module.dense_weight() if isinstance(module, Linear) and param_name == "weight" else param
                hf, narrow = source(name, ckpt)
                if hf not in ckpt.tensors:
                    problems.append(f"{name}: the reference has no {hf!r}")
                    continue
                theirs = ckpt.read(hf)
                if (scale := hf + SCALE_SUFFIX) in ckpt.tensors:
                    theirs = dequant_fp8_block(theirs, ckpt.read(scale))
                if narrow is not None:
                    theirs = theirs.narrow(*narrow)
                theirs = theirs.to(mine.device, mine.dtype)
                if (problem := slice_difference(name, shard, hf, mine, theirs)) is not None:
                    problems.append(problem)
                if len(problems) >= limit:
                    return problems
    return problems


def stored_differences(shard: Path, names: Callable[[str], bool], reference: Path,
                       source: Callable[[str, Checkpoint], tuple[str, tuple[int, int, int] | None]],
                       limit: int = MAX_LISTED, prepare: Callable[[Checkpoint], object] | None = None) -> list[str]:
    """reference_differences for the tensors of a shard the model does not load (`names` picks them: an MTP layer
    it does not run), read from the shard file itself; the same `source`, slices and dequantization."""
    shard, problems = Path(shard), []
    header = read_shard_header(shard)
    fd = os.open(shard, os.O_RDONLY)
    try:
        with Checkpoint(reference) as ckpt:
            if prepare is not None:
                prepare(ckpt)
            for name in sorted(n for n in header.tensors if names(n)):
                info = header.tensors[name]
                mine = tensor_from_bytes(read_bytes(fd, info.start, info.nbytes, shard), info.dtype, info.shape)
                hf, narrow = source(name, ckpt)
                if hf not in ckpt.tensors:
                    problems.append(f"{name}: the reference has no {hf!r}")
                else:
                    theirs = ckpt.read(hf)
                    if (scale := hf + SCALE_SUFFIX) in ckpt.tensors:
                        theirs = dequant_fp8_block(theirs, ckpt.read(scale))
                    theirs = (theirs if narrow is None else theirs.narrow(*narrow)).to(mine.dtype)
                    if (problem := slice_difference(name, shard, hf, mine, theirs)) is not None:
                        problems.append(problem)
                if len(problems) >= limit:
                    break
    finally:
        os.close(fd)
    return problems


def slice_difference(name: str, shard: Path, hf: str, mine: torch.Tensor, theirs: torch.Tensor) -> str | None:
    """Why a loaded tensor is not exactly its slice of the reference, or None when it is."""
    if theirs.shape != mine.shape:
        return f"tensor {name!r} in {shard.name} has shape {list(mine.shape)}, its slice of {hf!r} has {list(theirs.shape)}"
    if not torch.equal(mine, theirs):
        diff = float((mine.float() - theirs.float()).abs().max())
        return f"tensor {name!r} in {shard.name} differs from its slice of reference {hf!r} (max abs diff {diff:.3g})"
    return None


def check_tensors(params: dict[str, nn.Parameter], found: dict[str, tuple[str, TensorInfo]], where: Path) -> None:
    """`found` maps model parameter name -> (name in the file, header entry). Raises one InputError
    listing every problem, naming the first tensor."""
    problems: list[tuple[str, str]] = []
    for name in sorted(params.keys() - found.keys()):
        problems.append((name, f"missing tensor {name!r}"))
    for name in sorted(found.keys() - params.keys()):
        problems.append((found[name][0], f"unexpected tensor {found[name][0]!r}"))
    for name in sorted(params.keys() & found.keys()):
        file_name, info = found[name]
        param = params[name]
        if tuple(info.shape) != tuple(param.shape):
            problems.append((file_name, f"tensor {file_name!r} has shape {list(info.shape)}, "
                                        f"the model expects {list(param.shape)}"))
        elif not param.dtype.is_floating_point:
            if info.dtype not in _INT_FILE_DTYPES:
                problems.append((file_name, f"tensor {file_name!r} is {info.dtype}, the model expects integers"))
        elif param.dtype == torch.float8_e8m0fnu and info.dtype != "F8_E8M0":
            problems.append((file_name, f"tensor {file_name!r} is {info.dtype}, but config.json declares E8M0 "
                                        "scales (quantization_config scale_fmt ue8m0)"))
        elif param.dtype == torch.float8_e4m3fn and info.dtype not in _FP8_FILE_DTYPES:
            problems.append((file_name, f"tensor {file_name!r} is {info.dtype}, but config.json declares FP8 "
                                        "weights (quantization_config)"))
        elif param.dtype not in (torch.float8_e4m3fn, torch.float8_e8m0fnu) and info.dtype not in _FLOAT_FILE_DTYPES:
            problems.append((file_name, f"tensor {file_name!r} is {info.dtype}, the model expects a "
                                        "BF16/F16/F32 tensor" + (" (config.json has no quantization_config)"
                                                                 if info.dtype in _FP8_FILE_DTYPES else "")))
    if not problems:
        return
    listed = "; ".join(text for _, text in problems[:MAX_LISTED])
    more = f"; and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
    raise InputError(f"{len(problems)} problem(s) loading weights: {listed}{more}", file=where,
                     tensor=problems[0][0],
                     fix="the files do not match config.json and this --mp; re-run the conversion into an empty "
                         "directory and copy its config.json beside the shards")
