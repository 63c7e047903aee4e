"""gpt-oss's MXFP4 experts (`X_blocks` [E, R, G, 16] + `X_scales` [E, R, G]) repacked exactly into FP8 e4m3 for
Hopper: `X` [E, R, K] with E8M0 block scales `X_scale_inv` [E, ceil(R/b0), ceil(K/b1)], each expert blocked on its
own (formats/repack.py's `mxfp4` source, read back by formats/fp8_experts.py). Every other tensor is kept byte for
byte. The FP8 values are the MXFP4 values exactly: transformers' own MXFP4 dequant of the source
(`convert_moe_packed_tensors`) equals transformers' Fp8Dequantize of each repacked expert, bit for bit, and
ckpttool's dequant of the output writes the very files its dequant of the source does. A value FP8 cannot hold under
its block's scale is refused naming the tensor and the block [expert, row block, column block]; nothing is published.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from conftest import load_dir, run_cli
from fp8_builders import fp8_dequantize
from quant_builders import load_all, write_like

from ckpttool.families.gpt_oss.demo import build_gpt_oss_checkpoint

TARGETS = {"fp8-block-deepseek": (128, 128), "fp8-32x32": (32, 32), "fp8-1x128": (1, 128)}


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return build_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt-oss-repack") / "mxfp4", mxfp4=True, seed=7)


def _all(path) -> dict[str, torch.Tensor]:
    return {k: v for f in load_dir(path).values() for k, v in f.items()}


@pytest.mark.parametrize("to", sorted(TARGETS))
def test_mxfp4_experts_repack_to_fp8_and_dequantize_to_the_same_bf16(gpt_oss, to, tmp_path):
    b0, b1 = TARGETS[to]
    run_cli("quantize", gpt_oss, tmp_path / "fp8", "--to", to, "--quiet")
    before, after = _all(gpt_oss), _all(tmp_path / "fp8")
    bases = sorted(n.removesuffix("_blocks") for n in before if n.endswith("_blocks"))
    assert len(bases) == 6  # 3 layers x gate_up_proj, down_proj
    assert sorted(after) == sorted({n for n in before if not n.endswith(("_blocks", "_scales"))}
                                   | set(bases) | {b + "_scale_inv" for b in bases})
    for name, t in before.items():
        if name in after:
            assert t.dtype == after[name].dtype and torch.equal(t.view(torch.uint8), after[name].view(torch.uint8))
    for base in bases:
        blocks, scales = before[base + "_blocks"], before[base + "_scales"]
        experts, rows, groups, _ = blocks.shape
        q, s = after[base], after[base + "_scale_inv"]
        assert q.dtype == torch.float8_e4m3fn and q.shape == (experts, rows, groups * 32), base
        assert s.dtype == torch.float8_e8m0fnu and s.shape == (experts, -(-rows // b0), -(-groups * 32 // b1)), base
        want = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [E, K, R], transformers' layout
        got = torch.stack([fp8_dequantize(q[e], s[e]).T for e in range(experts)])
        assert torch.equal(want.view(torch.int16), got.view(torch.int16)), base
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    published = json.loads((gpt_oss / "config.json").read_text())["quantization_config"]
    assert config == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                      "weight_block_size": [b0, b1], "modules_to_not_convert": published["modules_to_not_convert"]}
    run_cli("dequant", gpt_oss, tmp_path / "from-src", "--quiet")
    run_cli("dequant", tmp_path / "fp8", tmp_path / "from-repack", "--quiet")
    files = sorted(p.name for p in (tmp_path / "from-src").iterdir() if p.name != "ckpttool-manifest.json")
    assert files == sorted(p.name for p in (tmp_path / "from-repack").iterdir() if p.name != "ckpttool-manifest.json")
    for f in files:
        assert (tmp_path / "from-src" / f).read_bytes() == (tmp_path / "from-repack" / f).read_bytes(), f


def test_a_value_fp8_cannot_hold_is_refused_by_tensor_expert_and_block(gpt_oss, tmp_path):
    """Expert 2's row 5: one 32-value group 20 binades below the rest of its 128x128 block, every code 1.0: divided
    by the block's scale it falls below e4m3's 2**-9. The run names the tensor and [expert, row block, column
    block], and DST is never published."""
    tensors, file_of = load_all(gpt_oss)
    base = "model.layers.1.mlp.experts.gate_up_proj"
    blocks, scales = tensors[base + "_blocks"].clone(), tensors[base + "_scales"].clone()
    scales[2, 5, 1] = int(scales[2].max()) - 20
    blocks[2, 5, 1] = 0x22
    tensors[base + "_blocks"], tensors[base + "_scales"] = blocks, scales
    write_like(gpt_oss, tmp_path / "bad", tensors, file_of)
    proc = run_cli("quantize", tmp_path / "bad", tmp_path / "out", "--to", "fp8-block-deepseek", check=False)
    assert proc.returncode != 0
    assert "cannot repack exactly" in proc.stderr and "block [2, 0, 0]" in proc.stderr and base in proc.stderr, \
        proc.stderr
    assert not (tmp_path / "out").exists() or not any(p.suffix == ".safetensors" for p in (tmp_path / "out").iterdir())


def test_other_targets_refuse_gpt_oss_mxfp4_by_name(gpt_oss, tmp_path):
    proc = run_cli("quantize", gpt_oss, tmp_path / "out", "--to", "w4a16", check=False)
    assert proc.returncode != 0 and "do not repack exactly into w4a16" in proc.stderr, proc.stderr


def test_the_repacked_output_shards_once_dequantized(gpt_oss, tmp_path):
    """The stacked FP8 experts are not cut per rank (test below); dequantized, the repacked checkpoint shards like
    the source."""
    run_cli("quantize", gpt_oss, tmp_path / "fp8", "--to", "fp8-block-deepseek", "--quiet")
    run_cli("convert", gpt_oss, tmp_path / "a", "--mp", 2, "--quiet")
    run_cli("convert", tmp_path / "fp8", tmp_path / "b", "--mp", 2, "--quiet")
    shards = sorted(p.name for p in (tmp_path / "a").glob("*.safetensors"))
    assert len(shards) == 2 and shards == sorted(p.name for p in (tmp_path / "b").glob("*.safetensors"))
    for f in shards:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


@pytest.mark.parametrize("to", ["fp8-block-deepseek", "fp8-128x128"])
def test_repack_with_mp_is_refused_by_name_with_the_reason(gpt_oss, to, tmp_path):
    """gpt-oss's mp layout and verify's gpt-oss model hold MXFP4 or BF16 experts, not stacked FP8 ones: a repack
    with --mp is refused naming a tensor and why, before anything is written; the repacked HF checkpoint is not cut
    either (its stacked FP8 experts are named)."""
    proc = run_cli("quantize", gpt_oss, tmp_path / "out", "--to", to, "--mp", 2, check=False)
    assert proc.returncode != 0 and "not cut per rank" in proc.stderr and "stacked FP8 experts" in proc.stderr
    assert "mlp.experts." in proc.stderr and "_blocks" in proc.stderr
    assert not (tmp_path / "out").exists() or not any(p.suffix == ".safetensors" for p in (tmp_path / "out").iterdir())
    run_cli("quantize", gpt_oss, tmp_path / "hf", "--to", to, "--quiet")
    proc = run_cli("shard", tmp_path / "hf", tmp_path / "mp", "--mp", 2, check=False)
    assert proc.returncode != 0 and "stacked experts" in proc.stderr and "mlp.experts." in proc.stderr
    assert not (tmp_path / "mp").exists() or not any(p.suffix == ".safetensors" for p in (tmp_path / "mp").iterdir())
