"""The quantize stage streams: every --to format but gpt-fast's int4 scales (stored transposed) is made in bounded
runs of the weight's rows, as dequant is, and a run's bytes are the whole tensor's: outputs written in runs of a
few rows equal those written whole (which equal the library's, tests/test_quantize_targets.py). NVFP4, whose global
scale is the whole tensor's amax, reads the weight twice in runs (amax, then codes). Peak memory does not grow with
the model's size (1 layer against 12), nor, for NVFP4, with one weight's size."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dense_models import build_hf

from ckpttool.plan.build import Spec
from ckpttool.runner import ExecOptions, convert

STREAMED = ("w4a16", "w4a16-asym", "w8a16", "fp8-channel", "fp8-block", "mxfp4", "nvfp4a16", "fp8-block-deepseek",
            "int8")


def _llama(dst, layers: int, hidden: int = 256, inter: int = 512):
    spec = dict(cls="LlamaForCausalLM", config="LlamaConfig", vocab_size=256, hidden_size=hidden,
                intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                head_dim=hidden // 2, max_position_embeddings=64, tie_word_embeddings=False)
    return build_hf("llama", dst, seed=4, spec=spec)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _llama(tmp_path_factory.mktemp("stream") / "llama", 1)


@pytest.mark.parametrize("fmt", STREAMED + ("int4",))
def test_runs_of_a_few_rows_write_the_bytes_of_the_whole_tensor(llama, fmt, tmp_path):
    convert(llama, tmp_path / "whole", Spec(quantize=fmt), ExecOptions(quiet=True, workers=1))
    runs = convert(llama, tmp_path / "runs", Spec(quantize=fmt), ExecOptions(quiet=True, workers=3, chunk_bytes=2048))
    chunks = sum(v for k, v in runs.timings.to_json().get("counts", {}).items() if k.startswith("chunks_by_cpu"))
    if fmt in STREAMED:  # 7 weights, 2 streamed outputs each, every one in 2 runs or more (FP8 blocks: 128 rows)
        assert chunks >= 7 * 2 * 2, runs.timings.to_json()
    for f in (tmp_path / "whole").glob("*.safetensors"):
        assert f.read_bytes() == (tmp_path / "runs" / f.name).read_bytes(), f.name


_MEASURE = """
import json, re, sys
from pathlib import Path
from ckpttool.plan.build import Spec
from ckpttool.runner import ExecOptions, convert
r = convert(Path(sys.argv[1]), Path(sys.argv[2]), Spec(quantize=sys.argv[3]),
            ExecOptions(quiet=True, max_memory=64 << 20, workers=2, chunk_bytes=1 << 20))
hwm = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
print(json.dumps({"rss_kib": hwm, "bytes": r.bytes_written}))
"""


def test_peak_rss_is_flat_across_model_sizes(tmp_path):
    """FP8 blocks (half the input's bytes out, so that the extra output dwarfs the noise of RSS, which comes in
    steps of the hashing threads' 8 MiB windows: tests/test_memory.py); the other streamed rows run the same way."""
    fmt = "fp8-block-deepseek"

    def peak(src, dst):
        out = subprocess.run([sys.executable, "-c", _MEASURE, str(src), str(dst), fmt], check=True,
                             capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])
    a = peak(_llama(tmp_path / "one", 1, 1024, 4096), tmp_path / "o1")
    b = peak(_llama(tmp_path / "twelve", 12, 1024, 4096), tmp_path / "o12")
    growth_mib, extra_mib = (b["rss_kib"] - a["rss_kib"]) / 1024, (b["bytes"] - a["bytes"]) / 2**20
    assert extra_mib > 150, "the larger model must be substantially larger for this to mean anything"
    assert growth_mib < 0.25 * extra_mib, f"peak RSS grew {growth_mib:.0f} MiB for {extra_mib:.0f} MiB more output"


