"""Issue 7, MXFP4 dequant: bit-equal to transformers' own MXFP4 dequantization, on every
(scale, byte) pair and on a tiny gpt-oss checkpoint that transformers loads.

The oracle is `transformers.integrations.mxfp4.convert_moe_packed_tensors`, the function
GptOssForCausalLM.from_pretrained uses when it dequantizes (always on CPU), called on CPU tensors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import GptOssForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from ckpttool.families.gpt_oss.spec import GptOssConfig, dequant_expert_weight, hf_tensor_dtype, hf_tensor_shapes
from ckpttool.families.gpt_oss.demo import build_gpt_oss_checkpoint, random_mxfp4
from ckpttool.errors import InputError
from ckpttool.io.checkpoint import Checkpoint
from ckpttool.kernels import mxfp4_cpu
from ckpttool.kernels.mxfp4 import dequant_mxfp4

REPO = Path(__file__).resolve().parents[1]
INT_OF = {2: torch.int16, 4: torch.int32}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(INT_OF[t.element_size()])


def oracle(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' dequant, undoing its final transpose(1, 2): [..., G * 32] like ours. It wants
    [E, R, G, 16], so any leading dims are folded into R first."""
    *prefix, groups, width = blocks.shape
    out = convert_moe_packed_tensors(blocks.reshape(1, -1, groups, width), scales.reshape(1, -1, groups), dtype=dtype)
    return out.transpose(1, 2).reshape(*prefix, groups * 2 * width)


