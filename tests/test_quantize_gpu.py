"""The quantize and repack rows' CUDA paths give the CPU's bytes (which tests/test_quantize_targets.py and
test_repack.py hold to each library's). The streamed quantize rows run the same torch ops on CUDA tensors
(formats/outputs_stream.py); the repack rows copy to the host and run the CPU kernel (formats/repack.py). Never run
on a GPU by the author of this file: `pytest -m gpu -o addopts='' tests/test_quantize_gpu.py` on a device."""

from __future__ import annotations

import pytest
import torch

from test_quantize_stream import STREAMED, _llama

from ckpttool.errors import InputError
from ckpttool.plan.build import Spec
from ckpttool.runner import ExecOptions, convert

pytestmark = pytest.mark.gpu


def _counts(report) -> dict[str, int]:
    return {k: v for k, v in report.timings.to_json()["counts"].items() if k.startswith("chunks_")}


def _same_files(a, b) -> None:
    names = sorted(p.name for p in a.iterdir() if p.is_file())
    assert names == sorted(p.name for p in b.iterdir() if p.is_file())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _llama(tmp_path_factory.mktemp("gpu-quantize") / "llama", 1)


@pytest.mark.parametrize("fmt", STREAMED)
def test_streamed_quantize_rows_on_cuda_write_the_cpu_bytes(llama, fmt, tmp_path):
    assert torch.cuda.is_available()
    convert(llama, tmp_path / "cpu", Spec(quantize=fmt), ExecOptions(quiet=True, device="cpu"))
    gpu = convert(llama, tmp_path / "gpu", Spec(quantize=fmt),
                  ExecOptions(quiet=True, device="cuda", chunk_bytes=2048, workers=3, wait_for_cuda=True))
    assert _counts(gpu).get("chunks_on_gpu", 0) > 0, _counts(gpu)
    _same_files(tmp_path / "cpu", tmp_path / "gpu")


def test_nan_weight_is_refused_on_cuda(llama, tmp_path):
    from quant_builders import load_all, write_like

    tensors, file_of = load_all(llama)
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].clone()
    tensors[name][300, 5] = float("nan")
    write_like(llama, tmp_path / "bad", tensors, file_of)
    with pytest.raises(InputError) as err:
        convert(tmp_path / "bad", tmp_path / "out", Spec(quantize="w4a16"),
                ExecOptions(quiet=True, device="cuda", chunk_bytes=2048, wait_for_cuda=True))
    assert name in str(err.value) and "row 300, column 5" in str(err.value), str(err.value)


@pytest.mark.parametrize("to", ["fp8-block-deepseek", "fp8-32x32"])
def test_repack_rows_on_cuda_write_the_cpu_bytes(to, tmp_path):
    from deepseek_v4_models import build
    from test_deepseek_v4_fp8 import WIDE, published_form

    bf16 = build(tmp_path / "bf16", spelling="deepseek", mtp=True, **WIDE)
    src = tmp_path / "fp8"
    published_form(bf16, src, 128)
    spec = Spec(quantize=to)
    convert(src, tmp_path / "cpu", spec, ExecOptions(quiet=True, device="cpu"))
    gpu = convert(src, tmp_path / "gpu", spec, ExecOptions(quiet=True, device="cuda", chunk_bytes=2048,
                                                          wait_for_cuda=True))
    assert _counts(gpu).get("chunks_on_gpu", 0) > 0, _counts(gpu)
    _same_files(tmp_path / "cpu", tmp_path / "gpu")


def test_gpt_oss_repack_and_its_readback_on_cuda_write_the_cpu_bytes(tmp_path):
    """gpt-oss's MXFP4 experts -> FP8 (formats/repack.py), and that FP8 dequantized (formats/fp8_experts.py), on
    CUDA: the CPU's bytes."""
    from ckpttool.families.gpt_oss.demo import build_gpt_oss_checkpoint

    src = build_gpt_oss_checkpoint(tmp_path / "mxfp4", mxfp4=True, seed=7)
    spec = Spec(quantize="fp8-block-deepseek")
    convert(src, tmp_path / "cpu", spec, ExecOptions(quiet=True, device="cpu"))
    convert(src, tmp_path / "gpu", spec, ExecOptions(quiet=True, device="cuda", wait_for_cuda=True))
    _same_files(tmp_path / "cpu", tmp_path / "gpu")
    convert(tmp_path / "cpu", tmp_path / "bf16-cpu", Spec(dequant=True), ExecOptions(quiet=True, device="cpu"))
    gpu = convert(tmp_path / "cpu", tmp_path / "bf16-gpu", Spec(dequant=True),
                  ExecOptions(quiet=True, device="cuda", wait_for_cuda=True))
    assert _counts(gpu).get("chunks_on_gpu", 0) > 0, _counts(gpu)
    _same_files(tmp_path / "bf16-cpu", tmp_path / "bf16-gpu")


def test_sharded_v4_repack_on_cuda_writes_the_cpu_bytes_and_verifies(tmp_path):
    """`quantize --to fp8-block-deepseek --mp 2` on CUDA: the repack rows (host kernels) and wo_a's E8M0 128x128
    dequant into BF16 (formats/fp8.py's block row on the GPU) give the CPU's shards; verify on CUDA loads those FP8
    shards (E8M0 scales dequantized by the Triton kernel) and agrees with transformers: the mp 2 shards where the
    machine has two GPUs, the mp 1 shard always."""
    from deepseek_v4_models import PROMPT, build
    from test_deepseek_v4_fp8 import WIDE, published_form

    from ckpttool.verify.run import run_verify

    bf16 = build(tmp_path / "bf16", spelling="deepseek", mtp=True, **WIDE)
    src = tmp_path / "fp8"
    published_form(bf16, src, 128)
    spec = Spec(quantize="fp8-block-deepseek", mp=2)
    convert(src, tmp_path / "cpu", spec, ExecOptions(quiet=True, device="cpu"))
    gpu = convert(src, tmp_path / "gpu", spec, ExecOptions(quiet=True, device="cuda", chunk_bytes=2048,
                                                          wait_for_cuda=True))
    assert _counts(gpu).get("chunks_on_gpu", 0) > 0, _counts(gpu)
    _same_files(tmp_path / "cpu", tmp_path / "gpu")
    convert(src, tmp_path / "reference", Spec(dequant=True), ExecOptions(quiet=True, device="cpu"))
    # NCCL takes a GPU per rank: the mp 2 shards verify on CUDA where there are two, and one rank's shard on one GPU
    convert(src, tmp_path / "gpu1", Spec(quantize="fp8-block-deepseek", mp=1),
            ExecOptions(quiet=True, device="cuda", chunk_bytes=2048, wait_for_cuda=True))
    for shards in ("gpu", "gpu1") if torch.cuda.device_count() >= 2 else ("gpu1",):
        report = run_verify(tmp_path / shards, reference=tmp_path / "reference", prompt_ids=PROMPT,
                            max_new_tokens=6, device="cuda")
        assert report.ok and "greedy ids agree" in report.render(tmp_path / shards), shards
