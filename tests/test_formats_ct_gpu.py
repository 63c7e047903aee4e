"""The CUDA kernels of issue 35's compressed-tensors and ModelOpt rows (formats/compressed_int.py, compressed.py,
modelopt.py) give the CPU's bytes, which tests/test_formats_ct.py and test_formats_modelopt.py prove equal to each
library. They are torch gathers from the CPU's own tables, so the same functions run on CPU tensors too: the first
test runs them there in the default suite; the second on the GPU (`pytest -m gpu -o addopts=''
tests/test_formats_ct_gpu.py`, needing only torch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ckpttool.formats import BY_NAME, Chunk

OUT = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
SCALE = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
EDGE = torch.tensor([6e-8, 3e-6, 1.5e-5, 0.0123, 0.37, 1.0, 3.0, 250.0, 7.5e3, 6.0e4, 1e30])
CASES = [  # (row, scale dtype): the rows whose CUDA kernel is a torch gather of the CPU's tables
    *((f"ct_int:{s}:{b}:{g}:{z}{x}", d) for s, b in (("pack", 4), ("pack", 8), ("int", 8))
      for g in ("group32", "channel", "tensor") for z in ("sym", "asym") for x, d in (("", "BF16"), ("", "F16"))),
    ("ct_int:pack:4:group32:asym:gidx", "BF16"), ("ct_int:pack:8:group32:sym:gidx", "F32"),
    ("ct_int:int:8:group32:asym:gidx", "F16"),
    ("ct_int4_g32", "F16"), ("ct_int4_g128", "F32"), ("ct_fp8_channel", "F16"), ("ct_fp8_tensor", "F32"),
    ("ct_fp8_block:32x48", "BF16"), ("ct_fp8_block:128x128", "F16"), ("ct_fp8_group:32", "F32"),
    ("ct_mxfp4", "U8"), ("modelopt_fp8_tensor", "F32"), ("modelopt_fp8_channel", "F32"),
]


def inputs(row_name: str, sdt: str, rows: int, cols: int, gen: torch.Generator) -> Chunk:
    """A chunk of random codes (no NaN codes), edge scales finite in their dtype, random zero points and an
    act-order group index, as torch tensors on the CPU."""
    row = BY_NAME[row_name]

    def u8(*shape):
        x = torch.randint(0, 256, shape, dtype=torch.int32, generator=gen).to(torch.uint8)
        x[(x & 0x7F) == 0x7F] ^= 1
        return x

    def scale(*shape):
        # finite in their dtype (and, for ModelOpt, which rounds the scale to the output dtype first, in F16)
        edge = EDGE[torch.isfinite(EDGE.to(SCALE[sdt] if "modelopt" not in row_name else torch.float16))]
        return edge[torch.randint(0, len(edge), shape, generator=gen)].to(SCALE[sdt])

    if row_name == "ct_mxfp4":
        exps = torch.randint(0, 255, (rows, cols // 32), dtype=torch.int32, generator=gen).to(torch.uint8)
        return Chunk(u8(rows, cols // 2), "U8", {"scale": exps}, {"scale": "U8"})
    if "fp8" in row_name:
        shape = {"ct_fp8_channel": (rows, 1), "ct_fp8_tensor": (1,), "modelopt_fp8_tensor": (),
                 "modelopt_fp8_channel": (rows,)}.get(row_name)
        if shape is None:
            b0, b1 = (1, 32) if "group" in row_name else map(int, row_name.split(":")[1].split("x"))
            shape = (-(-rows // b0), -(-cols // b1))
        return Chunk(u8(rows, cols).view(torch.float8_e4m3fn), "F8_E4M3", {"scale": scale(*shape)}, {"scale": sdt})
    parts = row_name.split(":")
    storage, bits = ("pack", 4) if row_name.startswith("ct_int4") else (parts[1], int(parts[2]))
    group = int(row_name.split("_g")[1]) if row_name.startswith("ct_int4") else \
        int(parts[3].removeprefix("group")) if parts[3].startswith("group") else 0
    groups = cols // group if group else 1
    values = u8(rows, cols * bits // 8)
    values, dtype = (values.view(torch.int32), "I32") if storage == "pack" else (values.view(torch.int8), "I8")
    tensor = not row_name.startswith("ct_int4") and parts[3] == "tensor"
    sides, dtypes = {"scale": scale(1) if tensor else scale(rows, groups)}, {"scale": sdt}
    if ":asym" in row_name:
        packed = storage == "pack" and not tensor
        sides["zero"] = u8(-(-rows * bits // 32), groups * 4).view(torch.int32) if packed else \
            torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (1,) if tensor else (rows, groups), generator=gen,
                          dtype=torch.int32).to(torch.int8)
        dtypes["zero"] = "I32" if packed else "I8"
    if row_name.endswith(":gidx"):
        rank = torch.empty(cols, dtype=torch.int32)
        rank[torch.randperm(cols, generator=gen)] = torch.arange(cols, dtype=torch.int32)
        sides["g_idx"], dtypes["g_idx"] = rank // group, "I32"
    assert {s.role for s in row.read_sides} == set(sides), row_name
    return Chunk(values, dtype, sides, dtypes)


def numpy_chunk(c: Chunk) -> Chunk:
    def of(t):
        return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else \
            t.view(torch.uint8).numpy() if t.dtype == torch.float8_e4m3fn else t.numpy()
    return Chunk(of(c.values), c.dtype, {k: of(v) for k, v in c.sides.items()}, c.side_dtypes)


def on(c: Chunk, device) -> Chunk:
    return Chunk(c.values.to(device), c.dtype, {k: v.to(device) for k, v in c.sides.items()}, c.side_dtypes)


def check(row_name: str, sdt: str, device, shape=(40, 384)) -> None:
    row = BY_NAME[row_name]
    gen = torch.Generator().manual_seed(len(row_name) + shape[0])
    c = inputs(row_name, sdt, *shape, gen)
    for out, dtype in OUT.items():
        cpu = row.cpu(numpy_chunk(c), out, None)
        y, first_bad = row.cuda(on(c, device), dtype)
        assert first_bad is None and y.dtype == dtype and tuple(y.shape) == cpu.shape, (row_name, out)
        assert (y.cpu().contiguous().view(torch.uint8).numpy().reshape(-1) == cpu.view(np.uint8).reshape(-1)).all(), \
            (row_name, sdt, out)


@pytest.mark.parametrize("row, sdt", CASES)
def test_the_cuda_kernels_torch_gathers_give_the_cpus_bytes(row, sdt):
    check(row, sdt, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(40, 384), (1024, 4096)])
@pytest.mark.parametrize("row, sdt", CASES)
def test_cuda_bits_equal_cpu(row, sdt, shape):
    check(row, sdt, "cuda", shape)


@pytest.mark.gpu
@pytest.mark.parametrize("row", ["ct_int:pack:4:group128:asym", "ct_fp8_block:128x128", "modelopt_fp8_channel",
                                 "ct_int:pack:4:group128:sym:gidx", "ct_mxfp4"])
def test_the_example_chunk_runs(row):
    fmt = BY_NAME[row]
    y, _ = fmt.cuda(fmt.example(torch.device("cuda")), torch.bfloat16)
    torch.cuda.synchronize()
    assert y.dtype == torch.bfloat16 and y.numel() > 0
