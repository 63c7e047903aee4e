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


def test_fp8_blocks_regroup_exactly_from_v4_to_v41_and_back(v4, tmp_path):
    """DeepSeek-V4's 128x128 E8M0 blocks -> V4.1's 32x32 (experts repacked from MXFP4 into them too): each new
    block's scale is the ue8m0 rule of its exact values, and the checkpoint dequantizes to the source's BF16 byte
    for byte (ckpttool's dequant; transformers' Fp8Dequantize of each weight). Merged back into 128x128 blocks it
    dequantizes to the same BF16 again. (Not always to the source's bytes: where a block's amax / 448 is exactly a
    power of two, transformers' quantizer, computing 1 / (448 / amax) in float32, took the next scale up and
    codes of at most 224; the ue8m0 rule of the exact values takes the tighter one. Both hold the same values.)"""
    src, scales = v4[128]
    run_cli("quantize", src, tmp_path / "out", "--to", "fp8-32x32", "--quiet")
    before, after = _all(src), _all(tmp_path / "out")
    for name, scale in scales.items():
        q, s = after[name], after[scale]
        assert q.dtype == torch.float8_e4m3fn and s.shape == (-(-q.shape[0] // 32), -(-q.shape[1] // 32)), name
        assert torch.equal(fp8_dequantize(q, s).view(torch.int16),
                           fp8_dequantize(before[name], before[scale]).view(torch.int16)), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["weight_block_size"] == [32, 32] and config["expert_dtype"] == "fp8"
    run_cli("dequant", src, tmp_path / "a", "--quiet")
    run_cli("dequant", tmp_path / "out", tmp_path / "b", "--quiet")
    for f in load_dir(tmp_path / "a"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    run_cli("quantize", tmp_path / "out", tmp_path / "back", "--to", "fp8-128x128", "--quiet")
    back = _all(tmp_path / "back")
    same = 0
    for name, scale in scales.items():
        assert back[scale].shape == (-(-back[name].shape[0] // 128), -(-back[name].shape[1] // 128)), scale
        assert torch.equal(fp8_dequantize(back[name], back[scale]).view(torch.int16),
                           fp8_dequantize(before[name], before[scale]).view(torch.int16)), name
        same += not _is_expert(name) and torch.equal(back[scale].view(torch.uint8), before[scale].view(torch.uint8))
    dense = sum(not _is_expert(n) for n in scales)
    assert same > dense // 2  # most weights come back to the source's very scales


def test_v41_blocks_that_fp8_cannot_merge_are_refused_by_tensor_and_block(v4, tmp_path):
    """V4.1's 32x32 blocks quantized from BF16 put small values under small scales; under one 128x128 scale some
    fall below e4m3's 2**-9 step: refused (the tensor and the block named), never rounded, nothing published."""
    src, _ = v4[32]
    proc = run_cli("quantize", src, tmp_path / "out", "--to", "fp8-128x128", check=False)
    assert proc.returncode != 0 and "cannot repack exactly: block [" in proc.stderr and "tensor '" in proc.stderr
    assert not (tmp_path / "out").exists() or not any(p.suffix == ".safetensors" for p in (tmp_path / "out").iterdir())


def test_float_scales_split_and_merge_back_to_the_same_bytes(tiny_v3, tmp_path):
    """DeepSeek-V3's F32 128x128 scales: split into 32x32 the codes stay and each scale repeats; merged back, the
    checkpoint is byte for byte the original. Merging 32x32 blocks whose scales differ by other than a power of two
    is refused, naming the tensor and the block."""
    run_cli("quantize", tiny_v3, tmp_path / "32", "--to", "fp8-32x32", "--quiet")
    src, out = _all(tiny_v3), _all(tmp_path / "32")
    name = next(n for n in src if n.endswith("weight_scale_inv"))
    weight = name[: -len("_scale_inv")]
    assert torch.equal(out[weight].view(torch.uint8), src[weight].view(torch.uint8))
    assert torch.equal(out[name], src[name].repeat_interleave(4, 0).repeat_interleave(4, 1)[
        : out[name].shape[0], : out[name].shape[1]])
    run_cli("quantize", tmp_path / "32", tmp_path / "128", "--to", "fp8-128x128", "--quiet")
    files = sorted(p.name for p in tiny_v3.glob("*.safetensors"))
    for f in files:
        assert (tmp_path / "128" / f).read_bytes() == (tiny_v3 / f).read_bytes(), f
    assert json.loads((tmp_path / "128" / "config.json").read_text())["quantization_config"] == \
        json.loads((tiny_v3 / "config.json").read_text())["quantization_config"]
    # one 32x32 scale 1.5x its neighbours: no power of two maps its codes under the merged block's scale
    tensors, file_of = load_all(tmp_path / "32")
    tensors[name] = tensors[name].clone()
    tensors[name][0, 1] *= 1.5
    write_like(tmp_path / "32", tmp_path / "odd", tensors, file_of)
    proc = run_cli("quantize", tmp_path / "odd", tmp_path / "x", "--to", "fp8-128x128", check=False)
    assert proc.returncode != 0 and "cannot repack exactly" in proc.stderr and "block [0, 0]" in proc.stderr
    assert weight in proc.stderr


def test_repack_only_targets_refuse_float_weights_and_nothing_to_do(tiny_llama, tiny_v3, tmp_path):
    proc = run_cli("quantize", tiny_llama, tmp_path / "a", "--to", "fp8-32x32", check=False)
    assert proc.returncode != 0 and "nothing to repack into fp8-32x32" in proc.stderr
    assert "--to fp8-block-deepseek" in proc.stderr  # the fix: the target that quantizes float weights
    proc = run_cli("quantize", tiny_v3, tmp_path / "b", "--to", "fp8-128x128", check=False)
    assert proc.returncode != 0 and "nothing to repack" in proc.stderr


# -- NVFP4 between ModelOpt and compressed-tensors ------------------------------------------------------------
@pytest.fixture(scope="module")
def nvfp4(tmp_path_factory) -> dict:
    """A tiny llama in ModelOpt's NVFP4 (its NVFP4QTensor on every projection, hf_quant_config.json) and in
    compressed-tensors' (ckpttool's --to nvfp4a16, the library's bytes)."""
    from dense_models import BLOCK_LLAMA, build_hf
    from quant_builders import LINEAR, quantize_checkpoint

    root = tmp_path_factory.mktemp("nvfp4")
    bf16 = build_hf("llama", root / "bf16", seed=9, spec=BLOCK_LLAMA)
    made = quantize_checkpoint(bf16, root / "modelopt", "modelopt_nvfp4", LINEAR)
    run_cli("quantize", bf16, root / "ct", "--to", "nvfp4a16", "--quiet")
    return {"bf16": bf16, "modelopt": root / "modelopt", "ct": root / "ct", "made": made}


def test_modelopt_nvfp4_repacks_to_compressed_tensors_and_back(nvfp4, tmp_path):
    """ModelOpt -> compressed-tensors: the same codes (ModelOpt's +0.0 code re-spelled), the same F8_E4M3 scales,
    a per-tensor scale under which every value dequantizes to the source's BF16: ckpttool's dequant byte for byte,
    and compressed-tensors' own decompress of each weight equal to ModelOpt's own dequantize of the source. And back
    to ModelOpt, the same BF16 again."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from quant_builders import modelopt_decompress

    src = nvfp4["modelopt"]
    run_cli("quantize", src, tmp_path / "ct", "--to", "nvfp4a16", "--quiet")
    assert not (tmp_path / "ct" / "hf_quant_config.json").exists()
    config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "nvfp4-pack-quantized"
    before, after = _all(src), _all(tmp_path / "ct")
    assert not any(n.endswith(("input_scale", "weight_scale_2")) for n in after)
    compressor = BaseCompressor.get_value_from_registry("nvfp4-pack-quantized")
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    for name, shape in nvfp4["made"].items():
        base = name[: -len("weight")]
        scale = base + "weight_scale"
        assert torch.equal(after[scale].view(torch.uint8), before[scale].view(torch.uint8))
        local = {leaf: after[base + leaf] for leaf in ("weight_packed", "weight_scale", "weight_global_scale")}
        ours = compressor.decompress(local, scheme)["weight"].to(torch.bfloat16)
        theirs = modelopt_decompress({k: before[base + k] for k in ("weight", "weight_scale", "weight_scale_2")}, shape)
        assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16)), name
    for out in ("ct", "back"):
        if out == "back":
            run_cli("quantize", tmp_path / "ct", tmp_path / "back", "--to", "modelopt-nvfp4", "--quiet")
            back = json.loads((tmp_path / "back" / "config.json").read_text())["quantization_config"]
            assert back["quant_method"] == "modelopt" and back["quant_algo"] == "W4A16_NVFP4"
        run_cli("dequant", tmp_path / out, tmp_path / f"{out}-bf16", "--quiet")
    run_cli("dequant", src, tmp_path / "src-bf16", "--quiet")
    for out in ("ct", "back"):
        a, b = _all(tmp_path / "src-bf16"), _all(tmp_path / f"{out}-bf16")
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)), (out, k)


def test_compressed_tensors_nvfp4_repacks_to_modelopt_with_its_zero(nvfp4, tmp_path):
    """compressed-tensors -> ModelOpt: every value the same, but a -0.0 (compressed-tensors' code 8) is +0.0 in
    ModelOpt, whose format has no negative zero; transformers generates on the compressed-tensors checkpoint what
    it generates on its BF16 dequantization."""
    import transformers

    src = nvfp4["ct"]
    run_cli("quantize", src, tmp_path / "mo", "--to", "modelopt-nvfp4", "--quiet")
    run_cli("dequant", src, tmp_path / "a", "--quiet")
    run_cli("dequant", tmp_path / "mo", tmp_path / "b", "--quiet")
    a, b = _all(tmp_path / "a"), _all(tmp_path / "b")
    negative_zeros = 0
    for k in a:
        same = a[k].view(torch.int16) == b[k].view(torch.int16)
        nz = (a[k] == 0) & torch.signbit(a[k].float())
        assert torch.equal(a[k].float(), b[k].float()) and bool((same | nz).all()), k
        negative_zeros += int(nz.sum())
    assert negative_zeros  # the case is exercised

    def greedy(path):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        with torch.no_grad():
            return model.generate(torch.tensor([[3, 17, 42, 99]]), max_new_tokens=6, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0].tolist()
    assert greedy(src) == greedy(tmp_path / "a")


def _unservable_global(codes: np.ndarray) -> np.float32:
    """A compressed-tensors global scale for which no ModelOpt per-tensor scale gives these codes' BF16/F16 values."""
    for g in np.random.default_rng(3).uniform(10, 3000, 400).astype(np.float32):
        if repack.nvfp4_global(codes, "compressed-tensors", g, "modelopt")[0] is None:
            return g
    raise AssertionError("every global scale tried can be served")


def test_nvfp4_per_tensor_scale_that_no_scale_serves_is_refused_by_tensor_and_block(nvfp4, tmp_path):
    """Where a weight's per-tensor scale admits no other-library scale that keeps every value's BF16 and F16 (the
    two libraries round the block scale differently: one divides, the other multiplies), the run is refused naming
    the tensor, the scale code and its first block; nothing is published. Where one is found, every byte pair
    dequantizes the same (checked here over all 256 bytes of each used scale code)."""
    from ckpttool.kernels.nvfp4_cpu import table

    tensors, file_of = load_all(nvfp4["ct"])
    name = next(n for n in tensors if n.endswith("down_proj.weight_scale"))
    codes = tensors[name].view(torch.uint8).numpy()
    g = _unservable_global(codes)
    for trial in np.random.default_rng(4).uniform(10, 3000, 40).astype(np.float32):
        x, _ = repack.nvfp4_global(codes, "compressed-tensors", trial, "modelopt")
        if x is None:
            continue
        used = np.unique(codes)
        for out in ("BF16", "F16"):
            a = table("compressed-tensors", float(trial), out).reshape(256, 256)[used]
            b = table("modelopt", float(x), out).reshape(256, 256)[used]
            lo = np.arange(256) & 0x7  # compare the non-zero magnitudes of both nibbles
            both = ((lo != 0)[None, :] & ((np.arange(256) >> 4 & 0x7) != 0)[None, :])
            assert np.array_equal(a[:, both[0]], b[:, both[0]]), (trial, out)
    tensors[name.replace("weight_scale", "weight_global_scale")] = torch.tensor([g], dtype=torch.float32)
    write_like(nvfp4["ct"], tmp_path / "odd", tensors, file_of)
    proc = run_cli("quantize", tmp_path / "odd", tmp_path / "out", "--to", "modelopt-nvfp4", check=False)
    weight = name.replace("weight_scale", "weight_packed")
    assert proc.returncode != 0 and "cannot repack exactly" in proc.stderr and "first at block [" in proc.stderr
    assert weight in proc.stderr
    assert not (tmp_path / "out").exists() or not any(p.suffix == ".safetensors" for p in (tmp_path / "out").iterdir())


def test_the_scale_row_names_the_tensors_block_whichever_slab_it_is_in(monkeypatch):
    """The scale row reads the whole weight once and regroups it in slabs of whole blocks (bounded temporaries):
    a refused block is named by its place in the tensor, not in its slab; the slabs' scales are the whole's."""
    from ckpttool.errors import InputError
    from ckpttool.formats import BY_NAME, Chunk
    from ckpttool.formats import repack as rows

    rng = np.random.default_rng(5)
    packed = rng.integers(0, 256, (512, 64), dtype=np.uint8)
    e8m0 = rng.integers(120, 126, (512, 4), dtype=np.uint8)
    row = BY_NAME["repack:scale:128x128:mxfp4_experts:scale@layers.0.ffn.experts.3.w1.weight"]
    chunk = Chunk(packed.view(np.int8), "I8", {"scale": e8m0}, {"scale": "U8"})
    whole = row.cpu(chunk, "U8", None)
    monkeypatch.setattr(rows, "SLAB_VALUES", 128 * 128)  # one block row a slab
    assert np.array_equal(row.cpu(chunk, "U8", None), whole) and whole.shape == (4, 1)
    e8m0[300, 1] = 90
    packed[300, 16:32] = 0x11
    with pytest.raises(InputError, match=r"block \[2, 0\].*experts\.3\.w1\.weight"):
        row.cpu(Chunk(packed.view(np.int8), "I8", {"scale": e8m0}, {"scale": "U8"}), "U8", None)


def test_v4_repacks_into_1x128_blocks(v4, tmp_path):
    """Hopper's per-row groups of 128 (`weight_block_size: [1, 128]`): experts from MXFP4 and the 128x128 blocks
    split, every weight dequantizing to the source's BF16 (transformers' Fp8Dequantize of each weight)."""
    src, scales = v4[128]
    run_cli("quantize", src, tmp_path / "out", "--to", "fp8-1x128", "--quiet")
    before, after = _all(src), _all(tmp_path / "out")
    for name, scale in scales.items():
        assert after[scale].shape == (after[name].shape[0], -(-after[name].shape[1] // 128)), scale
        assert torch.equal(fp8_dequantize(after[name], after[scale]).view(torch.int16),
                           fp8_dequantize(before[name], before[scale]).view(torch.int16)), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["weight_block_size"] == [1, 128] and config["expert_dtype"] == "fp8"
    run_cli("dequant", src, tmp_path / "a", "--quiet")
    run_cli("dequant", tmp_path / "out", tmp_path / "b", "--quiet")
    for f in load_dir(tmp_path / "a"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


def _c_and_numpy(monkeypatch, packed, e8m0, block) -> list:
    """repack.mxfp4_to_fp8 through the C loop, then numpy: (codes, exponents) each, or (block, value, exponent)
    of the first block it refused."""
    out = []
    for native in ("1", "0"):
        monkeypatch.setenv("CKPTTOOL_NATIVE", native)
        try:
            out.append(repack.mxfp4_to_fp8(packed, e8m0, block))
        except repack.Inexact as exc:
            out.append((exc.block, exc.value, exc.scale_exp))
    return out


@pytest.mark.parametrize("block", [(128, 128), (1, 128), (32, 32)])
def test_c_loop_gives_numpys_codes_exponents_and_first_refusal(block, monkeypatch):
    """kernels/native/quant.c's MXFP4 -> FP8 loop against the numpy functions above: the same codes and exponents
    over 15 binades a block (rows not a multiple of the block, all-zero groups), and, past 15, the same first block,
    value and exponent refused."""
    from ckpttool.kernels.native import library

    if library() is None:
        pytest.skip("the C library is not built here (setup.py)")
    rng = np.random.default_rng(11)
    rows, cols = 200, 384
    packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    packed[7] = 0x80  # -0.0 and +0.0
    e8m0 = rng.integers(110, 125, (rows, cols // 32), dtype=np.uint8)

    (c_codes, c_exps), (n_codes, n_exps) = _c_and_numpy(monkeypatch, packed, e8m0, block)
    assert np.array_equal(c_codes, n_codes) and np.array_equal(c_exps, n_exps)
    if block != (1, 128):
        e8m0[150, 3], e8m0[150, 4], packed[150, 48:64] = 140, 100, 0x77  # 40 binades apart in one block
        c, n = _c_and_numpy(monkeypatch, packed, e8m0, block)
        assert c == n and isinstance(c[0], tuple) and c[0][0] <= 150 // block[0], (c, n)  # refused alike


def test_c_loop_equals_numpy_over_the_whole_e8m0_range(monkeypatch):
    """The C loop decodes each block row once and multiplies by 2**-exponent: over random shapes (rows not a
    multiple of the block, odd blocks), exponents anywhere in E8M0's range (subnormal values, overflowing ones),
    the same codes and exponents as numpy, or the same first refusal."""
    from ckpttool.kernels.native import library

    if library() is None:
        pytest.skip("the C library is not built here (setup.py)")
    refused = 0
    for seed in range(24):
        rng = np.random.default_rng(seed)
        rows, cols = int(rng.integers(1, 300)), 32 * int(rng.integers(1, 12))
        lo = int(rng.integers(0, 250))
        packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
        e8m0 = rng.integers(lo, min(255, lo + int(rng.integers(1, 20))), (rows, cols // 32), dtype=np.uint8)
        for block in [(128, 128), (1, 128), (32, 32), (7, 64)]:
            out = _c_and_numpy(monkeypatch, packed, e8m0, block)
            if isinstance(out[0][0], np.ndarray):
                assert np.array_equal(out[0][0], out[1][0]) and np.array_equal(out[0][1], out[1][1]), (seed, block)
            else:
                assert out[0] == out[1], (seed, block)
                refused += 1
    assert 0 < refused < 24 * 4  # both outcomes exercised
