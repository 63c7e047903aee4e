"""GPTQ (formats/gptq.py) and AWQ (formats/awq.py): every row equal, bit for bit, to its library's fp16
dequantization then cast to BF16, kernel by kernel in every CPU form (C, numba, numpy) and whole checkpoint
by whole checkpoint (tests/gptq_builders.py: autoawq packs AWQ itself; GPTQ is packed and dequantized by
gptqmodel's code, copied, and checked against gptqmodel wherever it imports); streamed in column spans of a
few rows the same bytes as in one chunk; malformed and mis-declared checkpoints refused by name, nothing
published."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

from conftest import run_cli
from dense_models import build_hf
from gptq_builders import (awq_layers, gptq_dequantize, gptq_pack, gptq_params, quantize, to_v1)
from quant_builders import copy_changed, load_all, write_like

from ckpttool.describe import describe
from ckpttool.formats import BY_NAME, Chunk
from ckpttool.formats.awq import awq_row
from ckpttool.formats.gptq import gptq_row

pytest.importorskip("transformers")
with warnings.catch_warnings():  # autoawq announces its deprecation on import
    warnings.simplefilter("ignore", DeprecationWarning)
    pytest.importorskip("awq", reason="autoawq (the `test` extra) packs the AWQ checkpoints and is their oracle")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    """An F16 weight whose groups span many binades, so scales take many values (and zero points all 16)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=gen) * torch.logspace(-4, 2, cols) + 0.3 * torch.rand(rows, 1, generator=gen)
            ).half().float()


def gptq_chunk(qweight, qzeros, scales, g_idx) -> Chunk:
    return Chunk(qweight.numpy(), "I32", {"scale": scales.numpy(), "zero": qzeros.numpy(), "g_idx": g_idx.numpy()},
                 {"scale": "F16", "zero": "I32", "g_idx": "I32"})


def awq_chunk(parts: dict) -> Chunk:
    return Chunk(parts["qweight"].numpy(), "I32", {"scale": parts["scales"].numpy(), "zero": parts["qzeros"].numpy()},
                 {"scale": "F16", "zero": "I32"})


# -- kernels against the libraries -----------------------------------------------------------------------
def c_paths(cpu_kernels: str, monkeypatch):
    """The C form's two paths where it has both (kernels/packed.py: computed with AVX2 and F16C, CKPTTOOL_SIMD 2;
    the tables with it capped at 0); every other form once. Yields whether the computed loops run."""
    from ckpttool.kernels import packed

    for level in ((0, 2) if cpu_kernels == "c" else (None,)):
        if level is not None:
            monkeypatch.setenv("CKPTTOOL_SIMD", str(level))
        yield packed.computed()


GPTQ_CASES = [(4, 32, False, False, "gptq", 72), (4, 64, True, True, "gptq_v2", 72), (4, -1, False, False, "gptq", 72),
              (4, 16, True, False, "gptq", 72), (8, 32, False, False, "gptq", 72), (8, 128, True, True, "gptq_v2", 72),
              (8, -1, False, True, "gptq", 72), (4, 48, True, False, "gptq_v2", 72),
              # 8-bit rows come in fours: 76 leaves four past the computed loop's blocks of eight
              (8, 32, False, False, "gptq", 76), (8, 64, True, False, "gptq_v2", 76),
              # 4-bit groups of a multiple of 64 columns: the byte-shuffle loop, across group boundaries
              (4, 128, False, False, "gptq", 72), (4, 64, False, True, "gptq_v2", 72)]


@pytest.mark.parametrize("nbits, group, desc_act, sym, fmt, rows", GPTQ_CASES)
def test_gptq_equals_gptqmodel(nbits, group, desc_act, sym, fmt, rows, cpu_kernels, monkeypatch):
    w = weight(rows, 384, nbits + group)
    scales, zeros, g_idx = gptq_params(w, nbits, group, sym, desc_act, seed=5)
    qweight, qzeros, stored, g_idx = gptq_pack(w, scales, zeros, g_idx, nbits)
    want = gptq_dequantize(qweight, qzeros, stored, g_idx, nbits, v1=False).T
    if fmt == "gptq":
        qzeros = to_v1(qzeros, nbits)
    row = gptq_row(nbits, group, fmt, desc_act)
    for computed in c_paths(cpu_kernels, monkeypatch):
        for out, dtype in (("BF16", torch.bfloat16), ("F16", torch.float16)):
            ours = row.cpu(gptq_chunk(qweight, qzeros, stored, g_idx), out, None)
            assert torch.equal(torch.from_numpy(ours.view(np.int16)), bits(want.to(dtype))), (out, computed)
        ours = row.cpu(gptq_chunk(qweight, qzeros, stored, g_idx), "F32", None)
        assert torch.equal(torch.from_numpy(ours.view(np.float32)), want.float()), computed


