"""bitsandbytes' rows (formats/bnb.py) on CUDA: the same bits as on the CPU (which tests/test_formats_bnb.py ties to
bitsandbytes), kernel by kernel and for whole checkpoints converted with --device cuda. Needs no bitsandbytes (the
inputs are random bytes in its layout: bnb_builders.by_hand). Run on a GPU machine:

    pytest -m gpu -o addopts='' tests/test_formats_bnb_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bnb_builders import by_hand
from conftest import assert_cuda_convert_equals_cpu

from ckpttool.formats import BY_NAME, Chunk

pytestmark = pytest.mark.gpu
OUT = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def chunk_of(name: str, gen: torch.Generator) -> Chunk:
    """Random values and sides for the row `name` (bnb4:qt:bs:RxC[:nbs:offset] or bnb_int8:RxC)."""
    if name.startswith("bnb_int8"):
        rows, cols = map(int, name.split(":")[1].split("x"))
        scb = torch.rand(rows, generator=gen) * 200
        scb[:3] = torch.tensor([1e-40, 6.5e4 * 127, 1e37])
        return Chunk(torch.randint(-128, 128, (rows, cols), dtype=torch.int8, generator=gen), "I8", {"scale": scb},
                     {"scale": "F32"})
    _, _, bs, shape, *nested = name.split(":")
    rows, cols = map(int, shape.split("x"))
    n, bs = rows * cols, int(bs)
    blocks = -(-n // bs)
    packed = torch.randint(0, 256, (n // 2, 1), dtype=torch.int32, generator=gen).to(torch.uint8)
    if not nested:
        absmax = torch.rand(blocks, generator=gen) * 3
        absmax[:4] = torch.tensor([0.0, 3e-39, 7e4, 1e38])
        return Chunk(packed, "U8", {"scale": absmax}, {"scale": "F32"})
    nbs = int(nested[0])
    sides = {"scale": torch.randint(0, 256, (blocks,), dtype=torch.int32, generator=gen).to(torch.uint8),
             "nested_scale": torch.rand(-(-blocks // nbs), generator=gen), "nested_map": torch.linspace(-1, 1, 256)}
    return Chunk(packed, "U8", sides, {"scale": "U8", "nested_scale": "F32", "nested_map": "F32"})


def on(c: Chunk, device) -> Chunk:
    return Chunk(c.values.to(device), c.dtype, {r: v.to(device) for r, v in c.sides.items()}, c.side_dtypes)


def numpy_of(c: Chunk) -> Chunk:
    return Chunk(c.values.numpy(), c.dtype, {r: v.numpy() for r, v in c.sides.items()}, c.side_dtypes)


@pytest.mark.parametrize("out", sorted(OUT))
@pytest.mark.parametrize("name", ["bnb4:nf4:64:512x1024", "bnb4:fp4:128:300x96", "bnb4:nf4:64:600x96:256:3d000000",
                                  "bnb4:fp4:32:64x4096:256:bd000000", "bnb_int8:300x512"])
def test_cuda_bits_equal_cpu(name, out):
    row = BY_NAME[name.split(":")[0] if name.startswith("bnb_int8") else name]
    c = chunk_of(name, torch.Generator().manual_seed(len(name)))
    cpu = row.cpu(numpy_of(c), out, None)
    gpu, first_bad = row.cuda(on(c, "cuda"), OUT[out])
    torch.cuda.synchronize()
    assert first_bad is None
    assert tuple(gpu.shape) == tuple(cpu.shape)
    assert np.array_equal(gpu.cpu().contiguous().view(torch.uint8).numpy().reshape(-1), cpu.view(np.uint8).reshape(-1))


@pytest.mark.parametrize("kind", ["nf4-dq", "fp4"])
def test_cuda_dequant_and_convert_equal_cpu(kind, tmp_path):
    from ckpttool.families.deepseek.demo import build_checkpoint

    base = build_checkpoint(tmp_path / "base", "tiny-v3", fp8=False, overrides={"num_nextn_predict_layers": 0})
    assert_cuda_convert_equals_cpu(by_hand(base, tmp_path / "src", kind), tmp_path)
