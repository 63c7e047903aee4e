"""`plan` at the published dims, from headers alone: DeepSeek-V4-Flash (its config.json as published,
in the BF16 form: every tensor the config implies, under the hub's names, in sparse files whose data
reads as zeros) at mp 4, 8 and 16, and the published configs ckpttool refuses, with the reason:
V4-Flash-0731 (DSpark draft stages) and V4.1-Flash (`deepseek_v41`).

And the same in the published FP8 + MXFP4 form (F8_E4M3 weights with an F8_E8M0 `.scale` per 128x128 block,
I8 routed experts with an F8_E8M0 `.scale` per 32 values, the published quantization_config): planned to BF16
shards at mp 4 and 8 (every weight dequantized, no scale left), refused at 16, and `shard` keeping the formats
refused (they are dequantized, not cut per rank)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ckpttool.families.deepseek_v4.config import DeepseekV4Config
from ckpttool.families.deepseek_v4.spec import hf_tensor_shapes
from conftest import run_cli

V4_FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1, "expert_dtype": "fp4", "hc_eps": 1e-06,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "head_dim": 512, "hidden_act": "silu", "hidden_size": 4096,
    "index_head_dim": 128, "index_n_heads": 64, "index_topk": 512, "initializer_range": 0.02,
    "max_position_embeddings": 1048576, "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 6, "num_hidden_layers": 43,
    "num_hash_layers": 3, "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_groups": 8, "o_lora_rank": 1024,
    "q_lora_rank": 1024, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "sliding_window": 128,
    "swiglu_limit": 10.0, "tie_word_embeddings": False, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1", "use_cache": True, "vocab_size": 129280, "compress_rope_theta": 160000,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}
"""deepseek-ai/DeepSeek-V4-Flash's config.json without its quantization_config (the BF16 form)"""
V4_FLASH_TENSORS = 35020
"""its tensors without scales; with a `.scale` beside every FP8 / MXFP4 weight the published index lists
69187 (1575 under mtp.0.), which hf_tensor_shapes gives too (test below)"""
V4_FLASH_0731_EXTRA = {"compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0, 0, 0], "dspark_block_size": 5,
                       "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [40, 41, 42], "dspark_markov_rank": 256}
V41_FLASH = {
    "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16", "bos_token_id": 0,
    "eos_token_id": 1, "pad_token_id": 2, "image_token_id": 129264,
    "text_config": {"model_type": "deepseek_v41_text", "vocab_size": 129280, "hidden_size": 5120,
                    "moe_intermediate_size": 2304, "num_hidden_layers": 40, "num_attention_heads": 64,
                    "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280,
                    "o_lora_rank": 1024, "o_groups": 8, "n_routed_experts": 384, "n_shared_experts": 1,
                    "num_experts_per_tok": 6, "sliding_window": 128,
                    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20, "kv_source_layer_ids": [2, 8, 14, 20],
                    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36], "index_n_heads": 32,
                    "index_head_dim": 128, "index_topk": 512, "engram_layer_ids": [1, 14], "hc_mult": 4,
                    "num_nextn_predict_layers": 3},
    "vision_config": {"model_type": "deepseek_v41_vision", "num_hidden_layers": 32, "hidden_size": 1024},
}
"""deepseek-ai/DeepSeek-V4.1-Flash's config.json, the fields that decide shapes (no quantization_config)"""
F32_LEAVES = ("attn_sink", "ape", "gate.bias", "hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn",
              "hc_ffn_base", "hc_ffn_scale", "hc_head_fn", "hc_head_base", "hc_head_scale")
"""float32 in DeepSeek's model (sinks, compressor position biases, router biases, hyper-connections);
tid2eid is int32; everything else BF16"""
ITEMSIZE = {"BF16": 2, "F32": 4, "I32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1}
QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                       "weight_block_size": [128, 128], "expert_dtype": "fp4"}
"""DeepSeek-V4-Flash's quantization_config"""