def test_nvfp4_peak_rss_does_not_grow_with_one_weights_size(tmp_path):
    """NVFP4's global scale is the whole weight's amax: a first pass over runs of rows finds it, so a weight 32x
    larger (three 64 MiB MLP weights) costs no more memory than a small one. (Made whole, as before, the larger
    one peaked ~700 MiB higher on this box.)"""
    def peak(inter: int, dst):
        spec = dict(cls="LlamaForCausalLM", config="LlamaConfig", vocab_size=256, hidden_size=1024,
                    intermediate_size=inter, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=512, max_position_embeddings=64, tie_word_embeddings=False)
        src = build_hf("llama", tmp_path / f"l{inter}", seed=4, spec=spec)
        out = subprocess.run([sys.executable, "-c", _MEASURE, str(src), str(dst), "nvfp4a16"], check=True,
                             capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])
    a, b = peak(1024, tmp_path / "o-small"), peak(32768, tmp_path / "o-large")
    weight_mib = 1024 * 32768 * 2 / 2**20
    growth_mib = (b["rss_kib"] - a["rss_kib"]) / 1024
    assert b["bytes"] - a["bytes"] > 50 << 20, "the larger weights must be substantially larger to mean anything"
    assert growth_mib < 0.5 * weight_mib, f"peak RSS grew {growth_mib:.0f} MiB for {weight_mib:.0f} MiB weights"


def test_via_cpu_hands_the_cpu_function_its_carriers_and_returns_its_bytes():
    """The quantize and repack rows' CUDA function runs their CPU function on host copies (formats/row.via_cpu):
    bfloat16 and float8 tensors, which numpy cannot hold, arrive as the CPU path's integer carriers, and the result
    comes back as a tensor of the same bytes (here on the CPU device; tests/test_quantize_gpu.py runs it on CUDA)."""
    import numpy as np
    import torch

    from ckpttool.formats.row import Chunk, via_cpu

    seen = {}

    def cpu(c, dtype, into):
        seen.update(values=c.values.dtype, scale=c.sides["scale"].dtype, dtype=dtype)
        return np.concatenate([c.values.view(np.uint8), c.sides["scale"].view(np.uint8)], axis=1)

    values = torch.randn(4, 8, dtype=torch.bfloat16)
    scale = torch.randn(4, 2).to(torch.float8_e4m3fn)
    y, bad = via_cpu(cpu)(Chunk(values, "BF16", {"scale": scale}, {"scale": "F8_E4M3"}, None), torch.bfloat16)
    assert seen == {"values": np.uint16, "scale": np.uint8, "dtype": "BF16"} and bad is None
    assert torch.equal(y[:, :16], values.view(torch.uint8)) and torch.equal(y[:, 16:], scale.view(torch.uint8))


def test_fp8_experts_cuda_function_gives_its_cpu_bytes_from_float8_tensors():
    """The stacked FP8 experts row's device function (via_cpu) takes float8 codes and E8M0 scales as tensors, which
    numpy cannot hold, and returns the CPU function's BF16 words (run here with CPU tensors; on CUDA in
    tests/test_quantize_gpu.py)."""
    import numpy as np
    import torch

    from ckpttool.formats.fp8_experts import experts_row
    from ckpttool.formats.row import Chunk

    row = experts_row(128, 128, "ue8m0")
    codes = torch.randn(2, 128, 256).to(torch.float8_e4m3fn)
    scale = torch.tensor([[[120, 127]], [[130, 125]]], dtype=torch.uint8)
    want = row.cpu(Chunk(codes.view(torch.uint8).numpy(), "F8_E4M3", {"scale": scale.numpy()}, {"scale": "F8_E8M0"}),
                   "BF16", None)
    got, bad = row.cuda(Chunk(codes, "F8_E4M3", {"scale": scale}, {"scale": "F8_E8M0"}), torch.bfloat16)
    assert bad is None and got.shape == (2, 256, 128) and want.dtype == np.uint16
    assert np.array_equal(got.numpy().view(np.uint16), want)


@pytest.mark.parametrize("transform", sorted(__import__("ckpttool.formats.outputs_stream", fromlist=["x"])
                                             ._BY_TRANSFORM))
def test_every_streamed_rows_device_function_runs_on_its_own_example(transform):
    """CUDA start-up runs each row's device function on the row's example (a 128x256 BF16 weight); here on CPU
    tensors, so a leaf whose last dimension is 1 (w4a16-asym's zero points of one group: a [16, 1] view with a
    column stride of 16, which torch calls contiguous) is handed back as bytes without torch refusing the view."""
    import numpy as np
    import torch

    from ckpttool.formats.outputs_stream import named

    row = named(transform)
    example = row.example(torch.device("cpu"))
    y, bad = row.cuda(example, torch.bfloat16)
    want = row.cpu(type(example)(example.values.view(torch.int16).numpy().view(np.uint16), "BF16"), "BF16", None)
    assert bad is None and y.shape == want.shape and np.array_equal(y.numpy().view(np.uint8), want.view(np.uint8))