def every_scale_and_byte() -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [1, 256, 16, 16] / scales [1, 256, 16]: row s has scale s and holds all 256 bytes."""
    blocks = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(1, 1, 16, 16).expand(1, 256, 16, 16)
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(1, 256, 1).expand(1, 256, 16)
    return blocks.contiguous(), scales.contiguous()


# -- the kernel against transformers -----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_scale_and_code_matches_transformers(dtype):
    blocks, scales = every_scale_and_byte()
    ours = dequant_mxfp4(blocks, scales, dtype)
    assert ours.shape == (1, 256, 512) and ours.dtype == dtype
    assert torch.equal(bits(ours), bits(oracle(blocks, scales, dtype)))


@pytest.mark.parametrize("shape", [(3, 40, 5, 16), (2, 3, 7, 2, 16), (9, 16)])
def test_random_tensors_match_transformers_across_chunks(shape, monkeypatch):
    # 7 rows per CPU step, so chunk boundaries fall inside experts and inside rows of groups
    monkeypatch.setattr(mxfp4_cpu, "_ROWS_PER_STEP", 7)
    gen = torch.Generator().manual_seed(sum(shape))
    blocks, scales = random_mxfp4(shape, gen, exponents=(-127, 128))
    assert torch.equal(bits(dequant_mxfp4(blocks, scales)), bits(oracle(blocks, scales, torch.bfloat16)))


def test_expert_weight_layout_is_transformers_layout():
    """[E, R, G, 16] -> [E, G * 32, R]: exactly what transformers hands GptOssExperts."""
    gen = torch.Generator().manual_seed(3)
    blocks, scales = random_mxfp4((3, 12, 4, 16), gen)
    ours = dequant_expert_weight(blocks, scales)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    assert ours.shape == ref.shape == (3, 128, 12) and ours.is_contiguous()
    assert torch.equal(bits(ours), bits(ref))


def test_edge_case_exponents_documented_values():
    """One byte (low nibble first) per case; what transformers does, which we match."""
    def one(byte: int, scale: int) -> list[torch.Tensor]:
        b = torch.full((1, 16), byte, dtype=torch.uint8)
        return dequant_mxfp4(b, torch.tensor([scale], dtype=torch.uint8))[:2].float().tolist()

    assert one(0x21, 127) == [0.5, 1.0]  # low nibble 1 (0.5) first, high nibble 2 (1.0) second
    assert one(0xF9, 127) == [-0.5, -6.0]
    assert one(0x21, 0) == [2.0 ** -128, 2.0 ** -127]  # bf16 subnormals, not flushed to zero
    assert one(0x43, 254) == [1.5 * 2.0 ** 127, float("inf")]  # 2 * 2**127 overflows bf16
    assert one(0x21, 255) == [2.0 ** 127, float("inf")]  # e8m0 "NaN" is 2**128 in transformers
    zero = dequant_mxfp4(torch.full((1, 16), 0x80, dtype=torch.uint8), torch.tensor([255], dtype=torch.uint8))
    assert bits(zero[:2]).tolist() == [0, -32768]  # +0.0 and -0.0 (0x8000), never NaN
    blocks, scales = every_scale_and_byte()
    assert not dequant_mxfp4(blocks, scales).isnan().any()


def test_e8m0_typed_scales_are_accepted():
    gen = torch.Generator().manual_seed(4)
    blocks, scales = random_mxfp4((2, 3, 16), gen)
    typed = scales.view(torch.float8_e8m0fnu)
    assert torch.equal(bits(dequant_mxfp4(blocks, typed)), bits(dequant_mxfp4(blocks, scales)))


@pytest.mark.parametrize("blocks_shape, scales_shape, dtype, match", [
    ((2, 3, 16), (2, 4), torch.uint8, "does not match blocks shape"),
    ((2, 3, 8), (2, 3), torch.uint8, r"\[\.\.\., G, 16\]"),
    ((2, 3, 16), (2, 3), torch.int8, "must be uint8"),
])
def test_bad_inputs_name_the_tensor(blocks_shape, scales_shape, dtype, match):
    with pytest.raises(InputError, match=match) as err:
        dequant_mxfp4(torch.zeros(blocks_shape, dtype=dtype), torch.zeros(scales_shape, dtype=torch.uint8),
                      tensor="model.layers.0.mlp.experts.down_proj_blocks")
    assert err.value.tensor == "model.layers.0.mlp.experts.down_proj_blocks"


def test_unsupported_out_dtype_is_an_error():
    with pytest.raises(InputError, match="writes one of"):
        dequant_mxfp4(torch.zeros(1, 16, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8), torch.float64)


# -- Triton: same bits as the CPU path ---------------------------------------------------------------
_TRITON_CHECK = """
import torch
from ckpttool.dtypes import dtype_code
from ckpttool.kernels import mxfp4
from ckpttool.families.gpt_oss.demo import random_mxfp4
device = "cuda" if torch.cuda.is_available() else "cpu"
blocks = torch.arange(256).to(torch.uint8).reshape(1, 1, 16, 16).expand(3, 256, 16, 16).contiguous()
scales = torch.arange(256).to(torch.uint8).reshape(1, 256, 1).expand(3, 256, 16).contiguous()
b2, s2 = random_mxfp4((5, 77, 9, 16), torch.Generator().manual_seed(0), exponents=(-127, 128))
for b, s in ((blocks, scales), (b2, s2), (b2[:, :0], s2[:, :0])):
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        cpu = mxfp4.dequant_mxfp4(b, s, dtype)
        if device == "cuda":
            dev = mxfp4.dequant_mxfp4(b.cuda(), s.cuda(), dtype).cpu()
        else:  # TRITON_INTERPRET=1: the same kernel, run by Triton's interpreter on CPU tensors
            from ckpttool.kernels import mxfp4_triton
            words = mxfp4_triton.gather_pairs(b, s, mxfp4.device_pair_table(dtype_code(dtype), torch.device("cpu")))
            dev = words.view(dtype).reshape(cpu.shape)
        assert dev.shape == cpu.shape and dev.dtype == dtype
        assert torch.equal(dev.view(torch.uint8), cpu.view(torch.uint8)), (dtype, b.shape)
