"""The quantize stage's C loops (kernels/native/quant.c) write the bits of kernels/quant_ct.py's torch operations,
which tests/test_quantize_targets.py holds to compressed-tensors' own compress_model: pack-quantized INT4 (symmetric
and with zero points), INT8, NVFP4 and MXFP4 of BF16 weights, on random rows and on the cases rounding decides
(values whose quotient by the scale is a tie or a threshold, all-zero groups, one-sided groups, large and tiny
magnitudes, subnormals, a group whose MXFP4 scale overflows)."""

from __future__ import annotations

import pytest
import torch

from ckpttool.formats.outputs import target
from ckpttool.kernels import quant_ct, quant_native
from ckpttool.kernels.native import library

pytestmark = pytest.mark.skipif(library() is None, reason="the C library is not built here (setup.py)")
CASES = [("w4a16", 4, True), ("w4a16-asym", 4, False), ("w8a16", 8, True)]


def _weights(rows: int = 64, cols: int = 1024, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, cols, generator=gen) * torch.logspace(-6, 2, rows).unsqueeze(1)).to(torch.bfloat16)
    w[0, :128] = 0  # an all-zero group (symmetric: eps scale; asymmetric: refused to torch)
    w[1, :128] = torch.linspace(0.0, 3.0, 128)  # one-sided: lo = 0
    w[2, :128] = -torch.linspace(0.0, 7.5, 128)  # one-sided negative, its max a multiple of 7.5
    w[3, :128] = torch.arange(128) * 0.5 - 8  # quotients on ties of the rounding
    w[4, :128] = torch.tensor(1e-39).to(torch.bfloat16) * torch.arange(128)  # subnormals
    w[5, 128:256] = 3e38  # near BF16's largest
    return w


def _torch(w: torch.Tensor, bits: int, symmetric: bool):
    scale, zero = quant_ct.qparams(*quant_ct.min_max(w, "group", 128), kind="int", bits=bits, symmetric=symmetric)
    q = quant_ct.quantize_grouped(w, scale, None if symmetric else zero, 128, kind="int", bits=bits, dtype=torch.int8)
    return quant_ct.pack_to_int32(q, bits), scale, zero


@pytest.mark.parametrize("fmt,bits,symmetric", CASES)
def test_c_loops_write_the_torch_bits(fmt, bits, symmetric):
    for seed in range(3):
        w = _weights(seed=seed)
        if not symmetric:
            w[0, :128] = 1.0  # a range-0 group falls back as a whole: tested below
        got = quant_native.int_group_bf16(w, 128, bits, symmetric)
        assert got is not None
        packed, scale, zero = _torch(w, bits, symmetric)
        assert torch.equal(got[0], packed), (fmt, seed)
        assert torch.equal(got[1].view(torch.int16), scale.view(torch.int16)), (fmt, seed)
        if not symmetric:
            assert torch.equal(got[2], zero.reshape(got[2].shape)), (fmt, seed)


@pytest.mark.parametrize("fmt,bits,symmetric", CASES)
@pytest.mark.parametrize("zero_group", [False, True])
def test_the_rows_compute_is_the_torch_one_where_c_runs_and_where_it_falls_back(fmt, bits, symmetric, zero_group,
                                                                               monkeypatch):
    """Every output at once and each on its own (a task computes one), with C loops and without; an asymmetric
    all-zero group sends the weight to torch."""
    w = _weights(seed=5)
    if not zero_group:
        w[0, :128] = 1.0
    assert (quant_native.int_group_bf16(w, 128, bits, symmetric) is None) == (zero_group and not symmetric)
    row = target(fmt)
    native = {None: row.compute(w), **{o.leaf: row.compute(w, o.leaf) for o in row.outputs}}
    monkeypatch.setenv("CKPTTOOL_NATIVE", "0")
    assert not quant_native.usable(w, 128)
    plain = row.compute(w)
    assert native[None].keys() == plain.keys() == {o.leaf for o in row.outputs}
    for leaf in plain:
        for got in (native[None][leaf], native[leaf][leaf]):
            assert got.dtype == plain[leaf].dtype and torch.equal(got.view(torch.uint8), plain[leaf].view(torch.uint8)), \
                leaf


@pytest.mark.parametrize("fmt", ["nvfp4a16", "mxfp4"])
def test_fp4_c_loops_write_the_torch_bits(fmt, monkeypatch):
    row = target(fmt)
    for seed in range(3):
        w = _weights(seed=seed)
        w[6, :128] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 16) * (-1) ** torch.arange(128)
        w[7, :16] = torch.tensor([0.0, -0.0, 0.25, -0.25] * 4)
        if seed == 2:  # near BF16's largest, MXFP4's rounded power of two overflows: that weight runs torch's path
            w[8, 128:160] = 3.3895e38
        else:
            w[5, 128:256] = 1e38
        monkeypatch.delenv("CKPTTOOL_NATIVE", raising=False)
        ran_c = quant_native.fp4_outputs(w, None, fmt == "mxfp4", torch.ones(1)) is not None
        assert ran_c == (seed != 2 or fmt == "nvfp4a16"), seed
        native = {None: row.compute(w), **{o.leaf: row.compute(w, o.leaf) for o in row.outputs}}
        monkeypatch.setenv("CKPTTOOL_NATIVE", "0")
        plain = row.compute(w)
        assert native[None].keys() == plain.keys() == {o.leaf for o in row.outputs}
        for leaf in plain:
            for got in (native[None][leaf], native[leaf][leaf]):
                assert got.dtype == plain[leaf].dtype, leaf
                assert torch.equal(got.view(torch.uint8), plain[leaf].view(torch.uint8)), (fmt, seed, leaf)


@pytest.mark.parametrize("fmt", ["nvfp4a16", "mxfp4"])
def test_fp4_thresholds_round_as_the_library(fmt, monkeypatch):
    """Every group's largest value 6 (NVFP4's global scale 448 / 6 * 6: each value divided by exactly 1): the
    values on and beside the library's thresholds, where `x < 0.75` rounds down but `x <= 1.25` does too."""
    edges = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    near = torch.cat([edges, torch.nextafter(edges, torch.zeros(8)), torch.nextafter(edges, torch.full((8,), 9.0)),
                      edges * 0.5])
    w = torch.cat([near, -near]).repeat(8, 4)[:, :128].to(torch.bfloat16)
    w[:, ::16] = 6.0
    row = target(fmt)
    assert quant_native.fp4_outputs(w, None, fmt == "mxfp4", torch.tensor([448.0])) is not None
    native = row.compute(w)
    monkeypatch.setenv("CKPTTOOL_NATIVE", "0")
    plain = row.compute(w)
    for leaf in plain:
        assert torch.equal(native[leaf].view(torch.uint8), plain[leaf].view(torch.uint8)), leaf