def published(shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """(shapes, dtypes) of the published form: each linear weight FP8 with an E8M0 scale per 128x128 block,
    each routed expert's MXFP4 (two codes a byte) with an E8M0 scale per 32 values."""
    from ckpttool.families.deepseek_v4.spec import KEY_MAPS

    out, dtypes = dict(shapes), {}
    for name, (m, k) in [(n, s) for n, s in shapes.items() if KEY_MAPS["deepseek"].is_linear(n)]:
        scale = name[: -len("weight")] + "scale"
        if ".ffn.experts." in name:
            out[name], out[scale], dtypes[name] = (m, k // 2), (m, k // 32), "I8"
        else:
            out[scale], dtypes[name] = (-(-m // 128), -(-k // 128)), "F8_E4M3"
        dtypes[scale] = "F8_E8M0"
    return out, dtypes


def write_headers(dst: Path, config: dict, shapes: dict[str, tuple[int, ...]], n_files: int = 8,
                  dtypes: dict[str, str] | None = None) -> Path:
    """Safetensors files whose headers list `shapes` (in `dtypes` where given) and whose data is a hole (reads
    as zeros, takes no disk), an index, and config.json: what `plan` reads of a published checkpoint."""
    dst.mkdir()
    dtypes = dtypes or {}
    names = sorted(shapes)
    weight_map = {}
    for i in range(n_files):
        fname = f"model-{i + 1:05d}-of-{n_files:05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name in names[i::n_files]:
            dtype = dtypes.get(name) or ("I32" if name.endswith("tid2eid") else "F32" if name.endswith(F32_LEAVES)
                                         else "BF16")
            size = ITEMSIZE[dtype] * _numel(shapes[name])
            header[name] = {"dtype": dtype, "shape": list(shapes[name]), "data_offsets": [offset, offset + size]}
            offset += size
            weight_map[name] = fname
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(dst / fname, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            f.truncate(8 + len(raw) + offset)
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@pytest.fixture(scope="module")
def v4_flash(tmp_path_factory) -> Path:
    cfg = DeepseekV4Config.from_dict(V4_FLASH)
    return write_headers(tmp_path_factory.mktemp("flash") / "DeepSeek-V4-Flash", V4_FLASH, hf_tensor_shapes(cfg))


@pytest.fixture(scope="module")
def v4_flash_fp8(tmp_path_factory) -> Path:
    shapes, dtypes = published(hf_tensor_shapes(DeepseekV4Config.from_dict(V4_FLASH)))
    return write_headers(tmp_path_factory.mktemp("flash-fp8") / "DeepSeek-V4-Flash", {
        **V4_FLASH, "quantization_config": QUANTIZATION_CONFIG}, shapes, dtypes=dtypes)


def test_v4_flash_tensor_inventory_is_the_published_index():
    from ckpttool.families.deepseek_v4.spec import KEY_MAPS

    shapes = hf_tensor_shapes(DeepseekV4Config.from_dict(V4_FLASH))
    scales = [n for n in shapes if KEY_MAPS["deepseek"].is_linear(n)]  # FP8 / MXFP4 weights, each with a .scale
    assert len(shapes) == V4_FLASH_TENSORS and len(shapes) + len(scales) == 69187
    assert sum(n.startswith("mtp.0.") for n in list(shapes) + scales) == 1575


@pytest.fixture(scope="module")
def bf16_plan(v4_flash):
    """`plan --mp N --json` of the BF16 V4-Flash, once per N (each takes seconds at this size)."""
    plans: dict[int, dict] = {}

    def get(mp: int) -> dict:
        if mp not in plans:
            plans[mp] = json.loads(run_cli("plan", v4_flash, "--mp", mp, "--json").stdout)
        return plans[mp]
    return get


@pytest.mark.parametrize("mp", [4, 8])
def test_plan_of_v4_flash_is_accepted(bf16_plan, mp):
    """Every rank file, the experts 256 / mp to a rank, the MTP layer kept (DeepSeek's convert.py keeps it)."""
    plan = bf16_plan(mp)
    files = {f["name"]: f for f in plan["files"]}
    assert sorted(files) == sorted(f"model{r}-mp{mp}.safetensors" for r in range(mp))
    replicated = V4_FLASH_TENSORS - 3 * 256 * 44  # all but the routed experts (43 layers + MTP) are on every rank
    assert {f["tensors"] for f in files.values()} == {replicated + 3 * 256 * 44 // mp}
    assert not any("MTP" in note for note in plan["notes"])


def test_plan_of_v4_flash_at_mp16_is_refused_naming_the_output_groups(v4_flash, tmp_path):
    proc = run_cli("plan", v4_flash, "--mp", 16, check=False)
    assert proc.returncode == 1
    assert "o_groups (8) is not divisible by mp=16" in proc.stderr and "whole output groups" in proc.stderr


def test_v4_flash_0731_is_refused_for_its_dspark_stages(tmp_path):
    config = {**V4_FLASH, **V4_FLASH_0731_EXTRA}
    src = write_headers(tmp_path / "0731", config, {"embed.weight": (129280, 4096)}, n_files=1)
    for mp in (4, 8, 16):
        proc = run_cli("plan", src, "--mp", mp, check=False)
        assert proc.returncode == 1 and "DSpark draft stages" in proc.stderr, proc.stderr


def test_v41_flash_is_refused_with_its_reason(tmp_path):
    src = write_headers(tmp_path / "v41", V41_FLASH, {"embed.weight": (129280, 5120)}, n_files=1)
    for mp in (4, 8, 16):
        proc = run_cli("plan", src, "--mp", mp, check=False)
        assert proc.returncode == 1 and "'deepseek_v41' is not supported: DeepSeek-V4.1" in proc.stderr, proc.stderr
        assert "transformers 5.24" in proc.stderr


def test_header_only_files_take_no_disk(v4_flash):
    files = list(v4_flash.glob("*.safetensors"))
    assert sum(os.stat(f).st_size for f in files) > 500e9  # V4-Flash in BF16: 284B parameters
    assert sum(os.stat(f).st_blocks * 512 for f in files) < 50e6


@pytest.mark.parametrize("mp", [4, 8])
def test_plan_of_published_v4_flash_dequantizes_every_weight(bf16_plan, v4_flash_fp8, mp):
    """The published FP8 + MXFP4 form plans to the same BF16 shards as the BF16 form, tensor for tensor."""
    bf16 = bf16_plan(mp)
    fp8 = json.loads(run_cli("plan", v4_flash_fp8, "--mp", mp, "--json").stdout)
    assert [(f["name"], f["tensors"], f["bytes"]) for f in fp8["files"]] == \
        [(f["name"], f["tensors"], f["bytes"]) for f in bf16["files"]]
    n_quantized = 69187 - V4_FLASH_TENSORS  # one .scale each in the published index
    assert f"dequantized {n_quantized} quantized weights to BF16" in fp8["notes"], fp8["notes"]


def test_plan_of_published_v4_flash_at_mp16_is_refused_and_keeping_the_formats_is_refused(v4_flash_fp8):
    proc = run_cli("plan", v4_flash_fp8, "--mp", 16, check=False)
    assert proc.returncode == 1 and "o_groups (8) is not divisible by mp=16" in proc.stderr
    proc = run_cli("plan", v4_flash_fp8, "--mp", 8, "--dtype", "fp8", check=False)
    assert proc.returncode == 1 and "can only be dequantized" in proc.stderr, proc.stderr
