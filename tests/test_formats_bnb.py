"""bitsandbytes (formats/bnb.py): 4-bit NF4 and FP4, with and without double quant, and LLM.int8(), equal bit for bit
to bitsandbytes' own dequantization: kernel by kernel in every CPU form (C at each SIMD level, numba, numpy), then
whole checkpoints that transformers and bitsandbytes wrote on the CPU (inspect names the format, dequant equals the
library and transformers loads the output as plain BF16, convert --mp 2 equals converting the library's BF16,
other block sizes and shapes whose rows are not whole blocks streamed in small chunks, F16 and F32 outputs).
Refusals: tests/test_formats_bnb_refused.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bnb_builders import dequant_4bit, dequant_int8, functional, oracle, saved
from conftest import run_cli
from dense_models import TINY, build_hf
from quant_builders import load_all, write_like

from ckpttool.describe import describe
from ckpttool.formats import BY_NAME, Chunk
from ckpttool.formats.bnb import BNB_INT8, bnb4_row
from ckpttool.kernels import bnb_cpu, native

F = pytest.importorskip("bitsandbytes.functional")
pytest.importorskip("transformers")

OUT = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).numpy().view(
        np.uint16 if t.element_size() == 2 else np.uint32)


def each_simd_level(cpu_kernels: str, monkeypatch):
    """The C loops at every SIMD level this CPU has (bnb.c: 0 none, 1 SSSE3, 2 AVX2); the other forms once."""
    levels = range(native.simd() + 1) if cpu_kernels == "c" else [None]
    for level in levels:
        if level is not None:
            monkeypatch.setenv("CKPTTOOL_SIMD", str(level))
        yield level


def row_for(packed: torch.Tensor, state) -> tuple:
    """(the row bitsandbytes' state plans, the chunk of the whole weight) as the executor would make them."""
    rows, cols = state.shape
    sides, dtypes = {"scale": state.absmax.numpy()}, {"scale": "F32"}
    if state.nested:
        offset = np.float32(state.offset.item())
        row = bnb4_row(state.quant_type, state.blocksize, rows, cols, state.state2.blocksize,
                       int(offset.view(np.uint32)))
        sides |= {"nested_scale": state.state2.absmax.numpy(), "nested_map": state.state2.code.numpy()}
        dtypes |= {"scale": "U8", "nested_scale": "F32", "nested_map": "F32"}
    else:
        row = bnb4_row(state.quant_type, state.blocksize, rows, cols)
    return row, Chunk(packed.numpy(), "U8", sides, dtypes)


# -- kernels against bitsandbytes ------------------------------------------------------------------------
def test_code_tables_are_bitsandbytes():
    for qt, table in bnb_cpu.CODES.items():
        assert np.array_equal(table.view(np.uint32), F.get_4bit_type(qt, device="cpu").numpy().view(np.uint32))


@pytest.mark.parametrize("out", sorted(OUT))
@pytest.mark.parametrize("qt, nested, bs", [("nf4", False, 64), ("nf4", True, 64), ("fp4", False, 32),
                                            ("fp4", True, 256), ("nf4", True, 4096), ("fp4", False, 128)])
def test_4bit_equals_bitsandbytes(qt, nested, bs, out, cpu_kernels, monkeypatch):
    gen = torch.Generator().manual_seed(bs)
    w = (torch.randn(48, 4096, generator=gen) * torch.logspace(-12, 4, 4096)).to(torch.bfloat16)
    packed, state = F.quantize_4bit(w, blocksize=bs, quant_type=qt, compress_statistics=nested)
    row, chunk = row_for(packed, state)
    want = bits(dequant_4bit(packed, state, OUT[out]))
    for _ in each_simd_level(cpu_kernels, monkeypatch):
        assert np.array_equal(row.cpu(chunk, out, None).reshape(-1), want.reshape(-1))


@pytest.mark.parametrize("out", sorted(OUT))
@pytest.mark.parametrize("qt", ["nf4", "fp4"])
def test_every_byte_and_edge_absmax_equal_bitsandbytes(qt, out, cpu_kernels, monkeypatch):
    """Every byte under absmax from 0 and subnormal products to fp16 and fp32 extremes, in rows of 96 values that
    are not whole blocks of 64 (bitsandbytes' torch kernel: its AVX-512 one misreads such rows, and flushes BF16
    subnormals to zero)."""
    edge = torch.tensor([0.0, 1e-45, 3e-39, 1e-37, 2e-36, 6e-8, 1e-3, 0.37, 1.0, 6.5e4, 7e4, 1e30, 3.4e38])
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(13 * 4)[: 13 * 32 * 4].reshape(-1, 1)
    absmax = edge.repeat_interleave(4).float()
    state = F.QuantState(absmax=absmax, code=F.get_4bit_type(qt, device="cpu"), blocksize=64, quant_type=qt)
    for shape in ((52, 64), (26, 128), (34, 96)):
        n = shape[0] * shape[1]
        state.shape, state.absmax, part = torch.Size(shape), absmax[: -(-n // 64)], packed[: n // 2]
        row, chunk = row_for(part, state)
        want = bits(dequant_4bit(part, state, OUT[out], torch_kernel=True))
        for _ in each_simd_level(cpu_kernels, monkeypatch):
            assert np.array_equal(row.cpu(chunk, out, None).reshape(-1), want.reshape(-1)), shape


@pytest.mark.parametrize("out", sorted(OUT))
def test_int8_equals_bitsandbytes(out, cpu_kernels, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(300, 384, generator=gen) * torch.logspace(-3, 2, 384)
    codes, scb, _ = F.int8_vectorwise_quant(w.half())
    codes[0] = torch.arange(-128, 128, dtype=torch.int8).repeat(2)[:384]
    scb[:6] = torch.tensor([0.0, 1e-40, 1e-3, 6.5e4 * 127, 1e37, 3.4e38])  # subnormal, F16-overflowing, inf products
    codes[:6] = codes[0]
    chunk = Chunk(codes.numpy(), "I8", {"scale": scb.numpy()}, {"scale": "F32"})
    want = bits(dequant_int8(codes, scb, OUT[out]))
    for _ in each_simd_level(cpu_kernels, monkeypatch):
        assert np.array_equal(BNB_INT8.cpu(chunk, out, None), want)


def test_a_plan_names_each_row_it_can_make():
    for name in ("bnb_int8", "bnb4:nf4", "bnb4:fp4:nested", "bnb4:nf4:64:4096x11008",
                 "bnb4:fp4:128:96x600:256:3d000000"):
        assert BY_NAME[name].name == name
    for name in ("bnb4:nf4:48:4x4", "bnb4:nf4:64:3x5", "bnb4:nf8:64:4x4", "bnb4:nf4:64:0x4", "bnb4:nf4:64:4x4:0:3d000000"):
        assert name not in BY_NAME and BY_NAME.get(name) is None
    assert BY_NAME["bnb4:nf4:64:100x96:256:3d000000"].row_align == 512  # 256 blocks of 64 = 16384 = 512 rows of 96


# -- whole checkpoints --------------------------------------------------------------------------------
SAVED = ("nf4-dq", "fp4", "int8")
TITLES = {"nf4-dq": "bitsandbytes NF4 (double quant)", "fp4": "bitsandbytes FP4", "int8": "bitsandbytes LLM.int8()",
          "nf4": "bitsandbytes NF4", "fp4-dq": "bitsandbytes FP4 (double quant)"}
ODD = dict(TINY["llama"], hidden_size=96, intermediate_size=600)
"""a llama whose rows are not whole blocks (96 and 600 columns, blocks of 64 and 128)"""
FUNCTIONAL = {"nf4-dq-64": ("nf4-dq", 64), "fp4-128": ("fp4", 128), "fp4-dq-32": ("fp4-dq", 32)}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("bnb")
    qwen3, odd = build_hf("qwen3", root / "qwen3"), build_hf("llama", root / "odd", spec=ODD)
    out = {kind: (saved(qwen3, root / kind, kind), qwen3) for kind in SAVED}
    out |= {name: (functional(odd, root / name, kind, bs), odd) for name, (kind, bs) in FUNCTIONAL.items()}
    return out


@pytest.mark.parametrize("layout", [*SAVED, *FUNCTIONAL])
def test_inspect_names_each_format(layout, made):
    src, _ = made[layout]
    q = describe(src)["quantization"]
    title = TITLES[FUNCTIONAL[layout][0] if layout in FUNCTIONAL else layout]
    assert q["unsupported"] is None and q["formats"] == {title: 14}, q


@pytest.mark.parametrize("layout", SAVED)
def test_dequant_equals_bitsandbytes_bit_for_bit_and_loads_as_bf16(layout, made, tmp_path):
    from transformers import AutoModelForCausalLM

    src, base = made[layout]
    run_cli("dequant", src, tmp_path / "out", "--quiet")
    ours, _ = load_all(tmp_path / "out")
    original, _ = load_all(base)
    want = {**original, **oracle(src)}
    assert sorted(ours) == sorted(original)  # every absmax, quant map, quant state, SCB and weight_format gone
    for name, t in ours.items():
        assert t.dtype == want[name].dtype and np.array_equal(bits(t), bits(want[name])), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


@pytest.mark.parametrize("layout", ["nf4-dq", "int8"])
def test_convert_mp2_straight_equals_from_bitsandbytes_bf16(layout, made, tmp_path):
    src, base = made[layout]
    original, file_of = load_all(base)
    write_like(base, tmp_path / "bf16", {**original, **oracle(src)}, file_of)
    run_cli("convert", src, tmp_path / "ours", "--mp", 2, "--quiet")
    run_cli("convert", tmp_path / "bf16", tmp_path / "ref", "--mp", 2, "--quiet")
    for rank in range(2):
        f = f"model{rank}-mp2.safetensors"
        assert (tmp_path / "ours" / f).read_bytes() == (tmp_path / "ref" / f).read_bytes(), f


@pytest.mark.parametrize("out", ["BF16", "F16", "F32"])
@pytest.mark.parametrize("layout", sorted(FUNCTIONAL))
def test_rows_not_whole_blocks_stream_in_small_chunks(layout, out, made, tmp_path):
    """Blocks of 32..128 over rows of 96 and 600 values, runs of a few rows each (4 KiB chunks: each run starts on
    a block's first value, and with double quant on a nested block's), in every output dtype."""
    from ckpttool.plan.build import Spec
    from ckpttool.runner import ExecOptions, convert

    src, base = made[layout]
    result = convert(src, tmp_path / "out", Spec(dequant=True, out_dtype=out),
                     ExecOptions(quiet=True, chunk_bytes=4096, workers=2, processes=1))
    counts = result.timings.to_json()["counts"]
    assert counts.get("chunks_by_cpu_loops_C", 0) > 14, counts  # many runs per weight, all in C
    ours, _ = load_all(tmp_path / "out")
    want = oracle(src, OUT[out])
    for name, t in want.items():
        assert ours[name].dtype == t.dtype and np.array_equal(bits(ours[name]), bits(t)), name


@pytest.mark.parametrize("kind", ["nf4-dq", "fp4"])
def test_the_gpu_tests_checkpoints_are_what_bitsandbytes_reads(kind, tmp_path):
    """bnb_builders.by_hand writes the GPU tests' inputs without bitsandbytes: bitsandbytes reads them, and its
    dequantization equals ours (DeepSeek's experts and attention included)."""
    from bnb_builders import by_hand

    from ckpttool.families.deepseek.demo import build_checkpoint

    base = build_checkpoint(tmp_path / "base", "tiny-v3", fp8=False, overrides={"num_nextn_predict_layers": 0})
    src = by_hand(base, tmp_path / "src", kind)
    run_cli("dequant", src, tmp_path / "out", "--quiet")
    ours, _ = load_all(tmp_path / "out")
    want = oracle(src)
    assert len(want) > 20
    for name, t in want.items():
        assert np.array_equal(bits(ours[name]), bits(t)), name
