"""GPTQ and AWQ on CUDA: each row's torch kernel gives the bytes of its CPU kernel (which
tests/test_formats_gptq.py proves equal to the libraries). The same torch code runs on the CPU device in the
default test run; on a device machine:

    pytest -m gpu -o addopts='' tests/test_formats_gptq_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ckpttool.formats import BY_NAME, Chunk
from ckpttool.formats.awq import zeros_width

ROWS = ("gptq:b4:g128:gptq", "gptq:b4:g32:gptq_v2:desc_act", "gptq:b8:g-1:gptq", "gptq:b8:g64:gptq_v2:desc_act",
        "awq_gemm:g128", "awq_gemm:g-1", "awq_gemv:g32", "awq_gemv:g128")
OUT = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def random_chunk(row: str, n: int, k: int, seed: int) -> Chunk:
    """Random words (every code and zero point) and F16 scales from subnormal to overflowing products."""
    gen = torch.Generator().manual_seed(seed)

    def words(*shape):
        return torch.randint(-2 ** 31, 2 ** 31, shape, dtype=torch.int64, generator=gen).to(torch.int32)

    edge = torch.tensor([6e-8, 1e-5, 0.0123, 1.0, 3.0, 7.5e3, 65504.0, -0.02], dtype=torch.float16)

    def scales(*shape):
        return edge[torch.randint(0, len(edge), shape, generator=gen)]

    group = int(row.split(":g")[1].split(":")[0])
    g = k if group == -1 else group
    if row.startswith("gptq"):
        per = 32 // int(row.split(":b")[1].split(":")[0])
        g_idx = (torch.arange(k) // g).to(torch.int32)
        if row.endswith("desc_act"):
            g_idx = g_idx[torch.randperm(k, generator=gen)]
        return Chunk(words(k // per, n), "I32", {"scale": scales(k // g, n), "zero": words(k // g, n // per),
                                                 "g_idx": g_idx}, {"scale": "F16", "zero": "I32", "g_idx": "I32"})
    if row.startswith("awq_gemm"):
        return Chunk(words(k, n // 8), "I32", {"scale": scales(k // g, n), "zero": words(k // g, n // 8)},
                     {"scale": "F16", "zero": "I32"})
    w = zeros_width(k, g)
    return Chunk(words(n, k // 8), "I32", {"scale": scales(n, w * 8), "zero": words(n, w)}, {"scale": "F16", "zero": "I32"})


def on(c: Chunk, device: str) -> Chunk:
    return Chunk(c.values.to(device), c.dtype, {r: v.to(device) for r, v in c.sides.items()}, c.side_dtypes)


def numpy_of(c: Chunk) -> Chunk:
    return Chunk(c.values.numpy(), c.dtype, {r: v.numpy() for r, v in c.sides.items()}, c.side_dtypes)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("row", ROWS)
def test_torch_kernel_gives_the_cpu_kernels_bytes(row, device):
    fmt = BY_NAME[row]
    c = random_chunk(row, 64, 256, seed=len(row))
    for out, dtype in OUT.items():
        cpu = fmt.cpu(numpy_of(c), out, None)
        y, first_bad = fmt.cuda(on(c, device), dtype)
        assert first_bad is None and y.dtype == dtype and tuple(y.shape) == cpu.shape
        assert np.array_equal(y.cpu().contiguous().view({2: torch.int16, 4: torch.int32}[y.element_size()]).numpy(),
                              cpu.view({2: np.int16, 4: np.int32}[cpu.itemsize])), (row, out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("row", ROWS)
def test_example_chunk_runs(row, device):
    fmt = BY_NAME[row]
    y, _ = fmt.cuda(fmt.example(torch.device(device)), torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.numel() > 0