@pytest.mark.parametrize("version, group, cols", [("gemm", 32, 256), ("gemm", 128, 256), ("gemm", -1, 256),
                                                  ("gemm", -1, 260), ("gemv", 32, 256), ("gemv", 64, 256),
                                                  ("gemv", 128, 256), ("gemv", -1, 256)])
def test_awq_equals_autoawq(version, group, cols, cpu_kernels, monkeypatch):
    """(GEMM with 260 inputs: four columns past the computed loop's blocks of eight.)"""
    parts = awq_layers(weight(64, cols, group).half(), group, version)
    for computed in c_paths(cpu_kernels, monkeypatch):
        for out, dtype in (("BF16", torch.bfloat16), ("F16", torch.float16), ("F32", torch.float32)):
            ours = awq_row(version, group).cpu(awq_chunk(parts), out, None)
            assert torch.equal(torch.from_numpy(ours).view(dtype), parts["oracle"].to(dtype)), (out, computed)


def test_extremes_equal_gptqmodel(cpu_kernels, monkeypatch):
    """Every code against zero points 0 and 15 (v1 stores -1: the borrow and carry gptqmodel's conversion makes),
    and scales whose fp16 products overflow to infinity or fall to subnormals and zero."""
    k, n = 64, 48
    codes = torch.arange(k * n).reshape(n, k) % 16
    scales = torch.tensor([65504.0, 6e-8, 1e-5, 3.0, -0.5, 2.0 ** -14], dtype=torch.float16).repeat(8)[:n].float()
    zeros = torch.tensor([0, 15, 8, 1] * 12)[:n].float()
    w = (codes - zeros[:, None]) * scales[:, None]
    g_idx = torch.zeros(k, dtype=torch.int32)
    qweight, qzeros, stored, g_idx = gptq_pack(w, scales[:, None], zeros[:, None], g_idx, 4)
    want = gptq_dequantize(qweight, qzeros, stored, g_idx, 4, v1=False).T
    assert torch.isinf(want).any() and (want == 0).any()
    for computed in c_paths(cpu_kernels, monkeypatch):
        ours = gptq_row(4, -1, "gptq", False).cpu(gptq_chunk(qweight, to_v1(qzeros, 4), stored, g_idx), "BF16", None)
        assert torch.equal(torch.from_numpy(ours.view(np.int16)), bits(want.to(torch.bfloat16))), computed


def test_gptq_copies_equal_gptqmodel():
    """gptq_builders' copies of gptqmodel's pack, dequantize and v1 conversions against gptqmodel 7.x itself. It
    needs torch >= 2.14 and will not install beside ours; to run this, install it apart and put it on the path:
    `pip install --no-deps --target /tmp/gq gptqmodel pypcre logbar threadpoolctl device-smi tokenicer defuser
    pillow` (and accelerate), then `PYTHONPATH=/tmp/gq python -m pytest tests/test_formats_gptq.py -k copies`."""
    try:
        from gptqmodel.nn_modules.qlinear import PackableQuantLinear
        from gptqmodel.nn_modules.qlinear.torch import TorchLinear
        from gptqmodel.utils.model import convert_gptq_v1_to_v2_format_module, convert_gptq_v2_to_v1_format_module
    except Exception as exc:  # noqa: BLE001 - any import failure means: not installed here
        pytest.skip(f"gptqmodel does not import here ({type(exc).__name__}: {exc}); see the docstring")
    w = weight(64, 128, 3)
    for nbits, group, desc_act, sym in ((4, 32, False, False), (4, 64, True, True), (8, -1, False, False),
                                        (8, 32, True, False)):
        scales, zeros, g_idx = gptq_params(w, nbits, group, sym, desc_act, seed=3)
        linear = torch.nn.Linear(128, 64, bias=False)
        linear.weight.data = w.clone()
        m = TorchLinear(bits=nbits, group_size=group, sym=sym, desc_act=desc_act, in_features=128, out_features=64,
                        bias=False)
        m.pack_original(linear, scales, zeros, g_idx)
        qweight, qzeros, stored, g_idx = gptq_pack(w, scales, zeros, g_idx, nbits)
        assert torch.equal(m.qweight, qweight) and torch.equal(m.qzeros, qzeros) and torch.equal(m.scales, stored)
        m._init_wf_unsqueeze_buffers()
        theirs = PackableQuantLinear.dequantize_weight(m)
        assert torch.equal(theirs, gptq_dequantize(qweight, qzeros, stored, g_idx, nbits, v1=False))
        convert_gptq_v2_to_v1_format_module(m, quantize_config=type("Q", (), {"bits": nbits, "pack_dtype": torch.int32}))
        assert torch.equal(m.qzeros, to_v1(qzeros, nbits))
        convert_gptq_v1_to_v2_format_module(m, nbits, torch.int32)
        assert torch.equal(m.qzeros, to_v1(qzeros, nbits) + {4: 0x11111111, 8: 0x01010101}[nbits])


