"""NVIDIA ModelOpt FP8 per tensor and per channel (formats/modelopt.py), an FP8 KV cache's scales, and
MIXED_PRECISION checkpoints (FP8 attention beside NVFP4 MLPs): each checkpoint written by ModelOpt 0.47's own
`mtq.quantize` (calibrated on the CPU) and `export_hf_checkpoint`, and every weight equal, bit for bit, to ModelOpt's
own dequantization (FP8QTensor.dequantize: `q.to(dtype) * scale.to(dtype)`; NVFP4QTensor.dequantize)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from conftest import assert_same_tensors, load_dir, run_cli
from quant_builders import load_all, modelopt_decompress, write_like

from ckpttool.describe import describe
from ckpttool.formats import Chunk
from ckpttool.formats.modelopt import MODELOPT_FP8_CHANNEL, MODELOPT_FP8_TENSOR, MODELOPT_NVFP4

mtq = pytest.importorskip("modelopt.torch.quantization")

OUT = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """ModelOpt's own: FP8QTensor.dequantize (a per-channel scale broadcast along its rows)."""
    from modelopt.torch.quantization.qtensor.fp8_tensor import FP8QTensor

    s = scale.reshape(-1, 1) if scale.numel() > 1 else scale
    return FP8QTensor(q.shape, dtype, q).dequantize(dtype=dtype, scale=s)


