"""FP8 as transformers reads it (formats/fp8.py): blocks of any size with float or E8M0 scales (DeepSeek-V3.1,
V4, V4.1, MXFP8), one scale per tensor (AutoFP8, transformers without blocks) or per row (fbgemm), and
DeepSeek-V4's mixed checkpoint (MXFP4 routed experts beside FP8 blocks, `expert_dtype: fp4`). Each is equal,
bit for bit, to transformers' own dequantization (Fp8Dequantize) of the same tensors, kernel by kernel in every
CPU form and whole checkpoint by whole checkpoint; mis-declared or damaged ones are refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import run_cli
from dense_models import build_hf
from fp8_builders import QWEN3_LINEAR, fp8_dequantize, fp8_quantize, mxfp4_quantize, oracle, quantize
from quant_builders import copy_changed, load_all, write_like

from ckpttool.describe import describe
from ckpttool.formats import BY_NAME, Chunk
from ckpttool.formats.blocks import mxfp4_experts_row
from ckpttool.formats.fp8 import block_row, scaled_row
from ckpttool.kernels.fp8_cpu import NaNCodes

pytest.importorskip("transformers")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def carrier(t: torch.Tensor) -> np.ndarray:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.float32}[t.element_size()]).numpy() \
        if t.dtype != torch.float32 else t.numpy()


def wide_weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Weights whose blocks span many binades, so scales take many values (E8M0 ones from 2**-20 up)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=gen) * torch.logspace(-6, 3, cols)).to(torch.bfloat16)


def dtype_of(t: torch.Tensor) -> str:
    return {torch.float32: "F32", torch.float8_e8m0fnu: "F8_E8M0", torch.uint8: "U8"}[t.dtype]


def each_simd_level(cpu_kernels: str, monkeypatch):
    """The C loops at every SIMD level this CPU has (CKPTTOOL_SIMD: below 2 the tables' gathers, at 2 AVX2's
    per-element loop of native/fp8_scaled.c where a row's scales are many); the other forms once."""
    from ckpttool.kernels import native

    for level in range(native.simd() + 1) if cpu_kernels == "c" else [None]:
        if level is not None:
            monkeypatch.setenv("CKPTTOOL_SIMD", str(level))
        yield level


# -- kernels against transformers ------------------------------------------------------------------------
@pytest.mark.parametrize("block, scale_fmt, as_bytes", [
    ((128, 128), "float", False), ((1, 128), "float", False), ((32, 32), "ue8m0", False), ((32, 32), "ue8m0", True),
    ((1, 32), "ue8m0", True), ((128, 128), "ue8m0", False), ((64, 16), "float", False)])
def test_blocks_equal_transformers(block, scale_fmt, as_bytes, cpu_kernels, monkeypatch):
    q, s = fp8_quantize(wide_weight(256, 384, 1), block, scale_fmt)
    stored = s.view(torch.uint8) if as_bytes else s
    row = block_row(*block, scale_fmt, "weight_scale_inv")
    for _ in each_simd_level(cpu_kernels, monkeypatch):
        ours = row.cpu(Chunk(carrier(q), "F8_E4M3", {"scale": carrier(stored)}, {"scale": dtype_of(stored)}), "BF16",
                       None)
        assert torch.equal(torch.from_numpy(ours.view(np.int16)), bits(fp8_dequantize(q, stored)))


@pytest.mark.parametrize("block", [(1, 128), (1, 32), (32, 32), (16, 48)])
@pytest.mark.parametrize("cols", [256, 200])
def test_float_scales_of_every_size_and_binade_equal_transformers_at_each_simd_level(block, cols, cpu_kernels,
                                                                                     monkeypatch):
    """Every code under F32 scales from the subnormal 1e-45 to 3e38 (products that overflow, scales whose 2**120
    multiple does, negative ones, products halfway between two bf16 numbers, either end of the lookup's range), BF16
    and F32 out (F16 takes the tables), in every loop: equal to transformers'
    Fp8Dequantize where the blocks divide the weight, else (a partial last block) to its formula, torch's fp32
    product rounded once."""
    rows = 64
    gen = torch.Generator().manual_seed(9)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(rows, 1)[:, torch.randperm(256, generator=gen)]
    codes = codes[:, :cols].contiguous()
    codes[(codes & 0x7F) == 0x7F] = 0x80  # the NaN codes are refused (below); -0.0 in their place
    ties = torch.tensor([0x3F808000, 0x3F818000, 0x3C7F8000], dtype=torch.int32).view(torch.float32)  # halfway in bf16
    # either side of the range fp8_scaled.c's lookup takes, [2**-120, 2**118), and far beyond it
    ends = torch.tensor([0x03800000, 0x037FFFFF, 0x7A7FFFFF, 0x7A800000, 0xFA7FFFFF], dtype=torch.int64).to(
        torch.int32).view(torch.float32)
    edge = torch.cat([torch.tensor([1e-45, 1e-40, 3e-30, 1.2e-6, 0.0123, 1.0, 3.0, 1e5, 1e30, 3e38, -0.5, -2e37]), ties,
                      ends])
    shape = (-(-rows // block[0]), -(-cols // block[1]))
    scale = edge[torch.randint(0, len(edge), shape, generator=gen)]
    q, row = codes.view(torch.float8_e4m3fn), block_row(*block, "float", "weight_scale_inv")
    full = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    want = {"BF16": fp8_dequantize(q, scale) if cols % block[1] == 0 else (q.float() * full).bfloat16(),
            "F32": q.float() * full, "F16": (q.float() * full).half()}
    for _ in each_simd_level(cpu_kernels, monkeypatch):
        for out, ref in want.items():
            ours = row.cpu(Chunk(codes.numpy(), "F8_E4M3", {"scale": scale.numpy()}, {"scale": "F32"}), out, None)
            assert torch.equal(torch.from_numpy(ours.view(np.int16 if out != "F32" else np.int32)), bits(ref)), out
        bad = codes.clone()
        bad[37, cols - 3], bad[50, 5] = 0xFF, 0x7F
        with pytest.raises(NaNCodes) as err:
            row.cpu(Chunk(bad.numpy(), "F8_E4M3", {"scale": scale.numpy()}, {"scale": "F32"}), "BF16", None)
        assert err.value.row == 37


def test_e8m0_scales_at_both_ends_equal_transformers(cpu_kernels):
    """Every code under the smallest (2**-127: subnormal products) and largest (2**127: overflow) scales."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(4, 1)
    codes[(codes & 0x7F) == 0x7F] = 0  # the NaN codes are refused, not dequantized
    scale = torch.tensor([[0], [1], [127], [254]], dtype=torch.uint8).repeat(1, 8)
    q = codes.view(torch.float8_e4m3fn)
    ours = block_row(1, 32, "ue8m0", "weight_scale_inv").cpu(
        Chunk(codes.numpy(), "F8_E4M3", {"scale": scale.numpy()}, {"scale": "U8"}), "BF16", None)
    assert torch.equal(torch.from_numpy(ours.view(np.int16)), bits(fp8_dequantize(q, scale)))


def test_mxfp4_experts_equal_transformers(cpu_kernels):
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(-128, 128, (64, 256), dtype=torch.int8, generator=gen)
    scale = torch.randint(0, 255, (64, 16), dtype=torch.uint8, generator=gen)
    scale[0] = torch.tensor([0, 1, 2, 3, 125, 126, 127, 128, 129, 200, 250, 251, 252, 253, 254, 254])
    for stored in (scale.view(torch.float8_e8m0fnu), scale):
        ours = mxfp4_experts_row("scale").cpu(
            Chunk(codes.numpy(), "I8", {"scale": scale.numpy()}, {"scale": dtype_of(stored)}), "BF16", None)
        assert torch.equal(torch.from_numpy(ours.view(np.int16)), bits(fp8_dequantize(codes, stored)))


@pytest.mark.parametrize("per, shape", [("tensor", ()), ("tensor", (1,)), ("channel", (96, 1)), ("channel", (96,))])
def test_one_scale_per_tensor_or_row_equals_transformers(per, shape, cpu_kernels, monkeypatch):
    q = wide_weight(96, 128, 2).float().clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(shape or (), generator=torch.Generator().manual_seed(4)) * 3 + 0.01
    ref = fp8_dequantize(q, scale.reshape(-1, 1) if per == "channel" else scale)
    for _ in each_simd_level(cpu_kernels, monkeypatch):
        ours = scaled_row(per, "weight_scale").cpu(
            Chunk(carrier(q), "F8_E4M3", {"scale": scale.reshape(shape).numpy()}, {"scale": "F32"}), "BF16", None)
        assert torch.equal(torch.from_numpy(ours.view(np.int16)), bits(ref))


def test_nan_codes_are_refused_naming_the_row(cpu_kernels):
    q, s = fp8_quantize(wide_weight(64, 64, 5), (32, 32), "ue8m0")
    codes = q.view(torch.uint8).clone()
    codes[37, 5] = 0x7F
    with pytest.raises(NaNCodes) as err:
        block_row(32, 32, "ue8m0", "scale").cpu(
            Chunk(codes.numpy(), "F8_E4M3", {"scale": s.view(torch.uint8).numpy()}, {"scale": "F8_E8M0"}), "BF16", None)
    assert err.value.row == 37


# -- whole checkpoints ------------------------------------------------------------------------------------
LAYOUTS = {  # layout: (base model, which weights)
    "v4": ("v3", None), "block32x32-ue8m0-scale": ("v3", None), "block1x32-ue8m0-weight_scale_inv-u8": ("qwen3", QWEN3_LINEAR),
    "block32x32-float-qscale_weight": ("qwen3", QWEN3_LINEAR), "autofp8": ("qwen3", QWEN3_LINEAR),
    "hf-tensor": ("qwen3", QWEN3_LINEAR), "fbgemm": ("qwen3", QWEN3_LINEAR)}
TITLES = {"v4": {"FP8 32x32 blocks (E8M0 scales)", "MXFP4 experts (DeepSeek-V4)"},
          "block32x32-ue8m0-scale": {"FP8 32x32 blocks (E8M0 scales)"},
          "block1x32-ue8m0-weight_scale_inv-u8": {"FP8 1x32 blocks (E8M0 scales)"},
          "block32x32-float-qscale_weight": {"FP8 32x32 blocks"}, "autofp8": {"FP8 per tensor"},
          "hf-tensor": {"FP8 per tensor"}, "fbgemm": {"FP8 per channel"}}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    from ckpttool.families.deepseek.demo import build_checkpoint

    root = tmp_path_factory.mktemp("fp8-bases")
    return {"v3": build_checkpoint(root / "v3", "tiny-v3", fp8=False, overrides={"num_nextn_predict_layers": 0}),
            "qwen3": build_hf("qwen3", root / "qwen3")}


@pytest.fixture(scope="module")
def made(bases, tmp_path_factory):
    from ckpttool.families.deepseek.spec import is_fp8_in_published_checkpoint

    class Published:  # DeepSeek's published FP8 weights (every linear projection)
        @staticmethod
        def fullmatch(name):
            return is_fp8_in_published_checkpoint(name)

    root = tmp_path_factory.mktemp("fp8-made")
    out = {}
    for layout, (base, pattern) in LAYOUTS.items():
        names = quantize(bases[base], root / layout, layout, pattern or Published)
        out[layout] = (root / layout, names, bases[base])
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_inspect_names_each_format(layout, made):
    src, names, _ = made[layout]
    q = describe(src)["quantization"]
    assert q["unsupported"] is None and set(q["formats"]) == TITLES[layout] and sum(q["formats"].values()) == len(names)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_dequant_equals_transformers_bit_for_bit_and_loads_as_bf16(layout, made, tmp_path):
    from transformers import AutoModelForCausalLM

    src, names, base = made[layout]
    run_cli("dequant", src, tmp_path / "out", "--quiet")
    ours, _ = load_all(tmp_path / "out")
    original, _ = load_all(base)
    want = {**original, **oracle(src, names)}
    assert sorted(ours) == sorted(original)  # every scale and activation scale gone, nothing else
    for name, t in ours.items():
        assert t.dtype == want[name].dtype and torch.equal(bits(t), bits(want[name])), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    if LAYOUTS[layout][0] == "qwen3":
        _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


@pytest.mark.parametrize("layout", ["v4", "block1x32-ue8m0-weight_scale_inv-u8", "autofp8"])
def test_convert_mp2_straight_equals_from_transformers_bf16(layout, made, tmp_path):
    src, names, base = made[layout]
    original, file_of = load_all(base)
    write_like(base, tmp_path / "bf16", {**original, **oracle(src, names)}, file_of)
    run_cli("convert", src, tmp_path / "ours", "--mp", 2, "--quiet")
    run_cli("convert", tmp_path / "bf16", tmp_path / "ref", "--mp", 2, "--quiet")
    for rank in range(2):
        f = f"model{rank}-mp2.safetensors"
        assert (tmp_path / "ours" / f).read_bytes() == (tmp_path / "ref" / f).read_bytes(), f


EXPERT = "model.layers.1.mlp.experts.2.down_proj."
DENSE = "model.layers.0.mlp.down_proj."


def _expert_outside_experts(tensors):
    """An MXFP4 weight where the config's experts are not: no rule claims it."""
    w = fp8_dequantize(tensors[DENSE + "weight"], tensors[DENSE + "scale"])
    tensors[DENSE + "weight"], tensors[DENSE + "scale"] = mxfp4_quantize(w)


def _nan_scale(tensors):
    s = tensors[EXPERT + "scale"].view(torch.uint8).clone()
    s[3, 1] = 0xFF
    tensors[EXPERT + "scale"] = s.view(torch.float8_e8m0fnu)


REFUSED = {
    "mxfp4 outside the experts": (_expert_outside_experts, None, "does not cover module", DENSE + "weight"),
    "fp4 experts without expert_dtype": (None, lambda q: q.pop("expert_dtype"), "is I8, but", ".mlp.experts."),
    "blocks of another size": (None, lambda q: q.update(weight_block_size=[64, 64]), "for 64x64 blocks",
                               "weight_block_size"),
    "E8M0 scales under scale_fmt float": (None, lambda q: q.update(scale_fmt="float"), "expected F32",
                                          "scale dtype"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_misdeclared_v4_checkpoints_are_refused_by_name(case, made, tmp_path):
    change, config_change, message, named = REFUSED[case]
    src = copy_changed(made["v4"][0], tmp_path / "src", change, config_change)
    proc = run_cli("dequant", src, tmp_path / "out", check=False)
    assert proc.returncode != 0 and message in proc.stderr and named in proc.stderr and "fix:" in proc.stderr, \
        proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_nan_e8m0_scale_is_refused_at_execution_naming_scale_and_row(made, tmp_path):
    src = copy_changed(made["v4"][0], tmp_path / "src", _nan_scale)
    proc = run_cli("dequant", src, tmp_path / "out", check=False)
    assert proc.returncode != 0 and repr(EXPERT + "scale") in proc.stderr and "row 3" in proc.stderr, proc.stderr
    assert not list((tmp_path / "out").glob("*.safetensors"))


def test_shard_keeping_blocks_of_another_size_is_refused(made, tmp_path):
    proc = run_cli("shard", made["block32x32-ue8m0-scale"][0], tmp_path / "out", "--mp", 2, check=False)
    assert proc.returncode != 0 and "can only be dequantized" in proc.stderr and not (tmp_path / "out").exists()


def test_every_row_a_plan_can_name_is_found_by_its_name():
    for name in ("fp8_block", "fp8_block:32x32:ue8m0:scale", "fp8_tensor:weight_scale", "fp8_channel:weight_scale",
                 "mxfp4_experts:scale"):
        assert BY_NAME[name].name == name
    assert "fp8_block:0x3:nope:x" not in BY_NAME and BY_NAME.get("nope") is None
