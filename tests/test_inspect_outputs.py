"""`inspect` on every kind of output ckpttool writes, each summary checked against the files' own
headers (read here with json, independently of ckpttool's parser)."""

from __future__ import annotations

import json
import struct
from collections import Counter
from pathlib import Path

import pytest

from conftest import run_cli


def _headers(directory: Path) -> list[tuple[str, str, str, int]]:
    """(file, name, dtype, bytes) of every tensor of every *.safetensors in directory."""
    out = []
    for f in sorted(directory.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for name, v in header.items():
            if name != "__metadata__":
                out.append((f.name, name, v["dtype"], v["data_offsets"][1] - v["data_offsets"][0]))
    return out


def _inspect(out: Path) -> dict:
    text = run_cli("inspect", out).stdout  # the human summary renders too
    assert str(out) in text.splitlines()[0]
    return json.loads(run_cli("inspect", out, "--json", "--tensors").stdout)


def _check_summary(out: Path, layout: str, mp: int | None = None) -> dict:
    info, truth = _inspect(out), _headers(out)
    assert (info["layout"], info["mp"]) == (layout, mp)
    assert info["tensors"] == len(truth) and len(info["all"]) == len(truth)
    assert info["names"] == len({n for _, n, _, _ in truth})
    assert info["total_bytes"] == sum(b for *_, b in truth)
    assert info["files"] == sorted({f for f, *_ in truth})
    assert {d: v["tensors"] for d, v in info["dtypes"].items()} == dict(Counter(d for _, _, d, _ in truth))
    assert sum(g["count"] for g in info["groups"]) == len(truth)
    return info


@pytest.mark.parametrize("mp", [2, 4])
def test_inspect_deepseek_mp_shards_repeat_names_across_ranks(tiny_v3, tmp_path, mp):
    run_cli("convert", tiny_v3, tmp_path / "o", "--mp", mp, "--quiet")
    info = _check_summary(tmp_path / "o", "mp", mp)
    assert info["names"] < info["tensors"]  # replicated and split tensors are in every rank file
    assert info["model_type"] == "deepseek_v3" and set(info["dtypes"]) <= {"BF16", "F32"}
    assert f"model0-mp{mp}.safetensors:embed.weight" in info["all"]
    assert f"in mp{mp} shards" in run_cli("inspect", tmp_path / "o").stdout


def test_inspect_fp8_kept_mp_shards_counts_their_block_scales(tiny_v3_no_mtp, tmp_path):
    run_cli("shard", tiny_v3_no_mtp, tmp_path / "o", "--mp", 2, "--quiet")
    info = _check_summary(tmp_path / "o", "mp", 2)
    fp8_names = {n for f, n, d, _ in _headers(tmp_path / "o") if d == "F8_E4M3"}
    assert info["quantization"]["fp8_block_weights"] == len(fp8_names) > 0
    assert info["quantization"]["config"]["quant_method"] == "fp8"


def test_inspect_hf_dequant_output(tiny_v3, tmp_path):
    run_cli("dequant", tiny_v3, tmp_path / "o", "--quiet")
    info = _check_summary(tmp_path / "o", "hf")
    assert info["names"] == info["tensors"] and info["quantization"]["fp8_block_weights"] == 0
    assert info["quantization"]["config"] is None


def test_inspect_dense_mp_shards_and_their_merge(tiny_llama, tmp_path):
    run_cli("shard", tiny_llama, tmp_path / "mp", "--mp", 2, "--quiet")
    _check_summary(tmp_path / "mp", "mp", 2)
    run_cli("merge", tmp_path / "mp", tmp_path / "hf", "--quiet")
    merged = _check_summary(tmp_path / "hf", "hf")
    assert merged["tensors"] == _check_summary(tiny_llama, "hf")["tensors"]


def test_inspect_gpt_oss_mp_shards_mxfp4_kept(tiny_gpt_oss, tmp_path):
    run_cli("shard", tiny_gpt_oss, tmp_path / "o", "--mp", 2, "--quiet")
    info = _check_summary(tmp_path / "o", "mp", 2)
    assert info["model_type"] == "gpt_oss" and info["quantization"]["mxfp4_blocks"] > 0


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_inspect_int_quantized_output(tiny_llama, tmp_path, fmt):
    recipe = tmp_path / "q.yaml"
    recipe.write_text(f"name: q\nstages:\n  - quantize: {{format: {fmt}, group_size: 32}}\n")
    run_cli("run", recipe, "-i", tiny_llama, "-o", tmp_path / "o", "--quiet")
    info = _check_summary(tmp_path / "o", "hf")
    quantized = {n for _, n, d, _ in _headers(tmp_path / "o") if d in ("U8", "I8")}
    assert info["quantization"][f"{fmt}_weights"] == len(quantized) > 0
    assert info["quantization"]["config"]["format"] == fmt
