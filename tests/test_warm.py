"""The executable loads the CPU FP8 kernels on a thread beside its own imports (kernels/warm.py) only where a
CPU conversion of an FP8 checkpoint is asked for; a bad or missing config.json is a "no", never an error."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ckpttool.kernels import warm


@pytest.fixture
def fp8_src(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8",
                                                                         "weight_block_size": [128, 128]}}))
    return src


@pytest.mark.parametrize("args, want", [
    ("convert {src} {dst} --mp 8", True),
    ("convert --mp 8 {src} {dst}", True),
    ("-v convert {src} {dst}", True),
    ("dequant {src} {dst}", True),
    ("convert {src} {dst} --device auto", True),
    ("shard {src} {dst} --mp 8 --dtype bf16", True),
    ("shard {src} {dst} --mp 8 --dtype=bf16", True),
    ("shard {src} {dst} --mp 8", False),  # FP8 kept: nothing to dequantize
    ("convert {src} {dst} --dtype fp8", False),
    ("convert {src} {dst} --device cuda", False),
    ("convert {src} {dst} --device=cuda", False),
    ("convert {src} {dst} --help", False),
    ("inspect {src}", False),
    ("verify {src} {dst}", False),
    ("", False),
])
def test_wanted_by_command_line(fp8_src, tmp_path, args, want):
    argv = args.format(src=fp8_src, dst=tmp_path / "out").split()
    assert warm.wanted(argv) is want


@pytest.mark.parametrize("config", [
    None,  # no config.json
    json.dumps({"model_type": "llama"}),
    json.dumps({"quantization_config": {"quant_method": "compressed-tensors"}}),
    json.dumps({"quantization_config": {"quant_method": "mxfp4"}}),
    json.dumps({"quantization_config": "fp8"}),
    json.dumps(["not", "an", "object"]),
    "{not json",
    json.dumps({"quantization_config": {"quant_method": "fp8"}, "pad": "x" * warm.CONFIG_MAX_BYTES}),
])
def test_only_an_fp8_config_is_a_yes(tmp_path, config):
    src = tmp_path / "src"
    src.mkdir()
    if config is not None:
        (src / "config.json").write_text(config)
    assert warm.wanted(["convert", str(src), str(tmp_path / "out")]) is False


def test_numba_off_is_a_no(fp8_src, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTTOOL_NUMBA", "0")
    assert warm.wanted(["convert", str(fp8_src), str(tmp_path / "out")]) is False


def test_the_thread_loads_the_fp8_kernel(fp8_src, tmp_path):
    """In a fresh interpreter, so nothing else has loaded the kernel before."""
    pytest.importorskip("numba")
    script = f"""
import sys
from ckpttool.kernels import fp8_gather, warm
assert warm.start(["inspect", {str(fp8_src)!r}]) is None
thread = warm.start(["convert", {str(fp8_src)!r}, {str(tmp_path / "out")!r}])
assert thread is not None and thread.daemon
thread.join(timeout=120)
assert not thread.is_alive()
assert fp8_gather.kernel().signatures  # compiled, or loaded from the cache, for a real call's types
print("warm ok")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "warm ok" in proc.stdout, proc.stderr[-3000:]
