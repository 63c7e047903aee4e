"""compressed-tensors beyond issue 16 (formats/compressed_int.py, formats/compressed.py): zero points, INT8 packed
and int-quantized, act-order (`weight`/`static`: the tensors of none; `group`: a g_idx), FP8 per group and per block,
MXFP4, scales in F16 and F32, and checkpoints with several config groups. Each equals compressed-tensors 0.20's own
decompression bit for bit (tests/ct_builders.py; act-order group as 0.12 computed it), kernel by kernel in every CPU
form and checkpoint by checkpoint; misdeclared ones are refused by name."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from conftest import assert_same_tensors, load_dir, run_cli
from quant_builders import EXPERTS, LINEAR, copy_changed, load_all, write_like

from ckpttool.describe import describe
from ckpttool.formats import BY_NAME, Chunk
from ckpttool.formats.compressed import CT_FP8_CHANNEL, CT_FP8_TENSOR, CT_INT4, CT_MXFP4, fp8_block_row, fp8_group_row
from ckpttool.formats.compressed_int import int_row
from ckpttool.kernels.fp8_cpu import NaNCodes

pytest.importorskip("compressed_tensors")
import ct_builders  # noqa: E402 - needs compressed_tensors

SDT = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
OUT = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
# scales spanning many binades, fp16 subnormals and overflow included (times q - z up to 255)
EDGE = torch.tensor([6e-8, 3e-6, 1.5e-5, 0.0123, 0.37, 1.0, 3.0, 250.0, 7.5e3, 6.0e4, 1e30, 3e38])


def carrier(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.view(torch.uint8).numpy() if t.dtype == torch.float8_e4m3fn else t.numpy()


def outputs(sdt: torch.dtype) -> list[str]:
    """The output dtypes where ours is the library's output cast: any for F16/F32 scales; BF16 for BF16 scales
    (issue 16's rows round the product once into F16/F32 outputs, and these rows keep that)."""
    return ["BF16"] if sdt == torch.bfloat16 else list(OUT)


def same(row, values: np.ndarray, dtype: str, sides: dict, sdt: torch.dtype, ref: torch.Tensor) -> None:
    side_dtypes = {"scale": SDT.get(sdt, "U8"), **{k: {np.dtype(np.int32): "I32", np.dtype(np.int8): "I8"}[v.dtype]
                                                   for k, v in sides.items() if k in ("zero", "g_idx")}}
    for out in outputs(sdt):
        ours = row.cpu(Chunk(values, dtype, sides, side_dtypes), out, None)
        want = carrier(ref.to(OUT[out]))
        assert ours.shape == want.shape and (ours.view(np.uint8) == want.view(np.uint8)).all(), (row.name, out)


def scales(shape, sdt, gen) -> torch.Tensor:
    """Edge scales finite in sdt (a non-finite scale is refused before any kernel: row.bad_row)."""
    edge = EDGE[torch.isfinite(EDGE.to(sdt))]
    return edge[torch.randint(0, len(edge), shape, generator=gen)].to(sdt)


# -- kernels against the library -------------------------------------------------------------------------
@pytest.mark.parametrize("sdt", list(SDT))
@pytest.mark.parametrize("storage, bits", [("pack", 4), ("pack", 8), ("int", 8)])
@pytest.mark.parametrize("strategy", ["group", "channel", "tensor"])
@pytest.mark.parametrize("asym", [False, True])
def test_integers_with_zero_points_equal_compressed_tensors(storage, bits, strategy, asym, sdt, cpu_kernels,
                                                            monkeypatch):
    """Every code against every zero point, edge scales in the model's dtype; C at each SIMD level (2: 4-bit rows
    to BF16 by a 16-entry lookup per group, native/fp8_scaled.c; below it the tables' windows)."""
    from compressed_tensors.compressors.base import BaseCompressor

    from ckpttool.kernels import native
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    gen = torch.Generator().manual_seed(bits + 7 * asym)
    rows, cols, group = 64, 512, 32 if strategy == "group" else 0
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    q = torch.arange(lo, hi, dtype=torch.int32).repeat(rows, cols // (hi - lo)).to(torch.int8)
    q = q[:, torch.randperm(cols, generator=gen)]
    shape = {"group": (rows, cols // 32), "channel": (rows, 1), "tensor": (1,)}[strategy]
    scale = scales(shape, sdt, gen)
    zero = torch.randint(lo, hi, shape, generator=gen).to(torch.int8) if asym else None
    if asym and strategy != "tensor":
        zero.view(-1)[: hi - lo] = torch.arange(lo, hi).to(torch.int8)[: zero.numel()]  # every zero point
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=not asym, strategy=strategy, group_size=group or None)
    if storage == "pack":
        stored = {"weight_packed": pack_to_int32(q, bits), "weight_scale": scale, "weight_shape": torch.tensor([rows, cols])}
        if asym:
            stored["weight_zero_point"] = pack_to_int32(zero, bits, packed_dim=0) if strategy != "tensor" else zero
    else:
        stored = {"weight": q, "weight_scale": scale, **({"weight_zero_point": zero} if asym else {})}
    fmt = "pack-quantized" if storage == "pack" else "int-quantized"
    ref = BaseCompressor.get_value_from_registry(fmt).decompress(
        dict(stored), QuantizationScheme(targets=["Linear"], weights=args))["weight"]
    assert ref.dtype == sdt
    sides = {"scale": carrier(scale), **({"zero": stored["weight_zero_point"].numpy()} if asym else {})}
    values = stored["weight_packed" if storage == "pack" else "weight"].numpy()
    for level in range(native.simd() + 1) if cpu_kernels == "c" else [None]:
        if level is not None:
            monkeypatch.setenv("CKPTTOOL_SIMD", str(level))
        same(int_row(storage, bits, strategy, group, asym, False), values, "I32" if storage == "pack" else "I8", sides,
             sdt, ref)


@pytest.mark.parametrize("sdt", list(SDT))
@pytest.mark.parametrize("bits, asym", [(4, False), (4, True), (8, False), (8, True)])
def test_act_order_group_index_equals_the_library_on_sorted_columns(bits, asym, sdt, cpu_kernels, monkeypatch):
    """A g_idx per column (GPTQ act-order): compressed-tensors 0.12's arithmetic, checked against 0.20's own
    decompress of the columns sorted by group (ct_builders.decompress); C at each SIMD level (2: computed per
    element, native/ct_gidx.c; below it the tables)."""
    from ckpttool.kernels import native

    gen = torch.Generator().manual_seed(bits)
    w = (torch.randn(48, 256, generator=gen) * torch.logspace(-3, 1, 256)).to(sdt)
    kind = "int4_asym_g32_actorder_group" if bits == 4 else "int8_g32_actorder_group"
    ct_builders.SPECS["_probe"] = (ct_builders.SPECS[kind][0], {**ct_builders.SPECS[kind][1], "symmetric": not asym},
                                   None)
    ct_builders.ACTORDER_GROUP.add("_probe")
    try:
        stored = ct_builders.compress(w, "_probe", gen)
        ref = ct_builders.decompress(stored, "_probe")
    finally:
        del ct_builders.SPECS["_probe"]
        ct_builders.ACTORDER_GROUP.discard("_probe")
    assert not torch.equal(stored["weight_g_idx"], torch.arange(256, dtype=torch.int32) // 32)
    sides = {"scale": carrier(stored["weight_scale"]), "g_idx": stored["weight_g_idx"].numpy(),
             **({"zero": stored["weight_zero_point"].numpy()} if asym else {})}
    for level in range(native.simd() + 1) if cpu_kernels == "c" else [None]:
        if level is not None:
            monkeypatch.setenv("CKPTTOOL_SIMD", str(level))
        same(int_row("pack", bits, "group", 32, asym, True), stored["weight_packed"].numpy(), "I32", sides, sdt, ref)


@pytest.mark.parametrize("sdt", list(SDT))
@pytest.mark.parametrize("storage, bits, group, rows, cols", [
    ("pack", 4, 32, 21, 288),  # two blocks of 8 rows and 5 more; 64-column blocks and 32 columns past them
    ("pack", 8, 16, 13, 48),   # a 32-column block of bytes, then 16 columns eight at a time
    ("int", 8, 12, 11, 60),    # a 32-column block, 24 columns eight at a time, 4 past the last eight
    ("pack", 4, 8, 8, 8)])
@pytest.mark.parametrize("asym", [False, True])
def test_act_order_every_shape_equals_the_formula(storage, bits, group, rows, cols, asym, sdt, cpu_kernels,
                                                  monkeypatch):
    """compressed-tensors 0.12's act-order arithmetic written out in torch, (q - z) times scale[:, g_idx] in the
    scale's dtype, on shapes past every block of the computed loop (native/ct_gidx.c: eight rows and 64 or 32
    columns a step, then eight columns, then one at a time) and int-quantized codes; C at each SIMD level."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from ckpttool.kernels import native

    gen = torch.Generator().manual_seed(rows + bits)
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    q = torch.randint(lo, hi, (rows, cols), generator=gen).to(torch.int8)
    g_idx = (torch.arange(cols, dtype=torch.int32) // group)[torch.randperm(cols, generator=gen)]
    scale = scales((rows, cols // group), sdt, gen)
    zero = torch.randint(lo, hi, (rows, cols // group), generator=gen).to(torch.int8) if asym else \
        torch.zeros(rows, cols // group, dtype=torch.int8)
    ref = (q.to(sdt) - zero[:, g_idx.long()].to(sdt)) * scale[:, g_idx.long()]
    sides = {"scale": carrier(scale), "g_idx": g_idx.numpy()}
    if asym:
        sides["zero"] = (pack_to_int32(zero, bits, packed_dim=0) if storage == "pack" else zero).numpy()
    values = pack_to_int32(q, bits).numpy() if storage == "pack" else q.numpy()
    for level in range(native.simd() + 1) if cpu_kernels == "c" else [None]:
        if level is not None:
            monkeypatch.setenv("CKPTTOOL_SIMD", str(level))
        same(int_row(storage, bits, "group", group, asym, True), values, "I32" if storage == "pack" else "I8", sides,
             sdt, ref)


def test_a_group_index_of_minus_one_reads_columns_in_order(cpu_kernels):
    """compressed-tensors ignores a g_idx holding -1 (GPTQ never ran): so does the row."""
    gen = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (8, 128), generator=gen).to(torch.uint8).view(torch.int32)
    scale = scales((8, 8), torch.bfloat16, gen)
    plain = CT_INT4[32].cpu(Chunk(packed.numpy(), "I32", {"scale": carrier(scale)}, {"scale": "BF16"}), "BF16", None)
    g = np.full(256, -1, dtype=np.int32)
    ours = int_row("pack", 4, "group", 32, False, True).cpu(
        Chunk(packed.numpy(), "I32", {"scale": carrier(scale), "g_idx": g}, {"scale": "BF16", "g_idx": "I32"}),
        "BF16", None)
    assert (ours == plain).all()


@pytest.mark.parametrize("sdt", list(SDT))
@pytest.mark.parametrize("row, strategy, extra, shape", [
    (fp8_block_row(32, 48), "block", dict(block_structure=[32, 48]), (3, 4)),  # partial blocks, as the library pads
    (fp8_group_row(32), "group", dict(group_size=32), (96, 5)),
    (CT_FP8_CHANNEL, "channel", {}, (96, 1)), (CT_FP8_TENSOR, "tensor", {}, (1,))])
def test_fp8_groups_blocks_and_float_scales_equal_compressed_tensors(row, strategy, extra, shape, sdt, cpu_kernels,
                                                                     monkeypatch):
    """In every loop: C at each SIMD level (2: native/fp8_scaled.c's lookup for BF16 out, below it the tables)."""
    from compressed_tensors.compressors.base import BaseCompressor

    from ckpttool.kernels import native
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    gen = torch.Generator().manual_seed(11)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(96, 1)[:, :160]
    codes = codes[:, torch.randperm(160, generator=gen)]
    codes[(codes & 0x7F) == 0x7F] = 0  # NaN codes are refused, tested below
    scale = scales(shape, sdt, gen)
    args = QuantizationArgs(num_bits=8, type="float", strategy=strategy, **extra)
    ref = BaseCompressor.get_value_from_registry("float-quantized").decompress(
        {"weight": codes.view(torch.float8_e4m3fn), "weight_scale": scale},
        QuantizationScheme(targets=["Linear"], weights=args))["weight"]
    for level in range(native.simd() + 1) if cpu_kernels == "c" else [None]:
        if level is not None:
            monkeypatch.setenv("CKPTTOOL_SIMD", str(level))
        same(row, codes.numpy(), "F8_E4M3", {"scale": carrier(scale)}, sdt, ref)


def test_fp8_block_nan_codes_are_refused_naming_the_row(cpu_kernels, monkeypatch):
    """F32 scales (C at SIMD 2: the per-group lookup) and F16 ones (the tables, C testing codes in its gather), every
    loop, a NaN code in a whole block and one in a row's partial last block."""
    from ckpttool.kernels import native

    codes = np.full((64, 96), 0x38, dtype=np.uint8)
    codes[41, 7], codes[45, 95] = 0xFF, 0x7F
    for level in range(native.simd() + 1) if cpu_kernels == "c" else [None]:
        if level is not None:
            monkeypatch.setenv("CKPTTOOL_SIMD", str(level))
        for sdt, dtype in (("F32", np.float32), ("F16", np.float16)):
            for bad in (codes, np.where(np.arange(64)[:, None] == 41, 0x38, codes).astype(np.uint8)):
                with pytest.raises(NaNCodes) as e:
                    fp8_block_row(32, 48).cpu(Chunk(bad, "F8_E4M3", {"scale": np.ones((2, 2), dtype)}, {"scale": sdt}),
                                              "BF16", None)
                assert e.value.row == (41 if bad is codes else 45), (level, sdt)


@pytest.mark.parametrize("col", [7, 130])  # in a block of 128 codes, and in a row's tail
def test_fp8_channel_nan_codes_are_refused_naming_the_row_in_every_loop(col, cpu_kernels, monkeypatch):
    """Per-row F16 scales take the tables (C: NaN codes found inside the gather, scaled.c's _checked loop)."""
    from ckpttool.kernels import native

    codes = np.full((64, 200), 0x38, dtype=np.uint8)
    codes[41, col], codes[50, 3] = 0xFF, 0x7F
    scale = np.linspace(0.5, 2, 64, dtype=np.float16).reshape(64, 1)
    for level in range(native.simd() + 1) if cpu_kernels == "c" else [None]:
        if level is not None:
            monkeypatch.setenv("CKPTTOOL_SIMD", str(level))
        for sdt, s in (("F16", scale), ("F32", scale.astype(np.float32))):
            with pytest.raises(NaNCodes) as e:
                CT_FP8_CHANNEL.cpu(Chunk(codes, "F8_E4M3", {"scale": s}, {"scale": sdt}), "BF16", None)
            assert e.value.row == 41, (level, sdt)


@pytest.mark.parametrize("sdt", [torch.float16, torch.float32])
def test_symmetric_int4_with_float_scales_equals_compressed_tensors(sdt, cpu_kernels, monkeypatch):
    """C at each SIMD level (2: the 16-entry lookup per group; below it the pair tables)."""
    from compressed_tensors.compressors.base import BaseCompressor

    from ckpttool.kernels import native
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    gen = torch.Generator().manual_seed(3)
    q = torch.arange(-8, 8, dtype=torch.int32).repeat(64, 32).to(torch.int8)[:, torch.randperm(512, generator=gen)]
    scale = scales((64, 16), sdt, gen)
    stored = {"weight_packed": pack_to_int32(q, 4), "weight_scale": scale, "weight_shape": torch.tensor([64, 512])}
    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=32)
    ref = BaseCompressor.get_value_from_registry("pack-quantized").decompress(
        dict(stored), QuantizationScheme(targets=["Linear"], weights=args))["weight"]
    for level in range(native.simd() + 1) if cpu_kernels == "c" else [None]:
        if level is not None:
            monkeypatch.setenv("CKPTTOOL_SIMD", str(level))
        same(CT_INT4[32], stored["weight_packed"].numpy(), "I32", {"scale": carrier(scale)}, sdt, ref)


def test_mxfp4_every_scale_and_byte_equals_compressed_tensors(cpu_kernels):
    from compressed_tensors.compressors.base import BaseCompressor

    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(255, 1)
    exponents = torch.arange(255, dtype=torch.int32).to(torch.uint8).reshape(-1, 1).repeat(1, 16)  # 0xFF is NaN
    ref = BaseCompressor.get_value_from_registry("mxfp4-pack-quantized").decompress(
        {"weight_packed": packed, "weight_scale": exponents}, ct_builders.scheme("mxfp4"))["weight"]
    for out in OUT:
        ours = CT_MXFP4.cpu(Chunk(packed.numpy(), "U8", {"scale": exponents.numpy()}, {"scale": "U8"}), out, None)
        assert (ours.view(np.uint8) == carrier(ref.to(OUT[out])).view(np.uint8)).all(), out


def test_fp16_product_tables_are_numpys_fp16_multiply_for_every_fp16_scale(cpu_kernels, monkeypatch):
    """fp8_cpu.library_tables for F16 scales, compiled (C: F16C's conversions at CKPTTOOL_SIMD 2, float16 rounding
    in integers and float32 below; numba: the latter) or numpy's float16 casts: fp16 scales of either sign times
    every q - z and every e4m3 value (its NaN codes too: both C loops give a NaN product the same bits)."""
    from ckpttool.kernels import native
    from ckpttool.kernels.fp8_cpu import fp8_values, library_tables

    fp8 = fp8_values("F8_E4M3")
    values = np.concatenate([np.arange(-255, 256, dtype=np.float32), fp8[np.isfinite(fp8)]])
    bits = np.concatenate([np.arange(0x400), np.arange(0x400, 0x7C00, 5), [0x7BFF]]).astype(np.uint16)
    magnitudes = bits.view(np.float16)  # every subnormal, a fifth of the normals, the largest
    scale = np.concatenate([magnitudes, -magnitudes[::61]]).astype(np.float32)
    with np.errstate(over="ignore"):
        product = (values[None, :] * scale[:, None]).astype(np.float16)  # the same: the fp32 product is exact
    for level in range(native.simd() + 1) if cpu_kernels == "c" else [None]:
        if level is not None:
            monkeypatch.setenv("CKPTTOOL_SIMD", str(level))
        for out in OUT:
            ours = library_tables(values, scale, "F16", out)
            want = product.view(np.uint16) if out == "F16" else carrier(torch.from_numpy(product.astype(np.float32)).to(
                OUT[out]))
            assert ours.dtype.itemsize == want.dtype.itemsize and (ours.view(want.dtype) == want).all(), (level, out)
        nan = library_tables(fp8, scale[:64], "F16", "BF16")  # e4m3's NaN codes: the scalar loop's bits in every loop
        monkeypatch.setenv("CKPTTOOL_SIMD", "0")
        assert (nan == library_tables(fp8, scale[:64], "F16", "BF16")).all() and np.isnan(fp8).any()


def test_zero_points_outside_the_rows_bits_and_act_order_outside_its_groups_are_named():
    """What a dtype cannot show, checked once per task before any chunk (Side.check_values)."""
    zero = int_row("pack", 4, "tensor", 0, True, False).side("zero")  # the library leaves it unpacked, I8 [1]
    assert zero.check_values(np.array([7], np.int8), {"scale": (1,)}) is None
    assert zero.check_values(np.array([9], np.int8), {"scale": (1,)}) == "zero point 9 is outside the 4-bit range [-8, 7]"
    g_idx = int_row("pack", 4, "group", 32, False, True).side("g_idx")
    g = np.arange(128, dtype=np.int32) // 32
    assert g_idx.check_values(g, {"scale": (8, 4)}) is None
    assert g_idx.check_values(np.full(128, -1, np.int32), {"scale": (8, 4)}) is None
    assert "outside the 4 groups" in g_idx.check_values(g + 1, {"scale": (8, 4)})


def test_every_row_a_plan_can_name_is_found_by_its_name():
    for name in ("ct_int:pack:4:group128:asym", "ct_int:pack:8:channel:sym", "ct_int:int:8:tensor:asym",
                 "ct_int:pack:4:group32:sym:gidx", "ct_fp8_block:128x128", "ct_fp8_group:32", "ct_mxfp4"):
        assert BY_NAME[name].name == name
    for name in ("ct_int:int:4:channel:sym", "ct_int:pack:3:group32:sym", "ct_fp8_block:0x128", "ct_fp8_group:x"):
        assert name not in BY_NAME


# -- checkpoints the library wrote ------------------------------------------------------------------------
QWEN = ("qwen3", LINEAR, torch.bfloat16)
CHECKPOINTS = {  # name: (base, {kind: pattern}, model dtype)
    **{kind: (QWEN[0], {kind: LINEAR}, torch.bfloat16) for kind in (
        "int4_asym_g32", "int4_g32_actorder_weight", "int8_asym_g32", "w8a8_asym_channel", "fp8_block", "mxfp4",
        "int4_asym_g32_actorder_group")},
    "int8_g32-f16": ("qwen3", {"int8_g32": LINEAR}, torch.float16),
    "w8a8_channel-f32": ("qwen3", {"w8a8_channel": LINEAR}, torch.float32),
    "fp8_group-f16": ("qwen3", {"fp8_group": LINEAR}, torch.float16),
    # Kimi-K2's shape: routed experts INT4 g32 with zero points, attention FP8 per channel, in one checkpoint
    "mixed": ("v3", {"int4_asym_g32": EXPERTS, "fp8_channel": re.compile(r".*self_attn\..*_proj\.weight")},
              torch.bfloat16),
}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    from dense_models import build_hf

    from ckpttool.families.deepseek.demo import build_checkpoint

    root = tmp_path_factory.mktemp("ct")
    bases = {"qwen3": build_hf("qwen3", root / "qwen3"),
             "v3": build_checkpoint(root / "v3", "tiny-v3", fp8=False, overrides={"num_nextn_predict_layers": 0})}
    out = {}
    for name, (base, groups, dtype) in CHECKPOINTS.items():
        src = bases[base] if dtype == torch.bfloat16 else ct_builders.retyped(bases[base], root / f"{base}-{dtype}",
                                                                              dtype)
        quantized = ct_builders.quantize_checkpoint(src, root / name, groups)
        out[name] = (root / name, quantized, src)
    return out


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_inspect_names_every_format(name, made):
    src, quantized, _ = made[name]
    q = describe(src)["quantization"]
    assert q["unsupported"] is None and sum(q["formats"].values()) == len(quantized), q
    want = {}
    for kind, _ in quantized.values():
        title = _title(src, kind)
        want[title] = want.get(title, 0) + 1
    assert q["formats"] == want and q["int8_weights"] == 0


def _title(src, kind: str) -> str:
    """The row the config's group for `kind` declares, as formats/compressed_config.py reads it."""
    from ckpttool.formats import declared_rules

    config = json.loads((src / "config.json").read_text())["quantization_config"]
    index = list(CHECKPOINTS[src.name][1]).index(kind)
    rules = {r.origin: r.row for r in declared_rules(config, None, src / "config.json")}
    return rules[f"quantization_config.config_groups.group_{index}"].title


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_dequant_equals_the_library_bit_for_bit_and_loads_as_bf16(name, made, tmp_path):
    from transformers import AutoModelForCausalLM

    src, quantized, base = made[name]
    run_cli("dequant", src, tmp_path / "out", "--quiet")
    ours, _ = load_all(tmp_path / "out")
    original, _ = load_all(base)
    oracle = ct_builders.oracle_weights(src, quantized)
    assert sorted(ours) == sorted(original)  # scales, zero points, g_idx, shapes, input scales all gone
    for key, t in ours.items():  # dequantized weights in BF16 (the default), the rest as they were
        want = oracle[key].to(torch.bfloat16) if key in oracle else original[key]
        assert t.dtype == want.dtype and torch.equal(t.view(torch.uint8), want.contiguous().view(torch.uint8)), key
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    if CHECKPOINTS[name][0] == "qwen3":
        _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


@pytest.mark.parametrize("name", ["int8_g32-f16", "w8a8_channel-f32"])
def test_dequant_to_the_models_own_dtype_is_the_librarys_output(name, made, tmp_path):
    """A recipe's `dequant: {dtype: fp16|fp32}`: exactly the tensors the library decompresses."""
    src, quantized, _ = made[name]
    dtype = "fp16" if name.endswith("f16") else "fp32"
    (tmp_path / "r.yaml").write_text(f"name: to-{dtype}\nstages:\n  - dequant: {{dtype: {dtype}}}\n")
    run_cli("run", tmp_path / "r.yaml", "--input", src, "--output", tmp_path / "out", "--quiet")
    ours, _ = load_all(tmp_path / "out")
    for key, want in ct_builders.oracle_weights(src, quantized).items():
        assert ours[key].dtype == want.dtype and torch.equal(ours[key], want), key


@pytest.mark.parametrize("name", ["mixed", "int4_asym_g32_actorder_group", "w8a8_asym_channel"])
def test_convert_mp2_straight_equals_from_the_librarys_bf16(name, made, tmp_path):
    src, quantized, base = made[name]
    original, file_of = load_all(base)
    write_like(base, tmp_path / "bf16", {**original, **ct_builders.oracle_weights(src, quantized)}, file_of)
    run_cli("convert", src, tmp_path / "ours", "--mp", 2, "--quiet")
    run_cli("convert", tmp_path / "bf16", tmp_path / "ref", "--mp", 2, "--quiet")
    assert_same_tensors(load_dir(tmp_path / "ours"), load_dir(tmp_path / "ref"))


def test_shard_keeping_them_is_refused(made, tmp_path):
    proc = run_cli("shard", made["mixed"][0], tmp_path / "out", "--mp", 2, check=False)
    assert proc.returncode != 0 and "can only be dequantized" in proc.stderr and not (tmp_path / "out").exists()


# -- damaged or misdeclared ones, refused naming file, tensor and fix; nothing published ------------------------
LAYER = "model.layers.1.mlp.down_proj."


def _set(name, value):
    return lambda t: t.__setitem__(name, value)


def _gidx(change):
    def edit(t):
        g = t[LAYER + "weight_g_idx"].clone()
        change(g)
        t[LAYER + "weight_g_idx"] = g
    return edit


def _weights(**change):
    return lambda q: q["config_groups"]["group_0"]["weights"].update(**change)


REFUSED = {  # case: (checkpoint, tensor change, config change, message, tensor named)
    "zero points missing": ("int4_asym_g32", lambda t: t.pop(LAYER + "weight_zero_point"), None,
                            f"has no '{LAYER}weight_zero_point'", LAYER + "weight_packed"),
    "zero points of another shape": ("int8_asym_g32", _set(LAYER + "weight_zero_point", torch.zeros(8, 2, dtype=torch.int32)),
                                     None, "zero point shape [8, 2], expected [16, 4]", LAYER + "weight_zero_point"),
    "a symmetric config over zero points": ("int4_asym_g32", None, _weights(symmetric=True),
                                            "zero_point", "weight_zero_point"),
    "g_idx outside the groups": ("int4_asym_g32_actorder_group", _gidx(lambda g: g.__setitem__(5, 4)), None,
                                 "g_idx holds 4, outside the 4 groups", LAYER + "weight_g_idx"),
    "g_idx with uneven groups": ("int4_asym_g32_actorder_group",
                                 _gidx(lambda g: g.__setitem__(int((g == 1).nonzero()[0]), 0)), None,
                                 "columns in group 0", LAYER + "weight_g_idx"),
    "g_idx missing": ("int4_asym_g32_actorder_group", lambda t: t.pop(LAYER + "weight_g_idx"), None,
                      f"has no '{LAYER}weight_g_idx'", LAYER + "weight_packed"),
    "fp8 blocks of another size": ("fp8_block", None, _weights(block_structure=[64, 64]),
                                   "block_structure [64, 64]", "down_proj.weight_scale'"),
    "int8 weights under an fp8 config": ("w8a8_asym_channel", None,
                                         lambda q: (q.update(format="float-quantized"),
                                                    q["config_groups"]["group_0"].update(format="float-quantized"),
                                                    _weights(type="float", symmetric=True)(q)),
                                         "is I8, but compressed-tensors float-quantized FP8", "down_proj.weight'"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_damaged_or_misdeclared_checkpoints_are_refused_by_name(case, made, tmp_path):
    name, change, config_change, message, tensor = REFUSED[case]
    src = copy_changed(made[name][0], tmp_path / "src", change, config_change)
    proc = run_cli("dequant", src, tmp_path / "out", check=False)
    assert proc.returncode != 0 and message in proc.stderr and tensor in proc.stderr and "fix:" in proc.stderr, \
        proc.stderr
    assert "Traceback" not in proc.stderr and not list((tmp_path / "out").glob("*.safetensors"))


def test_a_nan_f16_scale_is_refused_naming_scale_and_row(made, tmp_path):
    def nan(t):
        s = t[LAYER + "weight_scale"].clone()
        s[3, 1] = float("nan")
        t[LAYER + "weight_scale"] = s

    src = copy_changed(made["int8_g32-f16"][0], tmp_path / "src", nan)
    proc = run_cli("dequant", src, tmp_path / "out", check=False)
    assert proc.returncode != 0 and repr(LAYER + "weight_scale") in proc.stderr and "row 3" in proc.stderr, proc.stderr
    assert not list((tmp_path / "out").glob("*.safetensors"))