def carrier(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy() if t.element_size() == 2 else t.view(torch.int32).numpy()


@pytest.mark.parametrize("row, shape", [(MODELOPT_FP8_TENSOR, ()), (MODELOPT_FP8_TENSOR, (1,)),
                                        (MODELOPT_FP8_CHANNEL, (96,)), (MODELOPT_FP8_CHANNEL, (96, 1))])
def test_fp8_every_code_equals_modelopt(row, shape, cpu_kernels):
    """Every e4m3 code under scales whose rounding to the output dtype matters (and overflows it)."""
    gen = torch.Generator().manual_seed(1)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(96, 1)
    codes[(codes & 0x7F) == 0x7F] = 0  # NaN codes are refused
    q = codes[:, torch.randperm(256, generator=gen)].contiguous().view(torch.float8_e4m3fn)
    # finite in every output dtype (one past F16's range makes inf * 0 = NaN: refused, tested below)
    edge = torch.tensor([1.0001, 3.1e-3, 2.9e-8, 7.7e-42, 0.0123457, 1.7e4, 5.5e4, 1.2e-5, 3.3e-9])
    scale = (edge[torch.randint(0, len(edge), (96,), generator=gen)] * (1 + torch.rand(96, generator=gen) / 7))
    scale = scale.reshape(shape) if shape in ((96,), (96, 1)) else scale[:1].reshape(shape)
    for out, dtype in OUT.items():
        ours = row.cpu(Chunk(q.view(torch.uint8).numpy(), "F8_E4M3", {"scale": scale.numpy()}, {"scale": "F32"}), out,
                       None)
        want = fp8_dequantize(q, scale, dtype)
        assert (ours.view(np.uint8) == carrier(want).view(np.uint8)).all(), out


def test_a_scale_past_the_output_dtype_is_refused_not_written(cpu_kernels):
    from ckpttool.kernels.fp8_cpu import NaNCodes

    q = np.zeros((4, 32), dtype=np.uint8)
    with pytest.raises(NaNCodes):
        MODELOPT_FP8_CHANNEL.cpu(Chunk(q, "F8_E4M3", {"scale": np.array([1, 1, 7e4, 1], np.float32)}, {"scale": "F32"}),
                                 "F16", None)


# -- checkpoints ModelOpt wrote ----------------------------------------------------------------------------
def _mixed_cfg():
    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    nvfp4 = {e.get("quantizer_name"): e.get("cfg") for e in mtq.NVFP4_DEFAULT_CFG["quant_cfg"]}
    cfg["quant_cfg"] += [{"quantizer_name": "*mlp*weight_quantizer", "cfg": nvfp4["*weight_quantizer"]},
                         {"quantizer_name": "*mlp*input_quantizer", "cfg": nvfp4["*input_quantizer"]}]
    return cfg


def _with_kv(cfg):
    cfg = copy.deepcopy(cfg)
    cfg["quant_cfg"] += copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
    return cfg


CONFIGS = {"fp8": lambda: mtq.FP8_DEFAULT_CFG, "fp8_per_channel": lambda: mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG,
           "fp8_kv": lambda: _with_kv(mtq.FP8_DEFAULT_CFG), "mixed": _mixed_cfg}
TITLES = {"fp8": {MODELOPT_FP8_TENSOR.title: 14}, "fp8_per_channel": {MODELOPT_FP8_CHANNEL.title: 14},
          "fp8_kv": {MODELOPT_FP8_TENSOR.title: 14}, "mixed": {MODELOPT_FP8_TENSOR.title: 8, MODELOPT_NVFP4.title: 6}}


def export(src, dst, cfg) -> None:
    import transformers
    from modelopt.torch.export import export_hf_checkpoint

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    model = mtq.quantize(model, copy.deepcopy(cfg), lambda m: m(torch.randint(0, 256, (2, 16))))
    export_hf_checkpoint(model, export_dir=dst)


def oracle(src) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The checkpoint with every quantized weight as ModelOpt dequantizes it and its scales gone."""
    tensors, file_of = load_all(src)
    out = {k: v for k, v in tensors.items() if not k.endswith(("_scale", "_scale_2"))}
    for name, w in tensors.items():
        base = name[: -len("weight")]
        if not name.endswith(".weight"):
            continue
        if w.dtype == torch.float8_e4m3fn:
            out[name] = fp8_dequantize(w, tensors[base + "weight_scale"])
        elif w.dtype == torch.uint8 and base + "weight_scale_2" in tensors:
            out[name] = modelopt_decompress({k: tensors[base + k] for k in ("weight", "weight_scale", "weight_scale_2")
                                             if k != "weight"} | {"weight": w}, (w.shape[0], w.shape[1] * 2))
    return out, file_of


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    from dense_models import build_hf

    root = tmp_path_factory.mktemp("modelopt")
    base = build_hf("qwen3", root / "qwen3")
    for name, cfg in CONFIGS.items():
        export(base, root / name, cfg())
    return {name: root / name for name in CONFIGS}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_inspect_names_each_format(name, made):
    q = describe(made[name])["quantization"]
    assert q["unsupported"] is None and q["formats"] == TITLES[name], q


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_dequant_equals_modelopt_bit_for_bit_and_loads_as_bf16(name, made, tmp_path):
    from transformers import AutoModelForCausalLM

    run_cli("dequant", made[name], tmp_path / "out", "--quiet")
    ours, _ = load_all(tmp_path / "out")
    want, _ = oracle(made[name])
    assert sorted(ours) == sorted(want)  # weight, input and KV scales gone, nothing else
    for key, t in ours.items():
        assert t.dtype == want[key].dtype and torch.equal(t.view(torch.uint8), want[key].view(torch.uint8)), key
    assert not (tmp_path / "out" / "hf_quant_config.json").exists()
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


@pytest.mark.parametrize("name", ["mixed", "fp8_per_channel"])
def test_convert_mp2_straight_equals_from_modelopts_bf16(name, made, tmp_path):
    tensors, file_of = oracle(made[name])
    write_like(made[name], tmp_path / "bf16", tensors, {k: file_of[k] for k in tensors})
    (tmp_path / "bf16" / "hf_quant_config.json").unlink()
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    config.pop("quantization_config")
    (tmp_path / "bf16" / "config.json").write_text(json.dumps(config))
    run_cli("convert", made[name], tmp_path / "ours", "--mp", 2, "--quiet")
    run_cli("convert", tmp_path / "bf16", tmp_path / "ref", "--mp", 2, "--quiet")
    assert_same_tensors(load_dir(tmp_path / "ours"), load_dir(tmp_path / "ref"))


def _edit_hf_quant(src, dst, change):
    import shutil

    shutil.copytree(src, dst)
    for fname, key in (("hf_quant_config.json", "quantization"), ("config.json", "quantization_config")):
        config = json.loads((dst / fname).read_text())
        change(config[key])
        (dst / fname).write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("case, change, message", [
    ("an NVFP4 KV cache", lambda q: q.update(kv_cache_quant_algo="NVFP4", kv_cache_scheme="NVFP4"),
     "KV-cache quantization 'NVFP4'"),
    ("a layer in an unknown algorithm", lambda q: q["quantized_layers"]["model.layers.1.mlp.up_proj"].update(
        quant_algo="W4A8_AWQ"), "quant_algo 'W4A8_AWQ' (layer model.layers.1.mlp.up_proj)"),
    ("NVFP4 in groups of 32", lambda q: q["quantized_layers"]["model.layers.0.mlp.up_proj"].update(group_size=32),
     "NVFP4 with group_size 32"),
])
def test_what_modelopt_writes_and_ckpttool_does_not_read_is_refused_by_name(case, change, message, made, tmp_path):
    src = _edit_hf_quant(made["mixed"], tmp_path / "src", change)
    proc = run_cli("dequant", src, tmp_path / "out", check=False)
    assert proc.returncode != 0 and message in proc.stderr and "fix:" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_nvfp4_tensors_under_an_fp8_config_are_refused_not_passed_through(made, tmp_path):
    def fp8(q):
        q.pop("quantized_layers", None)
        q.pop("config_groups", None)
        q["quant_algo"] = "FP8"

    src = _edit_hf_quant(made["mixed"], tmp_path / "src", fp8)
    proc = run_cli("dequant", src, tmp_path / "out", check=False)
    assert proc.returncode != 0 and "is U8, but NVIDIA ModelOpt FP8 (per tensor)" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
