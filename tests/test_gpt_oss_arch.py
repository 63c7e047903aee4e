"""Issue 7, gpt-oss architecture table: config parsing, HF names/shapes in both forms, the mp key
table (round trip, split rules agree with the bundled model's parameters), BF16 config rewrite."""

from __future__ import annotations

import json

import pytest
import torch

from ckpttool.families.gpt_oss.spec import (
    EXPERTS, KEY_TABLE, GptOssConfig, bf16_config, bf16_expert_shape, bf16_name, check_mp, expert_range,
    hf_tensor_shapes, mxfp4_source, shard_for_rank, to_hf, to_native,
)
from ckpttool.families.gpt_oss.demo import CONFIG, MXFP4_QUANTIZATION_CONFIG
from ckpttool.errors import InputError, PlanError
from ckpttool.families.gpt_oss.model import Transformer
from ckpttool.model.parallel import ParallelContext

CFG = GptOssConfig.from_dict({**CONFIG, "quantization_config": MXFP4_QUANTIZATION_CONFIG})
# openai/gpt-oss-20b's published dims, for shape checks at full size (no tensors are built)
GPT_OSS_20B = {**CONFIG, "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "head_dim": 64,
               "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
               "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
               "layer_types": ["sliding_attention", "full_attention"] * 12}


def test_published_shapes_of_gpt_oss_20b():
    shapes = hf_tensor_shapes(GptOssConfig.from_dict(GPT_OSS_20B), mxfp4=True)
    assert shapes["model.layers.0.mlp.experts.gate_up_proj_blocks"] == (32, 5760, 90, 16)
    assert shapes["model.layers.0.mlp.experts.gate_up_proj_scales"] == (32, 5760, 90)
    assert shapes["model.layers.0.mlp.experts.down_proj_blocks"] == (32, 2880, 90, 16)
    assert shapes["model.layers.23.self_attn.sinks"] == (64,)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (512, 2880)
    bf16 = hf_tensor_shapes(GptOssConfig.from_dict(GPT_OSS_20B), mxfp4=False)
    assert bf16["model.layers.0.mlp.experts.gate_up_proj"] == (32, 2880, 5760)
    assert bf16["model.layers.0.mlp.experts.down_proj"] == (32, 2880, 2880)
    assert bf16_expert_shape(shapes["model.layers.0.mlp.experts.gate_up_proj_blocks"]) == (32, 2880, 5760)
    assert len(shapes) == 3 + 24 * 19 and len(bf16) == len(shapes) - 24 * 2


def test_config_reads_published_and_transformers_resaved_forms(tmp_path):
    from transformers import GptOssConfig as HFConfig

    HFConfig.from_dict(dict(CONFIG)).save_pretrained(tmp_path)
    resaved = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in resaved or "rope_scaling" in resaved
    ours = GptOssConfig.from_dict(resaved)
    published = GptOssConfig.from_dict(CONFIG)
    assert ours.rope_theta == published.rope_theta == 150000.0
    assert ours.rope_scaling["factor"] == published.rope_scaling["factor"] == 4.0
    assert ours.layer_types == published.layer_types and not published.mxfp4 and CFG.mxfp4
    assert [CFG.is_sliding(i) for i in range(3)] == [True, False, True]


@pytest.mark.parametrize("change, match", [
    ({"model_type": "deepseek_v3"}, "not 'gpt_oss'"),
    ({"num_local_experts": None}, "wrong type"),
    ({"layer_types": ["full_attention"]}, "3 layers"),
    ({"hidden_size": 48}, "multiple of the MXFP4 block"),
])
def test_bad_configs_are_input_errors(change, match):
    with pytest.raises(InputError, match=match):
        GptOssConfig.from_dict({**CONFIG, **change}, source="some/config.json")
    raw = dict(CONFIG)
    del raw["vocab_size"]
    with pytest.raises(InputError, match="lacks required field 'vocab_size'"):
        GptOssConfig.from_dict(raw)


@pytest.mark.parametrize("mxfp4", [True, False])
def test_key_table_round_trips_every_tensor(mxfp4):
    names = hf_tensor_shapes(CFG, mxfp4=mxfp4)
    natives = [to_native(n)[0] for n in names]
    assert len(set(natives)) == len(natives)
    assert [to_hf(n) for n in natives] == list(names)
    templates = [hf for hf, _, _ in KEY_TABLE]
    assert len(set(templates)) == len(templates)
    with pytest.raises(PlanError):
        to_native("model.layers.0.mlp.experts.0.gate_proj.weight")


def test_split_rules_agree_with_the_bundled_model_at_mp2():
    """The shard of each rank loads into the rank's model parameter for parameter, shape for shape."""
    shapes = hf_tensor_shapes(CFG, mxfp4=False)
    tensors = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}
    for rank in range(2):
        shard = shard_for_rank(tensors, rank, 2)
        model = Transformer(CFG, ParallelContext(rank, 2))
        params = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        assert {k: tuple(v.shape) for k, v in shard.items()} == params
    assert to_native("model.layers.0.self_attn.sinks")[1] == to_native("model.layers.0.self_attn.q_proj.weight")[1] == 0
    assert to_native("model.layers.0.mlp.experts.gate_up_proj_blocks")[1] == EXPERTS


def test_expert_shards_are_contiguous_ranges():
    tensors = {"model.layers.0.mlp.experts.down_proj_bias": torch.arange(4.0)[:, None].expand(4, 64).contiguous()}
    for rank in range(2):
        part = shard_for_rank(tensors, rank, 2)["layers.0.ffn.experts.b2"][:, 0].tolist()
        assert part == [float(e) for e in expert_range(CFG, rank, 2)]
    check_mp(CFG, 2)
    with pytest.raises(PlanError, match="num_attention_heads .* mp=3"):
        check_mp(CFG, 3)
    with pytest.raises(PlanError, match="num_local_experts"):
        expert_range(CFG, 0, 3)


def test_bf16_names_and_config_rewrite():
    assert mxfp4_source("model.layers.3.mlp.experts.gate_up_proj") == (
        "model.layers.3.mlp.experts.gate_up_proj_blocks", "model.layers.3.mlp.experts.gate_up_proj_scales")
    assert mxfp4_source("model.layers.3.mlp.experts.gate_up_proj_bias") is None
    assert bf16_name("model.layers.3.mlp.experts.down_proj_blocks") == "model.layers.3.mlp.experts.down_proj"
    assert bf16_name("model.layers.3.mlp.experts.down_proj_scales") is None
    raw = {**CONFIG, "quantization_config": MXFP4_QUANTIZATION_CONFIG}
    out = bf16_config(raw)
    assert "quantization_config" not in out and out["torch_dtype"] == "bfloat16"
    unchanged = {k: v for k, v in CONFIG.items() if k != "torch_dtype"}
    assert {k: v for k, v in out.items() if k != "torch_dtype"} == unchanged
