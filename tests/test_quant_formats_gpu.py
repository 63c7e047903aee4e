"""Issue 16 on CUDA: the Triton paths of the compressed-tensors and ModelOpt formats give the CPU's
bytes (which tests/test_quant_formats.py proves equal to each library). Needs no oracle library, so it
runs on a device machine that has only torch and Triton:

    pytest -m gpu -o addopts='' tests/test_quant_formats_gpu.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import assert_cuda_convert_equals_cpu

from ckpttool.formats import BY_NAME, Chunk
from ckpttool.kernels.fp8_cpu import NaNCodes

pytestmark = pytest.mark.gpu
ROWS = ("ct_int4_g32", "ct_int4_g128", "ct_fp8_channel", "ct_fp8_tensor", "ct_nvfp4", "modelopt_nvfp4")
OUT = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
EDGE_BF16 = torch.tensor([1e-40, 3e-39, 1.5e-5, 0.0123, 1.0, 3.0, 7.5e3, 1e37, 3.3e38, -0.02, -1e-38, 0.0])


def random_inputs(row: str, rows: int, cols: int, gen: torch.Generator, edge: torch.Tensor = EDGE_BF16
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes (every byte value, NaN codes left out) and scales including edge values."""
    fmt = BY_NAME[row]
    if row.startswith("ct_int4"):
        group = int(row.split("_g")[1])
        x = torch.randint(0, 256, (rows, cols // 2), dtype=torch.int32, generator=gen).to(torch.uint8)
        s = edge[torch.randint(0, len(edge), (rows, cols // group), generator=gen)]
        return x.view(torch.int32), s.to(torch.bfloat16)
    if row.startswith("ct_fp8"):
        x = torch.randint(0, 256, (rows, cols), dtype=torch.int32, generator=gen).to(torch.uint8)
        x[(x & 0x7F) == 0x7F] ^= 1
        s = edge[torch.randint(0, len(edge), (rows, 1), generator=gen)]
        return x.view(torch.float8_e4m3fn), (s if row.endswith("channel") else s[:1, 0]).to(torch.bfloat16)
    x = torch.randint(0, 256, (rows, cols // 2), dtype=torch.int32, generator=gen).to(torch.uint8)
    s = torch.randint(0, 256, (rows, cols // 16), dtype=torch.int32, generator=gen).to(torch.uint8)
    s[(s & 0x7F) == 0x7F] ^= 1
    assert fmt.side("scale").dtypes == ("F8_E4M3",)
    return x, s.view(torch.float8_e4m3fn)


def has_global(fmt) -> bool:
    return any(side.role == "global" for side in fmt.sides)


def chunk(fmt, x, s, dtype: str, global_scale: float | None) -> Chunk:
    """What the executor gives a row's kernels: the values, their scale rows and the global scale."""
    return Chunk(x, dtype, {"scale": s}, {"scale": fmt.side("scale").dtypes[0]},
                 1.0 if global_scale is None else global_scale)


def numpy_of(t: torch.Tensor):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]).numpy() \
        if t.dtype not in (torch.int32, torch.uint8) else t.numpy()


@pytest.mark.parametrize("out", sorted(OUT))
@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize("shape", [(1, 256), (3, 384), (37, 512), (300, 2048), (1024, 7168)])
def test_triton_bits_equal_cpu(row, out, shape):
    fmt = BY_NAME[row]
    gen = torch.Generator().manual_seed(sum(shape))
    x, s = random_inputs(row, *shape, gen)
    g = 448.0 * 6 / 3.7 if has_global(fmt) else None
    dtype = {"ct_int4_g32": "I32", "ct_int4_g128": "I32"}.get(row, "F8_E4M3" if row.startswith("ct_fp8") else "U8")
    cpu = fmt.cpu(chunk(fmt, numpy_of(x), numpy_of(s), dtype, g), out, None)
    gpu, first_bad = fmt.cuda(chunk(fmt, x.cuda(), s.cuda(), dtype, g), OUT[out])
    torch.cuda.synchronize()
    assert first_bad is None or first_bad.row() is None
    assert tuple(gpu.shape) == cpu.shape == shape
    assert (gpu.cpu().view(torch.uint8).numpy().reshape(-1) == cpu.view("uint8").reshape(-1)).all()


@pytest.mark.parametrize("row", ROWS)
def test_triton_names_the_cpus_nan_row(row):
    fmt = BY_NAME[row]
    x, s = random_inputs(row, 64, 256, torch.Generator().manual_seed(5))
    s = s.clone()
    if fmt.side("scale").dtypes[0] == "BF16" and s.dim() == 2:  # (F16 and F32 scales are accepted too: issue 35)
        s[41, 0] = float("nan")
    elif fmt.side("scale").dtypes[0] == "BF16":
        s[0] = float("nan")  # the tensor's one scale: every row, the first is 0
    else:
        s.view(torch.uint8)[41, 3] = 0xFF
    g = 2.0 if has_global(fmt) else None
    dtype = "I32" if row.startswith("ct_int4") else ("F8_E4M3" if row.startswith("ct_fp8") else "U8")
    with pytest.raises(NaNCodes) as cpu_err:
        fmt.cpu(chunk(fmt, numpy_of(x), numpy_of(s), dtype, g), "BF16", None)
    _, first_bad = fmt.cuda(chunk(fmt, x.cuda(), s.cuda(), dtype, g), torch.bfloat16)
    assert first_bad.row() == cpu_err.value.row


# -- whole checkpoints: --device cuda writes the bytes --device cpu writes ---------------------------
CONFIGS = {
    "ct_int4_g32": ("pack-quantized", {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                       "group_size": 32}),
    "ct_fp8_channel": ("float-quantized", {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}),
    "ct_nvfp4": ("nvfp4-pack-quantized", {"num_bits": 4, "type": "float", "symmetric": True,
                                          "strategy": "tensor_group", "group_size": 16}),
}
EXPERTS = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")


def quantized_by_hand(base: Path, dst: Path, row: str) -> Path:
    """base's routed experts replaced by random tensors in the row's layout (the libraries are not
    needed here: the CPU path is the reference, and test_quant_formats.py ties it to them)."""
    import shutil

    shutil.copytree(base, dst)
    gen = torch.Generator().manual_seed(9)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    for fname in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(dst / fname))
        for name in [n for n in tensors if EXPERTS.fullmatch(n)]:
            w = tensors.pop(name)
            x, s = random_inputs(row, *w.shape, gen, EDGE_BF16[EDGE_BF16 > 0])  # CT never stores 0 scales
            fmt = BY_NAME[row]
            members = fmt.members(name)
            stored = {fmt.values.of(name): x, members["scale"]: s}
            if row.startswith("ct_int4"):
                stored[members["shape"]] = torch.tensor(w.shape)
            if has_global(fmt):
                stored[members["global"]] = torch.tensor([448.0 * 6 / 2.9]) if row.startswith("ct") \
                    else torch.tensor(2.9 / (448.0 * 6))
            del index["weight_map"][name]
            for stored_name, t in stored.items():
                tensors[stored_name] = t.contiguous()
                index["weight_map"][stored_name] = fname
        save_file(tensors, str(dst / fname), metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((dst / "config.json").read_text())
    if row in CONFIGS:
        fmt, weights = CONFIGS[row]
        config["quantization_config"] = {"quant_method": "compressed-tensors", "format": fmt,
                                         "quantization_status": "compressed",
                                         "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}
    else:
        config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "group_size": 16}}}}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("row", ["ct_int4_g32", "ct_fp8_channel", "ct_nvfp4", "modelopt_nvfp4"])
def test_cuda_dequant_and_convert_equal_cpu(row, tmp_path):
    from ckpttool.families.deepseek.demo import build_checkpoint

    base = build_checkpoint(tmp_path / "base", "tiny-v3", fp8=False, overrides={"num_nextn_predict_layers": 0})
    assert_cuda_convert_equals_cpu(quantized_by_hand(base, tmp_path / "src", row), tmp_path)