def test_every_row_a_plan_can_name_is_found_by_its_name():
    for name in ("gptq:b4:g128:gptq", "gptq:b8:g-1:gptq_v2:desc_act", "awq_gemm:g128", "awq_gemv:g-1"):
        assert BY_NAME[name].name == name
    for name in ("gptq:b3:g128:gptq", "gptq:b4:g0:gptq", "awq_gemv_fast:g128", "awq_gemm:g"):
        assert name not in BY_NAME


# -- whole checkpoints ------------------------------------------------------------------------------------
KINDS = {
    "gptq-4-g32-desc_act-v1": {"method": "gptq", "bits": 4, "group": 32, "sym": False, "desc_act": True, "format": "gptq"},
    "gptq-8-g-1-sym-v2": {"method": "gptq", "bits": 8, "group": -1, "sym": True, "desc_act": False, "format": "gptq_v2"},
    "awq-gemm-g32": {"method": "awq", "group": 32, "version": "gemm"},
    "awq-gemv-g64": {"method": "awq", "group": 64, "version": "gemv"},
}
TITLES = {"gptq-4-g32-desc_act-v1": "GPTQ 4-bit (group 32, gptq, desc_act)",
          "gptq-8-g-1-sym-v2": "GPTQ 8-bit (group -1, gptq_v2)", "awq-gemm-g32": "AWQ GEMM 4-bit (group 32)",
          "awq-gemv-g64": "AWQ GEMV 4-bit (group 64)"}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptq")
    base = build_hf("qwen3", root / "base")
    return {kind: (root / kind, quantize(base, root / kind, spec), base) for kind, spec in KINDS.items()}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_inspect_names_each_format(kind, made):
    src, oracle, _ = made[kind]
    q = describe(src)["quantization"]
    assert q["unsupported"] is None and q["formats"] == {TITLES[kind]: len(oracle)} and q["int8_weights"] == 0, q


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_dequant_equals_the_library_bit_for_bit_and_loads_as_bf16(kind, made, tmp_path):
    from transformers import AutoModelForCausalLM

    src, oracle, base = made[kind]
    run_cli("dequant", src, tmp_path / "out", "--quiet")
    ours, _ = load_all(tmp_path / "out")
    stored, _ = load_all(src)
    original, _ = load_all(base)
    assert sorted(ours) == sorted(original)  # qweight, qzeros, scales and g_idx gone, every weight back
    for name, t in ours.items():
        want = oracle[name].to(torch.bfloat16) if name in oracle else stored[name]
        assert t.dtype == want.dtype and torch.equal(t.view(torch.int16), want.view(torch.int16)), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_streamed_in_column_spans_of_a_few_rows_gives_the_same_bytes(kind, made, tmp_path):
    """Output runs of 8 rows (stored column spans for GPTQ and AWQ GEMM), three workers, against one chunk."""
    from ckpttool.plan.build import Spec
    from ckpttool.runner import ExecOptions, convert

    src = made[kind][0]
    convert(src, tmp_path / "whole", Spec(dequant=True), ExecOptions(quiet=True))
    convert(src, tmp_path / "runs", Spec(dequant=True), ExecOptions(quiet=True, chunk_bytes=256, workers=3))
    for f in (tmp_path / "whole").glob("*.safetensors"):
        assert f.read_bytes() == (tmp_path / "runs" / f.name).read_bytes(), f.name


@pytest.mark.parametrize("kind", ["gptq-4-g32-desc_act-v1", "awq-gemm-g32"])
def test_convert_mp2_straight_equals_from_the_library_bf16(kind, made, tmp_path):
    src, oracle, base = made[kind]
    stored, file_of = load_all(src)
    plain = {n: t for n, t in stored.items() if not n.endswith((".qweight", ".qzeros", ".scales", ".g_idx"))}
    for name in oracle:
        plain[name], file_of[name] = oracle[name].to(torch.bfloat16), file_of[name[: -len("weight")] + "qweight"]
    write_like(base, tmp_path / "bf16", plain, file_of)
    run_cli("convert", src, tmp_path / "ours", "--mp", 2, "--quiet")
    run_cli("convert", tmp_path / "bf16", tmp_path / "ref", "--mp", 2, "--quiet")
    for rank in range(2):
        f = f"model{rank}-mp2.safetensors"
        assert (tmp_path / "ours" / f).read_bytes() == (tmp_path / "ref" / f).read_bytes(), f


