"""quantize: FP8 128x128 blocks bit for bit as the reference block scaling, int8/int4 bit for bit as
gpt-fast, dequant(quantize(x)) within each format's bounds, and the stage end to end."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from conftest import load_dir, run_cli
from dense_models import BLOCK_LLAMA, build_hf

from ckpttool.kernels.fp8 import dequant_fp8_block, quantize_fp8_block
from ckpttool.kernels.quant import (
    dequant_int4_grouped,
    dequant_int8_per_channel,
    pack_int4,
    quantize_int4_grouped,
    quantize_int8_per_channel,
    unpack_int4,
)

SHAPES = [(128, 128), (256, 384), (300, 1000), (1, 7), (130, 129)]


def reference_fp8_block(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The seed kernel.py's act_quant arithmetic (x to fp32, s = max|x| / 448., y = x / s, cast to e4m3),
    one 128x128 weight block at a time."""
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-rows // block), -(-cols // block), dtype=torch.float32)
    for i in range(0, rows, block):
        for j in range(0, cols, block):
            b = x[i:i + block, j:j + block].to(torch.float32)
            scale = torch.max(torch.abs(b)) / 448.
            q[i:i + block, j:j + block] = (b / scale).to(torch.float8_e4m3fn)
            s[i // block, j // block] = scale
    return q, s


def gpt_fast_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-fast's dynamically_quantize_per_channel(w.float(), -128, 127, torch.int8), scales cast to w.dtype."""
    w = x.float()
    eps = torch.finfo(torch.float32).eps
    min_val, max_val = torch.aminmax(w, dim=1)
    min_val_neg = torch.min(min_val, torch.zeros_like(min_val))
    max_val_pos = torch.max(max_val, torch.zeros_like(max_val))
    max_val_pos = torch.max(-min_val_neg, max_val_pos)
    scales = torch.clamp(max_val_pos / (float(127 - -128) / 2), min=eps).to(w.dtype)
    zero_points = torch.zeros(min_val_neg.size(), dtype=torch.int64)
    quant = torch.clamp(torch.round(w / scales.unsqueeze(-1)) + zero_points.unsqueeze(-1), -128, 127).to(torch.int8)
    return quant, scales.to(x.dtype)


def gpt_fast_int4(w: torch.Tensor, groupsize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-fast's get_group_qparams + group_quantize_tensor_from_qparams + pack_scales_and_zeros."""
    w = w.to(torch.bfloat16)
    to_quant = w.reshape(-1, groupsize)
    max_val, min_val = to_quant.amax(dim=1, keepdim=True), to_quant.amin(dim=1, keepdim=True)
    scales = (max_val - min_val).clamp(min=1e-6) / 15
    zeros = min_val + scales * (2 ** 3)
    scales, zeros = scales.to(torch.bfloat16).reshape(w.shape[0], -1), zeros.to(torch.bfloat16).reshape(w.shape[0], -1)
    s, z = scales.reshape(-1, 1), zeros.reshape(-1, 1)
    q = to_quant.sub(z - s * 8).div(s).round().clamp_(0, 15).to(torch.int32).reshape_as(w)
    rr = torch.cat([scales.reshape(scales.size(0), scales.size(1), 1), zeros.reshape(zeros.size(0), zeros.size(1), 1)], 2)
    return q, rr.transpose(0, 1).contiguous()


def _weights(shape, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[1])[None, :]  # blocks of very different range
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_quantize_is_the_reference_block_scaling_bit_for_bit(shape):
    w = _weights(shape, 0)
    q, s = quantize_fp8_block(w)
    ref_q, ref_s = reference_fp8_block(w)
    assert torch.equal(s, ref_s)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_dequant_of_quantize_is_within_e4m3_bounds(shape):
    w = _weights(shape, 1)
    q, s = quantize_fp8_block(w)
    x, back = w.float(), dequant_fp8_block(q, s).float()
    block_scale = s.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    # e4m3: 3 mantissa bits (half-ulp 2^-4 relative) for normals, steps of 2^-9 (times the scale) below
    # 2^-6; then one bf16 rounding of the result (2^-9 relative)
    bound = x.abs() * 2 ** -4 + block_scale * 2 ** -10 + back.abs() * 2 ** -8
    assert ((back - x).abs() <= bound).all()
    assert (q.float().abs() <= 448).all()


def test_fp8_all_zero_block_gets_scale_one():
    w = torch.zeros(256, 128, dtype=torch.bfloat16)
    w[128:] = 1.0
    q, s = quantize_fp8_block(w)
    assert s[0, 0] == 1.0 and s[1, 0] == torch.tensor(1.0) / 448  # the reference formula: 0 / 0 = NaN for block 0
    assert torch.equal(dequant_fp8_block(q, s), w)


@pytest.mark.parametrize("shape", [(64, 96), (3, 1000)])
def test_int8_is_gpt_fast_bit_for_bit_and_within_half_a_step(shape):
    w = _weights(shape, 2)
    q, s = quantize_int8_per_channel(w)
    ref_q, ref_s = gpt_fast_int8(w)
    assert q.dtype == torch.int8 and s.dtype == torch.bfloat16 and s.shape == (shape[0],)
    assert torch.equal(q, ref_q) and torch.equal(s, ref_s)
    back = dequant_int8_per_channel(q, s, torch.float32)
    step = s.float()[:, None]
    assert ((back - w.float()).abs() <= step * (0.5 + 128 * 2 ** -8) + back.abs() * 2 ** -8).all()


@pytest.mark.parametrize("group_size", [32, 128])
def test_int4_is_gpt_fast_bit_for_bit_packs_losslessly_and_is_within_half_a_step(group_size):
    w = _weights((48, 256), 3)
    q, sz = quantize_int4_grouped(w, group_size)
    ref_q, ref_sz = gpt_fast_int4(w, group_size)
    assert torch.equal(q, ref_q) and torch.equal(sz, ref_sz)
    assert sz.shape == (256 // group_size, 48, 2) and sz.dtype == torch.bfloat16
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (48, 128)
    assert torch.equal(unpack_int4(packed), q)
    assert packed[0, 0] == q[0, 0] | (q[0, 1] << 4)  # low nibble first
    back = dequant_int4_grouped(q, sz, group_size, torch.float32)
    step = sz[..., 0].transpose(0, 1).float().repeat_interleave(group_size, 1)
    assert ((back - w.float()).abs() <= step * 0.6 + w.float().abs() * 2 ** -7).all()


# -- the stage, end to end ---------------------------------------------------------------------------
@pytest.fixture(scope="session")
def llama_128(tmp_path_factory):
    """A tiny llama whose head_dim (128) and widths fall on FP8 block boundaries at mp=2."""
    spec = {**BLOCK_LLAMA, "num_key_value_heads": 2}
    return build_hf("llama", tmp_path_factory.mktemp("q") / "llama128", seed=5, spec=spec)


def _recipe(tmp_path, fmt: str, group_size: int = 128):
    path = tmp_path / f"q-{fmt}.yaml"
    path.write_text(f"name: q-{fmt}\nstages:\n  - quantize: {{format: {fmt}, group_size: {group_size}}}\n")
    return path


def test_fp8_quantize_stage_round_trips_through_our_dequant(llama_128, tmp_path):
    run_cli("run", _recipe(tmp_path, "fp8_block"), "-i", llama_128, "-o", tmp_path / "fp8", "--quiet")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                             "weight_block_size": [128, 128]}
    src = next(iter(load_dir(llama_128).values()))
    out = next(iter(load_dir(tmp_path / "fp8").values()))
    name = "model.layers.0.mlp.down_proj.weight"
    assert out[name].dtype == torch.float8_e4m3fn and out[name + "_scale_inv"].shape == (2, 4)
    ref_q, ref_s = reference_fp8_block(src[name])
    assert torch.equal(out[name].view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(out[name + "_scale_inv"], ref_s)
    assert out["model.embed_tokens.weight"].dtype == torch.bfloat16  # only linear projections are quantized
    assert "lm_head.weight_scale_inv" not in out
    run_cli("dequant", tmp_path / "fp8", tmp_path / "bf16", "--quiet")
    back = next(iter(load_dir(tmp_path / "bf16").values()))
    assert sorted(back) == sorted(src)
    for k, v in src.items():
        if k.endswith("_proj.weight"):
            x, y = v.float(), back[k].float()
            assert ((y - x).abs() <= x.abs() * 2 ** -4 + x.abs().max() / 448 * 2 ** -10 + y.abs() * 2 ** -8).all(), k
        else:
            assert torch.equal(v, back[k]), k


def test_fp8_quantized_shards_verify_and_merge_back(llama_128, tmp_path):
    """quantize -> shard --mp 2 (FP8 kept, scales split): verify gives transformers' greedy tokens on the
    dequantized checkpoint, and merge gives back the quantized HF checkpoint byte for byte."""
    from dense_models import greedy_oracle

    from ckpttool.verify.run import run_verify

    run_cli("run", _recipe(tmp_path, "fp8_block"), "-i", llama_128, "-o", tmp_path / "fp8", "--quiet")
    run_cli("dequant", tmp_path / "fp8", tmp_path / "bf16", "--quiet")
    ids, _ = greedy_oracle(tmp_path / "bf16", [3, 17, 42, 99], 4)
    run_cli("shard", tmp_path / "fp8", tmp_path / "mp2", "--mp", 2, "--quiet")
    with safe_open(str(tmp_path / "mp2" / "model1-mp2.safetensors"), "pt") as h:
        assert h.get_tensor("layers.0.attention.wk.weight").dtype == torch.float8_e4m3fn
        assert h.get_tensor("layers.0.attention.wk.scale").shape == (1, 2)
    report = run_verify(tmp_path / "mp2", prompt_ids=[3, 17, 42, 99], max_new_tokens=4, device="cpu",
                        reference=tmp_path / "fp8")
    assert report.ok, report.render(tmp_path / "mp2")
    assert report.generated_ids == ids
    run_cli("merge", tmp_path / "mp2", tmp_path / "merged", "--quiet")
    assert (tmp_path / "merged" / "model.safetensors").read_bytes() == (tmp_path / "fp8" / "model.safetensors").read_bytes()


def test_fp8_quantized_output_loads_in_transformers(llama_128, tmp_path):
    import accelerate  # noqa: F401  transformers' FP8 loader requires it; the test extra brings it
    import transformers

    run_cli("run", _recipe(tmp_path, "fp8_block"), "-i", llama_128, "-o", tmp_path / "fp8", "--quiet")
    run_cli("dequant", tmp_path / "fp8", tmp_path / "bf16", "--quiet")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    tokens = torch.tensor([[3, 17, 42, 99]])
    with torch.no_grad():
        assert torch.equal(model(tokens).logits.argmax(-1), plain(tokens).logits.argmax(-1))


@pytest.mark.parametrize("fmt,group_size", [("int8", 128), ("int4", 64)])
def test_int_quantize_stage_writes_the_documented_layout(llama_128, tmp_path, fmt, group_size):
    run_cli("run", _recipe(tmp_path, fmt, group_size), "-i", llama_128, "-o", tmp_path / "q", "--quiet")
    src = next(iter(load_dir(llama_128).values()))
    out = next(iter(load_dir(tmp_path / "q").values()))
    name = "model.layers.0.self_attn.o_proj"
    w = src[name + ".weight"]
    if fmt == "int8":
        q, s = gpt_fast_int8(w)
        assert torch.equal(out[name + ".weight"], q) and torch.equal(out[name + ".scales"], s)
    else:
        q, sz = gpt_fast_int4(w, group_size)
        assert torch.equal(unpack_int4(out[name + ".weight"]), q) and torch.equal(out[name + ".scales_and_zeros"], sz)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert "quantization_config" not in config and config["ckpttool_quantization"]["format"] == fmt
    proc = run_cli("shard", tmp_path / "q", tmp_path / "mp", "--mp", 2, "--quiet", check=False)
    assert proc.returncode != 0  # int8/int4 shards are not a format we write

