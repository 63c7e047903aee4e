"""The FP8 rows of formats/fp8.py and DeepSeek-V4's MXFP4 experts on CUDA: the same bits as on the CPU (which
tests/test_formats_fp8.py ties to transformers), kernel by kernel and for a whole mixed checkpoint converted
with --device cuda. Run on a GPU machine: pytest -m gpu -o addopts=''."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp8_builders import fp8_quantize, quantize

from ckpttool.formats import BY_NAME, Chunk

pytestmark = pytest.mark.gpu

CASES = {  # row: (values, scale) makers
    "fp8_block:32x32:ue8m0:scale": ((32, 32), "ue8m0", "F8_E8M0"),
    "fp8_block:1x32:ue8m0:weight_scale_inv": ((1, 32), "ue8m0", "U8"),
    "fp8_block:128x128:ue8m0:weight_scale_inv": ((128, 128), "ue8m0", "F32"),
    "fp8_block:1x128:float:weight_scale_inv": ((1, 128), "float", "F32"),
}


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy() if t.element_size() == 1 else t.numpy()


@pytest.mark.parametrize("out", ["BF16", "F16", "F32"])
@pytest.mark.parametrize("row", sorted(CASES))
def test_fp8_blocks_on_cuda_equal_the_cpu(row, out):
    block, scale_fmt, scale_dtype = CASES[row]
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(512, 768, generator=gen) * torch.logspace(-5, 2, 768)).to(torch.bfloat16)
    q, s = fp8_quantize(w, block, scale_fmt)
    if scale_dtype == "F32":
        s = s.float()
    elif scale_dtype == "U8":
        s = s.view(torch.uint8)
    fmt = BY_NAME[row]
    cpu = fmt.cpu(Chunk(_numpy(q), "F8_E4M3", {"scale": _numpy(s)}, {"scale": scale_dtype}), out, None)
    gpu, _ = fmt.cuda(Chunk(q.cuda(), "F8_E4M3", {"scale": s.cuda()}, {"scale": scale_dtype}),
                      {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[out])
    assert (gpu.cpu().contiguous().view(torch.uint8).numpy().reshape(-1) == cpu.view(np.uint8).reshape(-1)).all()


@pytest.mark.parametrize("row", ["fp8_tensor:weight_scale", "fp8_channel:weight_scale"])
def test_fp8_scaled_rows_on_cuda_equal_the_cpu(row):
    gen = torch.Generator().manual_seed(8)
    q = (torch.randn(300, 512, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand((300, 1) if "channel" in row else (1,), generator=gen) * 2 + 1e-3
    fmt = BY_NAME[row]
    cpu = fmt.cpu(Chunk(_numpy(q), "F8_E4M3", {"scale": s.numpy()}, {"scale": "F32"}), "BF16", None)
    gpu, _ = fmt.cuda(Chunk(q.cuda(), "F8_E4M3", {"scale": s.cuda()}, {"scale": "F32"}), torch.bfloat16)
    assert (gpu.cpu().view(torch.int16).numpy() == cpu.view(np.int16)).all()


def test_mxfp4_experts_on_cuda_equal_the_cpu():
    gen = torch.Generator().manual_seed(9)
    codes = torch.randint(-128, 128, (384, 1024), dtype=torch.int8, generator=gen)
    scale = torch.randint(0, 255, (384, 64), dtype=torch.uint8, generator=gen)
    fmt = BY_NAME["mxfp4_experts:scale"]
    cpu = fmt.cpu(Chunk(codes.numpy(), "I8", {"scale": scale.numpy()}, {"scale": "F8_E8M0"}), "BF16", None)
    gpu, _ = fmt.cuda(Chunk(codes.cuda(), "I8", {"scale": scale.view(torch.float8_e8m0fnu).cuda()},
                            {"scale": "F8_E8M0"}), torch.bfloat16)
    assert (gpu.cpu().view(torch.int16).numpy() == cpu.view(np.int16)).all()


def test_a_mixed_v4_checkpoint_converts_to_the_same_bytes_on_cuda(tmp_path):
    from ckpttool.families.deepseek.demo import build_checkpoint
    from ckpttool.families.deepseek.spec import is_fp8_in_published_checkpoint

    class Published:
        @staticmethod
        def fullmatch(name):
            return is_fp8_in_published_checkpoint(name)

    from ckpttool.plan.build import Spec
    from ckpttool.runner import ExecOptions, convert

    base = build_checkpoint(tmp_path / "v3", "tiny-v3", fp8=False, overrides={"num_nextn_predict_layers": 0})
    quantize(base, tmp_path / "v4", "v4", Published)
    spec = Spec(dequant=True, mp=2)
    convert(tmp_path / "v4", tmp_path / "cpu", spec, ExecOptions(quiet=True, device="cpu"))
    gpu = convert(tmp_path / "v4", tmp_path / "cuda", spec, ExecOptions(quiet=True, device="cuda", chunk_bytes=4096,
                                                                         workers=3, wait_for_cuda=True))
    counts = gpu.timings.to_json()["counts"]
    assert counts.get("chunks_on_gpu", 0) > 0 and "chunks_on_cpu_while_cuda_started" not in counts, counts
    for f in (tmp_path / "cpu").iterdir():
        assert f.read_bytes() == (tmp_path / "cuda" / f.name).read_bytes(), f.name