# -- refused ---------------------------------------------------------------------------------------------
Q = "model.layers.1.self_attn.q_proj."


def _set(name: str, index, value):
    def change(tensors):
        t = tensors[name].clone()
        t[index] = value
        tensors[name] = t
    return change


REFUSED = {  # case: (checkpoint, tensor change, config change, message, what the message names)
    "gptq bits 3": ("gptq-4-g32-desc_act-v1", None, lambda q: q.update(bits=3), "bits 3", "config.json"),
    "gptq marlin": ("gptq-4-g32-desc_act-v1", None, lambda q: q.update(checkpoint_format="marlin"),
                    "checkpoint_format 'marlin'", "config.json"),
    "gptq dynamic": ("gptq-4-g32-desc_act-v1", None, lambda q: q.update(dynamic={"-:.*": {}}), "dynamic", "config.json"),
    "gptq group 64 declared": ("gptq-4-g32-desc_act-v1", None, lambda q: q.update(group_size=64),
                               "in groups of 64", "model.layers."),
    "gptq bits 8 declared": ("gptq-4-g32-desc_act-v1", None, lambda q: q.update(bits=8), "8-bit codes", "model.layers."),
    "awq without zero points": ("awq-gemm-g32", None, lambda q: q.update(zero_point=False), "zero_point False",
                                "config.json"),
    "awq gemv_fast": ("awq-gemm-g32", None, lambda q: q.update(version="gemv_fast"), "version 'gemv_fast'",
                      "config.json"),
    "awq gemv declared for gemm": ("awq-gemm-g32", None, lambda q: q.update(version="gemv"), "expected", "model.layers."),
    "awq layer left out": ("awq-gemm-g32", None, lambda q: q.update(modules_to_not_convert=["q_proj"]),
                           "does not cover module", "q_proj.qweight"),
    "gptq scales F32": ("gptq-8-g-1-sym-v2", lambda t: t.update({Q + "scales": t[Q + "scales"].float()}), None,
                        "scale dtype is F32", Q + "scales"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_misdeclared_or_malformed_checkpoints_are_refused_by_name(case, made, tmp_path):
    kind, change, config_change, message, named = REFUSED[case]
    src = copy_changed(made[kind][0], tmp_path / "src", change, config_change)
    proc = run_cli("dequant", src, tmp_path / "out", check=False)
    assert proc.returncode != 0 and message in proc.stderr and named in proc.stderr and "fix:" in proc.stderr, \
        proc.stderr
    assert not (tmp_path / "out").exists()


EXECUTION = {  # refused when the tensor is read: (checkpoint, change, config change, message, what it names)
    "g_idx out of range": ("gptq-4-g32-desc_act-v1", _set(Q + "g_idx", 5, 99), None, "g_idx[5] is 99, outside",
                           Q + "g_idx"),
    "g_idx not k // group without desc_act": ("gptq-4-g32-desc_act-v1", None, lambda q: q.update(desc_act=False),
                                              "while quantization_config says desc_act false", ".g_idx'"),
    "NaN scale": ("awq-gemv-g64", _set(Q + "scales", (7, 0), float("nan")), None, "NaN or infinite values (first in row 7)",
                  Q + "scales"),
    "infinite GPTQ scale": ("gptq-8-g-1-sym-v2", _set(Q + "scales", (0, 9), float("inf")), None,
                            "NaN or infinite values", Q + "scales"),
}


@pytest.mark.parametrize("case", sorted(EXECUTION))
def test_bad_values_are_refused_at_execution_naming_the_tensor(case, made, tmp_path):
    kind, change, config_change, message, named = EXECUTION[case]
    src = copy_changed(made[kind][0], tmp_path / "src", change, config_change)
    proc = run_cli("dequant", src, tmp_path / "out", check=False)
    assert proc.returncode != 0 and message in proc.stderr and named in proc.stderr and "fix:" in proc.stderr, proc.stderr
    assert not list((tmp_path / "out").glob("*.safetensors"))


@pytest.mark.parametrize("kind", ["gptq-8-g-1-sym-v2", "awq-gemv-g64"])
def test_shard_keeping_gptq_or_awq_is_refused(kind, made, tmp_path):
    proc = run_cli("shard", made[kind][0], tmp_path / "out", "--mp", 2, check=False)
    assert proc.returncode != 0 and "can only be dequantized" in proc.stderr and not (tmp_path / "out").exists()