print("triton ok")
"""


@pytest.mark.gpu
def test_triton_matches_cpu_bit_for_bit_on_cuda():
    assert torch.cuda.is_available(), "the gpu marker needs a CUDA device"
    proc = subprocess.run([sys.executable, "-c", _TRITON_CHECK], capture_output=True, text=True, cwd=REPO,
                          timeout=600)
    assert proc.returncode == 0 and "triton ok" in proc.stdout, proc.stderr[-4000:]


def test_triton_kernel_in_interpreter_matches_cpu():
    """Runs the Triton kernel on CPU through TRITON_INTERPRET=1 where triton is installed."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = _TRITON_CHECK.replace('"cuda" if torch.cuda.is_available() else ', "")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert proc.returncode == 0 and "triton ok" in proc.stdout, proc.stderr[-4000:]


# -- the tiny checkpoint in transformers -------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """The same random gpt-oss in its published MXFP4 form and as our BF16 export."""
    root = tmp_path_factory.mktemp("gpt-oss")
    return build_gpt_oss_checkpoint(root / "mxfp4", mxfp4=True), build_gpt_oss_checkpoint(root / "bf16", mxfp4=False)


def load_hf(path: Path) -> GptOssForCausalLM:
    kwargs = {"quantization_config": Mxfp4Config(dequantize=True)} if "quantization_config" in \
        json.loads((path / "config.json").read_text()) else {}
    return GptOssForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kwargs).eval()


def test_builder_writes_the_published_layout(tiny_pair):
    q, b = tiny_pair
    for path, is_mxfp4 in ((q, True), (b, False)):
        config = json.loads((path / "config.json").read_text())
        assert (config.get("quantization_config", {}).get("quant_method") == "mxfp4") is is_mxfp4
        cfg = GptOssConfig.from_dict(config)
        with Checkpoint(path) as ckpt:  # the strict reader accepts it
            found = {name: (tuple(src.info.shape), src.info.dtype) for name, src in ckpt.tensors.items()}
            total = ckpt.total_bytes
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert index["metadata"]["total_size"] == total
        want = hf_tensor_shapes(cfg, mxfp4=is_mxfp4)
        assert {n: s for n, (s, _) in found.items()} == want
        with safe_open(str(path / index["weight_map"]["model.layers.0.self_attn.sinks"]), "pt") as h:
            assert h.get_tensor("model.layers.0.self_attn.sinks").dtype == hf_tensor_dtype("x.sinks")
    name = "model.layers.1.mlp.experts.gate_up_proj_blocks"
    assert want[name.removesuffix("_blocks")] == (4, 64, 192)
    assert hf_tensor_shapes(GptOssConfig.load(q / "config.json"))[name] == (4, 192, 2, 16)


def test_transformers_dequantized_load_equals_our_bf16_export(tiny_pair):
    """Every parameter transformers builds from the MXFP4 files equals the BF16 file we wrote, bit for bit."""
    q, b = tiny_pair
    from_mxfp4, from_bf16 = load_hf(q).state_dict(), load_hf(b).state_dict()
    assert sorted(from_mxfp4) == sorted(from_bf16)
    for name, value in from_mxfp4.items():
        assert value.dtype == from_bf16[name].dtype and torch.equal(bits(value), bits(from_bf16[name])), name
    with safe_open(str(b / "model-00000-of-00001.safetensors"), "pt") as h:
        ours = h.get_tensor("model.layers.0.mlp.experts.down_proj")
    assert torch.equal(bits(ours), bits(from_mxfp4["model.layers.0.mlp.experts.down_proj"]))


def test_tiny_checkpoint_runs_and_generates_the_same_tokens(tiny_pair):
    q, b = tiny_pair
    ids = torch.tensor([[0, 5, 9, 11, 3, 20, 7, 8, 30, 4]])  # longer than the sliding window (4)
    with torch.no_grad():
        mq, mb = load_hf(q), load_hf(b)
        logits = mq(ids).logits
        assert logits.shape == (1, 10, 256) and torch.isfinite(logits).all()
        assert 0.1 < logits.float().std() < 10, "random weights should give tame logits"
        assert torch.equal(logits, mb(ids).logits)
        gen_q = mq.generate(ids, max_new_tokens=6, do_sample=False)
        gen_b = mb.generate(ids, max_new_tokens=6, do_sample=False)
    assert gen_q.tolist() == gen_b.tolist() and gen_q.shape == (1, 16)
