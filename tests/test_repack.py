"""Exact repacks (quantize --to on an already quantized checkpoint): DeepSeek-V4 as published (FP8 128x128 or 32x32
blocks with E8M0 scales, MXFP4 routed experts) -> every expert FP8 e4m3 in the checkpoint's own blocks, the other
weights byte for byte. The output dequantizes (ckpttool's readers, and transformers' Fp8Dequantize of each weight on
the CPU) to exactly the BF16 the source dequantizes to; a value FP8 cannot hold under its block's scale is never
rounded: the run is refused naming the tensor and the block, and nothing is published."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import load_dir, run_cli
from deepseek_v4_models import build
from fp8_builders import fp8_dequantize
from quant_builders import load_all, write_like
from test_deepseek_v4_fp8 import WIDE, _is_expert, published_form

from ckpttool.kernels import repack


@pytest.fixture(scope="module")
def v4(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("v4-repack")
    bf16 = build(root / "bf16", spelling="deepseek", mtp=True, **WIDE)
    return {block: (root / f"fp8-{block}", published_form(bf16, root / f"fp8-{block}", block)) for block in (128, 32)}


def _all(path) -> dict[str, torch.Tensor]:
    return {k: v for f in load_dir(path).values() for k, v in f.items()}


@pytest.mark.parametrize("block", [128, 32])
def test_mxfp4_experts_repack_to_fp8_blocks_and_dequantize_to_the_same_bf16(v4, block, tmp_path):
    src, scales = v4[block]
    run_cli("quantize", src, tmp_path / "fp8", "--to", "fp8-block-deepseek", "--quiet")
    before, after = _all(src), _all(tmp_path / "fp8")
    assert sorted(before) == sorted(after)
    experts = [n for n in scales if _is_expert(n)]
    assert experts
    for name, t in before.items():
        if name in experts or name in {scales[e] for e in experts}:
            continue
        assert t.dtype == after[name].dtype and torch.equal(t.view(torch.uint8), after[name].view(torch.uint8)), name
    for name in experts:
        q, s = after[name], after[scales[name]]
        rows, cols = before[name].shape[0], before[name].shape[1] * 2
        assert q.dtype == torch.float8_e4m3fn and q.shape == (rows, cols)
        assert s.dtype == before[scales[name]].dtype and s.shape == (-(-rows // block), -(-cols // block))
        # transformers' own dequant (on the CPU) of the source's MXFP4 and of the repacked FP8: the same bits
        want = fp8_dequantize(before[name], before[scales[name]])
        got = fp8_dequantize(q, s)
        assert torch.equal(want.view(torch.int16), got.view(torch.int16)), name
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert config == {**json.loads((src / "config.json").read_text())["quantization_config"], "expert_dtype": "fp8"}
    # ckpttool's readers: the repacked checkpoint dequantizes to the source's BF16, byte for byte
    run_cli("dequant", src, tmp_path / "from-src", "--quiet")
    run_cli("dequant", tmp_path / "fp8", tmp_path / "from-repack", "--quiet")
    a, b = load_dir(tmp_path / "from-src"), load_dir(tmp_path / "from-repack")
    assert a.keys() == b.keys()
    for f in a:
        assert (tmp_path / "from-src" / f).read_bytes() == (tmp_path / "from-repack" / f).read_bytes(), f


def test_a_value_fp8_cannot_hold_is_refused_by_tensor_and_block(v4, tmp_path):
    """One 32-value group 20 binades below its block's largest: its values are below e4m3's 2**-9 once divided
    by the block's scale. The run names the tensor and the block, and DST is never published."""
    src, scales = v4[128]
    tensors, file_of = load_all(src)
    name = next(n for n in scales if _is_expert(n))
    scale = tensors[scales[name]].view(torch.uint8).clone()
    values = tensors[name].view(torch.uint8).clone()
    scale[3, 2] = int(scale[3].max()) - 20  # block (0, 0): columns 64..95 of row 3
    values[3, 32:48] = 0x22  # every code there 1.0 (nonzero)
    tensors[name], tensors[scales[name]] = values.view(torch.int8), scale.view(torch.float8_e8m0fnu)
    bad = tmp_path / "bad"
    write_like(src, bad, tensors, file_of)
    proc = run_cli("quantize", bad, tmp_path / "out", "--to", "fp8-block-deepseek", check=False)
    assert proc.returncode != 0
    assert "cannot repack exactly" in proc.stderr and "block [0, 0]" in proc.stderr and name in proc.stderr
    assert not (tmp_path / "out").exists() or not any(p.suffix == ".safetensors" for p in (tmp_path / "out").iterdir())


def test_other_targets_refuse_mxfp4_experts_by_name(v4, tmp_path):
    src, _ = v4[128]
    proc = run_cli("quantize", src, tmp_path / "out", "--to", "w4a16", check=False)
    assert proc.returncode != 0 and "do not repack exactly into w4a16" in proc.stderr


@pytest.mark.parametrize("block", [(128, 128), (1, 128), (32, 32)])
def test_kernel_keeps_every_value_and_its_sign(block):
    """Every E2M1 code (both zeros) under exponents spread over 15 binades a block: the FP8 codes times their
    block's scale are the MXFP4 values bit for bit; one binade more and a nonzero value is refused."""
    rng = np.random.default_rng(7)
    rows, cols = 256, 256
    packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    e8m0 = rng.integers(110, 125, (rows, cols // 32), dtype=np.uint8)
    values = repack.mxfp4_values(packed, e8m0)
    exps = repack.block_exponents(values, block)
    codes = repack.fp8_codes(values, exps, block)
    back = repack.fp8_block_values(codes, np.ldexp(np.float32(1), exps).astype(np.float32), block)
    assert np.array_equal(back.view(np.uint32), values.view(np.uint32))
    assert np.signbit(values[values == 0]).any()  # -0.0 kept as -0.0
    if block == (1, 128):
        return
    e8m0[0, 0], e8m0[0, 1] = 140, 100  # 40 binades apart in one block
    packed[0, :32] = 0x77
    with pytest.raises(repack.Inexact):
        v = repack.mxfp4_values(packed, e8m0)
        repack.fp8_codes(v, repack.block_exponents(v, block), block)
