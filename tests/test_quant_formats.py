"""Issue 16: compressed-tensors INT4 / FP8 / NVFP4 and ModelOpt NVFP4, bit for bit against the
libraries that define them (tests/quant_builders.py makes the checkpoints with those libraries and
runs their own decompression as the oracle).

Kernels: every code and byte, with edge scales, against the library's decompression. Checkpoints:
`inspect` names the format, `dequant` equals the library weight for weight (everything else
untouched), transformers loads the result as plain BF16, `convert --mp 2` straight from the quantized
checkpoint equals `convert --mp 2` of the library-dequantized one, and keeping the format is refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import assert_same_tensors, load_dir, run_cli
from quant_builders import EXPERTS, KINDS, LINEAR, ct_decompress, load_all, modelopt_decompress, oracle_weights, \
    quantize_checkpoint, write_like

from ckpttool.describe import describe
from ckpttool.formats import BY_NAME, Chunk
from ckpttool.kernels import fp8_cpu, nvfp4_cpu, scaled_cpu
from ckpttool.kernels.fp8_cpu import NaNCodes

pytest.importorskip("compressed_tensors")

TITLES = {"ct_int4": BY_NAME["ct_int4_g32"].title, "ct_fp8_channel": BY_NAME["ct_fp8_channel"].title,
          "ct_fp8_tensor": BY_NAME["ct_fp8_tensor"].title, "ct_nvfp4": BY_NAME["ct_nvfp4"].title,
          "modelopt_nvfp4": BY_NAME["modelopt_nvfp4"].title}
# bf16 scales at the edges: subnormal, tiny, huge, negative, zero
EDGE_BF16 = torch.tensor([1e-40, 3e-39, 1.5e-5, 0.0123, 1.0, 3.0, 7.5e3, 1e37, 3.3e38, -0.02, -1e-38, 0.0],
                         dtype=torch.bfloat16)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def np_bits(t: torch.Tensor):
    return bits(t).numpy().view({2: "uint16", 4: "uint32"}[t.element_size()])


# -- kernels against the libraries ------------------------------------------------------------------
@pytest.fixture
def cpu_path(cpu_kernels):
    """Every CPU form of each kernel: C (kernels/native/scaled.c), numba (kernels/scaled_numba.py), numpy."""
    return cpu_kernels


def test_int4_every_byte_with_edge_scales_matches_compressed_tensors(cpu_path):
    gen = torch.Generator().manual_seed(1)
    rows, cols = 48, 512
    packed_bytes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(rows, cols // 2 // 256)
    packed_bytes = packed_bytes[:, torch.randperm(cols // 2, generator=gen)].contiguous()
    packed = packed_bytes.view(torch.int32)
    scale = EDGE_BF16[torch.randint(0, len(EDGE_BF16), (rows, cols // 32), generator=gen)]
    ours = scaled_cpu.dequant_int4(packed.numpy(), np_bits(scale), "BF16", "BF16")
    ref = ct_decompress({"weight_packed": packed, "weight_scale": scale,
                         "weight_shape": torch.tensor([rows, cols])}, "ct_int4")
    assert ref.dtype == torch.bfloat16 and (ours == np_bits(ref)).all()


def random_int4(rows: int, cols: int, distinct_scales: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """packed int32 [rows, cols / 8] of random bytes and group-32 bf16 scales drawn from about
    `distinct_scales` values."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.int32, generator=gen).to(torch.uint8)
    pool = (torch.rand(distinct_scales, generator=gen) * 1e-2).bfloat16()
    return packed.view(torch.int32), pool[torch.randint(0, distinct_scales, (rows, cols // 32), generator=gen)]


# numpy's INT4 takes one table per distinct scale where the tables are at most an eighth of the output,
# else decodes, multiplies and rounds: 12 distinct scales give the first, ~2000 in 64 x 1024 the second
@pytest.mark.parametrize("distinct_scales", [12, 4000])
def test_int4_with_few_or_many_distinct_scales_matches_compressed_tensors(distinct_scales, cpu_path):
    packed, scale = random_int4(64, 1024, distinct_scales, seed=5)
    ours = scaled_cpu.dequant_int4(packed.numpy(), np_bits(scale), "BF16", "BF16")
    ref = ct_decompress({"weight_packed": packed, "weight_scale": scale,
                         "weight_shape": torch.tensor([64, 1024])}, "ct_int4")
    assert len(torch.unique(scale)) > (256 if distinct_scales > 12 else 0)
    assert (ours == np_bits(ref)).all()


@pytest.mark.parametrize("distinct_scales", [12, 4000])
@pytest.mark.parametrize("out", ["F16", "F32"])
def test_int4_to_f16_and_f32_is_the_fp32_product_rounded_once(out, distinct_scales, cpu_path):
    packed, scale = random_int4(32, 2048, distinct_scales, seed=6)
    b = packed.view(torch.uint8).to(torch.int32)
    q = torch.stack([(b & 15) - 8, (b >> 4) - 8], dim=-1).reshape(32, 2048)  # value 2k: low nibble of byte k
    exact = q.float() * scale.float().repeat_interleave(32, dim=1)  # exact: 4-bit integers times bf16
    ref = exact if out == "F32" else exact.half()
    ours = scaled_cpu.dequant_int4(packed.numpy(), np_bits(scale), "BF16", out)
    assert ours.tobytes() == ref.numpy().tobytes()


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_fp8_every_code_with_edge_scales_matches_compressed_tensors(strategy, cpu_path):
    gen = torch.Generator().manual_seed(2)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].repeat(len(EDGE_BF16), 4)  # NaN codes are refused, tested below
    rows = codes.shape[0]
    scale = EDGE_BF16.reshape(-1, 1) if strategy == "channel" else EDGE_BF16[6:7]
    weight = codes[:, torch.randperm(codes.shape[1], generator=gen)].contiguous().view(torch.float8_e4m3fn)
    ours = scaled_cpu.dequant_fp8_rows(weight.view(torch.uint8).numpy(), np_bits(scale), "F8_E4M3", "BF16", "BF16")
    ref = ct_decompress({"weight": weight, "weight_scale": scale}, f"ct_fp8_{strategy}")
    assert ours.shape == (rows, codes.shape[1]) and (ours == np_bits(ref)).all()


def every_nvfp4_scale_and_byte() -> tuple[torch.Tensor, torch.Tensor]:
    """packed [254, 256] (every byte in every row) with scales [254, 32]: row r has F8 scale code r
    (NaN codes 0x7F and 0xFF left out)."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(len(codes), 1)
    scales = codes.reshape(-1, 1).repeat(1, 32)
    return packed, scales.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("global_scale", [1.0, 2688.0 / 3.1, 0.37, 6.0e6])
def test_nvfp4_every_scale_and_byte_matches_compressed_tensors(global_scale, cpu_path):
    packed, scales = every_nvfp4_scale_and_byte()
    g = torch.tensor([global_scale], dtype=torch.float32)
    ours = nvfp4_cpu.dequant(packed.numpy(), scales.view(torch.uint8).numpy(), "compressed-tensors", float(g), "BF16")
    ref = ct_decompress({"weight_packed": packed, "weight_scale": scales, "weight_global_scale": g}, "ct_nvfp4")
    assert (ours == np_bits(ref)).all()


@pytest.mark.parametrize("scale_2", [1.0, 3.1 / 2688.0, 2.7, 1.7e-7])
def test_nvfp4_every_scale_and_byte_matches_modelopt(scale_2, cpu_path):
    packed, scales = every_nvfp4_scale_and_byte()
    s2 = torch.tensor(scale_2, dtype=torch.float32)
    ours = nvfp4_cpu.dequant(packed.numpy(), scales.view(torch.uint8).numpy(), "modelopt", float(s2), "BF16")
    ref = modelopt_decompress({"weight": packed, "weight_scale": scales, "weight_scale_2": s2}, tuple(ours.shape))
    assert (ours == np_bits(ref)).all()


def test_the_two_nvfp4_spellings_differ_where_their_libraries_do():
    """Code 8 is -0.0 in compressed-tensors and +0.0 in ModelOpt; division by G and multiplication by
    1/G round differently: one table would be wrong for one of them."""
    packed, scales = every_nvfp4_scale_and_byte()
    ct = nvfp4_cpu.dequant(packed.numpy(), scales.view(torch.uint8).numpy(), "compressed-tensors", 3.0, "BF16")
    mo = nvfp4_cpu.dequant(packed.numpy(), scales.view(torch.uint8).numpy(), "modelopt", float(torch.tensor(1 / 3.0)),
                           "BF16")
    assert ct[0, 16] == 0x8000 and mo[0, 16] == 0x0000  # byte 8, low nibble: code 8 under scale code 0
    assert (ct != mo).any()


@pytest.mark.parametrize("kernel", ["int4", "fp8", "nvfp4"])
def test_nan_scales_are_refused_naming_the_row(kernel, cpu_path):
    scale = torch.ones(4, 2, dtype=torch.bfloat16)
    scale[2, 1] = float("nan")
    with pytest.raises(NaNCodes) as e:
        if kernel == "int4":
            scaled_cpu.dequant_int4(torch.zeros(4, 8, dtype=torch.int32).numpy(), np_bits(scale), "BF16", "BF16")
        elif kernel == "fp8":
            scaled_cpu.dequant_fp8_rows(torch.zeros(4, 64, dtype=torch.uint8).numpy(), np_bits(scale[:, 1:]),
                                        "F8_E4M3", "BF16", "BF16")
        else:
            codes = torch.full((4, 2), 0x38, dtype=torch.uint8)
            codes[2, 1] = 0xFF
            BY_NAME["ct_nvfp4"].cpu(Chunk(torch.zeros(4, 16, dtype=torch.uint8).numpy(), "U8", {"scale": codes.numpy()},
                                          {"scale": "F8_E4M3"}), "BF16", None)
    assert e.value.row == 2


@pytest.mark.parametrize("nan", [0x7C01, 0x7FFF, 0xFC01, 0xFFFF])
def test_nan_scales_of_every_payload_are_refused(nan, cpu_path):
    """A NaN F16 scale whose fp32 low bits are high (0xFFFF -> 0xFFFFE000) once lost its NaN in the bf16
    rounding's 32-bit sum (to +0.0) on the table paths, and the row was written, not refused: every
    payload and sign, each kernel that builds tables from scales, each CPU path."""
    scale = np.ones((4, 2), dtype=np.float16)
    scale.view(np.uint16)[2, 1] = nan
    for out in ("BF16", "F16", "F32"):
        with pytest.raises(NaNCodes) as e:
            scaled_cpu.dequant_int4(np.zeros((4, 8), dtype=np.int32), scale, "F16", out)
        assert e.value.row == 2, ("int4", out)
        with pytest.raises(NaNCodes) as e:
            scaled_cpu.dequant_fp8_rows(np.full((4, 64), 0x38, dtype=np.uint8), scale[:, 1:], "F8_E4M3", "F16", out)
        assert e.value.row == 2, ("fp8 rows", out)
    values = fp8_cpu.value_tables(np.array([1.0, -2.0], dtype=np.float32), scale.astype(np.float32), "BF16")
    assert ((values[2, 1] & 0x7FFF) > 0x7F80).all() and ((np.delete(values.reshape(8, 2), 5, 0) & 0x7FFF) <= 0x7F80).all()


def test_distinct_scales_are_the_same_compiled_or_not(monkeypatch):
    """scaled_cpu.distinct, compiled for 16-bit scales (C, numba) and in numpy: the same values in the same
    order and the same index per element, every bit pattern included (NaNs, infinities, both zeros)."""
    gen = np.random.default_rng(3)
    bits = np.concatenate([gen.integers(0, 1 << 16, 5000), np.arange(1 << 16)[::7]]).astype(np.uint16)
    scale = gen.permutation(bits).reshape(-1, 1).view(np.dtype("<u2"))
    results = []
    for c, numba in (("1", "0"), ("0", "1"), ("0", "0")):  # C, numba, numpy (the first two where built)
        monkeypatch.setenv("CKPTTOOL_NATIVE", c)
        monkeypatch.setenv("CKPTTOOL_NUMBA", numba)
        values, which = scaled_cpu.distinct(scale)
        assert np.array_equal(values[which].view(np.uint16), scale.view(np.uint16))
        results.append((values.view(np.uint16), which))
    for values, which in results[:-1]:
        assert np.array_equal(values, results[-1][0]) and np.array_equal(which, results[-1][1])


def test_nan_codes_under_finite_scales_are_refused_naming_the_row(cpu_path):
    """FP8 per channel with finite scales tests the codes before a plain gather (numba) or the output's
    bits (numpy): either way a NaN code is refused in its row, and one scale for the tensor as well."""
    for scale_rows in (5, 1):
        codes = torch.full((5, 67), 0x38, dtype=torch.uint8)
        scale = np_bits(torch.full((scale_rows, 1) if scale_rows > 1 else (1,), 0.5, dtype=torch.bfloat16))
        scaled_cpu.dequant_fp8_rows(codes.numpy(), scale, "F8_E4M3", "BF16", "BF16")
        codes[3, 66] = 0x7F
        codes[4, 0] = 0xFF
        with pytest.raises(NaNCodes) as e:
            scaled_cpu.dequant_fp8_rows(codes.numpy(), scale, "F8_E4M3", "BF16", "BF16")
        assert e.value.row == 3


# -- checkpoints made by the libraries --------------------------------------------------------------
@pytest.fixture(scope="session")
def bases(tmp_path_factory) -> dict[str, Path]:
    """A tiny Qwen3 saved by transformers, and a BF16 DeepSeek-V3 without MTP (Kimi-K2's shape)."""
    from dense_models import build_hf

    from ckpttool.families.deepseek.demo import build_checkpoint

    root = tmp_path_factory.mktemp("quant-bases")
    return {"qwen3": build_hf("qwen3", root / "qwen3"),
            "v3": build_checkpoint(root / "v3", "tiny-v3", fp8=False, overrides={"num_nextn_predict_layers": 0})}


@pytest.fixture(scope="session")
def quantized(bases, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """kind -> (checkpoint directory, {weight name: shape} of the quantized weights)."""
    if any(k.startswith("modelopt") for k in KINDS):
        pytest.importorskip("modelopt")
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for kind in KINDS:
        src, pattern = (bases["v3"], EXPERTS) if kind == "ct_int4" else (bases["qwen3"], LINEAR)
        out[kind] = (root / kind, quantize_checkpoint(src, root / kind, kind, pattern))
    return out


@pytest.fixture(scope="session")
def dequantized(quantized, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dequantized")
    for kind, (src, _) in quantized.items():
        run_cli("dequant", src, root / kind, "--quiet")
    return {kind: root / kind for kind in quantized}


def base_of(kind: str, bases: dict) -> Path:
    return bases["v3"] if kind == "ct_int4" else bases["qwen3"]


@pytest.mark.parametrize("kind", KINDS)
def test_inspect_names_the_format(kind, quantized):
    src, weights = quantized[kind]
    q = describe(src)["quantization"]
    assert q["formats"] == {TITLES[kind]: len(weights)} and q["unsupported"] is None
    assert f"{len(weights)} {TITLES[kind]} weights" in run_cli("inspect", src).stdout


@pytest.mark.parametrize("kind", KINDS)
def test_dequant_equals_the_library_bit_for_bit(kind, quantized, dequantized, bases):
    src, weights = quantized[kind]
    oracle = oracle_weights(src, kind, weights)
    original, _ = load_all(base_of(kind, bases))
    ours, _ = load_all(dequantized[kind])
    assert sorted(ours) == sorted(original)  # scales, shapes, global and activation scales all gone
    for name, t in ours.items():
        want = oracle.get(name, original[name])
        assert t.dtype == want.dtype and t.shape == want.shape, name
        assert torch.equal(bits(t), bits(want)), name
    config = json.loads((dequantized[kind] / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    assert not (dequantized[kind] / "hf_quant_config.json").exists()
    if kind == "modelopt_nvfp4":
        assert (src / "hf_quant_config.json").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_transformers_loads_the_output_as_plain_bf16(kind, dequantized):
    model, info = AutoModelForCausalLM.from_pretrained(dequantized[kind], dtype=torch.bfloat16,
                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert getattr(model.config, "quantization_config", None) is None and not getattr(model, "is_quantized", False)
    ours, _ = load_all(dequantized[kind])
    state = model.state_dict()
    for name, t in ours.items():
        prefix, _, leaf = name.partition(".mlp.experts.")
        if leaf:  # transformers 5 stacks experts: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]
            e, proj = int(leaf.split(".")[0]), leaf.split(".")[1]
            stacked = state[f"{prefix}.mlp.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"][e]
            rows = t.shape[0]
            name, want = name, stacked[rows:] if proj == "up_proj" else stacked[:rows]
        else:
            want = state[name]
        if want.dtype != t.dtype:  # kept in fp32 by transformers (DeepSeek-V3's router weight, from 5.24): exactly ours
            assert want.dtype == torch.float32 and torch.equal(want.to(t.dtype).float(), want), name
            want = want.to(t.dtype)
        assert torch.equal(bits(want), bits(t)), name


@pytest.mark.parametrize("kind", KINDS)
def test_convert_mp2_straight_from_quantized(kind, quantized, bases, tmp_path):
    """Straight from the quantized checkpoint == from the library's own BF16 decompression of it."""
    src, weights = quantized[kind]
    oracle = oracle_weights(src, kind, weights)
    original, file_of = load_all(base_of(kind, bases))
    write_like(base_of(kind, bases), tmp_path / "library-bf16", {**original, **oracle}, file_of)
    run_cli("convert", src, tmp_path / "ours", "--mp", 2, "--quiet")
    run_cli("convert", tmp_path / "library-bf16", tmp_path / "ref", "--mp", 2, "--quiet")
    ours, ref = load_dir(tmp_path / "ours"), load_dir(tmp_path / "ref")
    assert sorted(ref) == ["model0-mp2.safetensors", "model1-mp2.safetensors"]
    assert_same_tensors(ours, ref)
    assert "quantization_config" not in json.loads((tmp_path / "ours" / "config.json").read_text())


@pytest.mark.parametrize("kind", KINDS)
def test_shard_keeping_the_format_is_refused(kind, quantized, tmp_path):
    proc = run_cli("shard", quantized[kind][0], tmp_path / "out", "--mp", 2, check=False)
    assert proc.returncode != 0 and "can only be dequantized" in proc.stderr and "fix:" in proc.stderr
    assert TITLES[kind] in proc.stderr and not (tmp_path / "out").exists()
