"""gpt-oss' MXFP4 experts dequantized straight into transformers' layout ([E, R, G, 16] -> [E, G * 32, R],
kernels/mxfp4_cpu.dequant_transposed: C tiles transposed in registers, numba, numpy) equal, bit for bit, to
transformers' own `convert_moe_packed_tensors`, in every CPU form, for output rows (R) that are and are not a whole
number of tiles, a power of two or not, written into the executor's reusable buffer or a fresh array."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ckpttool.formats import BY_NAME, Chunk
from ckpttool.kernels import mxfp4_cpu

convert = pytest.importorskip("transformers.integrations.mxfp4").convert_moe_packed_tensors
TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


@pytest.mark.parametrize("shape", [(1, 256, 16), (2, 5, 3), (1, 130, 9), (3, 64, 4), (1, 2048, 5), (2, 136, 2)])
@pytest.mark.parametrize("out", sorted(TORCH))
def test_transposed_experts_equal_transformers(shape, out, cpu_kernels, monkeypatch):
    """C at each SIMD level (2: 16-bit outputs looked up by byte shuffles, native/mxfp4.c; below it the gather)."""
    from ckpttool.kernels import native

    experts, rows, groups = shape
    gen = torch.Generator().manual_seed(rows + groups)
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), dtype=torch.int32, generator=gen).to(torch.uint8)
    scales = torch.randint(0, 256, (experts, rows, groups), dtype=torch.int32, generator=gen).to(torch.uint8)
    if shape == (1, 256, 16):  # every scale (row) with every byte
        blocks = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(1, 1, 16, 16).expand(1, 256, 16, 16)
        scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(1, 256, 1).expand(1, 256, 16)
    want = convert(blocks.contiguous(), scales.contiguous(), dtype=TORCH[out])
    for level in range(native.simd() + 1) if cpu_kernels == "c" else [None]:
        if level is not None:
            monkeypatch.setenv("CKPTTOOL_SIMD", str(level))
        ours, ran = mxfp4_cpu.dequant_transposed(blocks.numpy(), scales.numpy(), out)
        assert ran.lower() == cpu_kernels and ours.shape == tuple(want.shape) == (experts, groups * 32, rows)
        assert (ours.view(np.uint8).reshape(-1) == bits(want).reshape(-1)).all(), level


def test_the_row_writes_into_the_executors_buffer(cpu_kernels):
    gen = torch.Generator().manual_seed(7)
    blocks = torch.randint(0, 256, (2, 40, 3, 16), dtype=torch.int32, generator=gen).to(torch.uint8)
    scales = torch.randint(100, 140, (2, 40, 3), dtype=torch.int32, generator=gen).to(torch.uint8)
    row = BY_NAME["mxfp4"]
    assert row.cpu_into and row.cpu_compiled
    size = 2 * 96 * 40 * 2
    buffer = np.full(size + 64, 0xAB, dtype=np.uint8)  # the executor's scratch is at least as large
    ours = row.cpu(Chunk(blocks.numpy(), "U8", {"scale": scales.numpy()}, {"scale": "U8"}), "BF16", buffer[:size])
    want = convert(blocks, scales, dtype=torch.bfloat16)
    assert np.shares_memory(ours, buffer) and (ours.view(np.uint8).reshape(-1) == bits(want).reshape(-1)).all()
    assert (buffer[size:] == 0xAB).all()
