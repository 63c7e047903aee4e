"""plan/rewrite.py on its own, without the CLI: the config.json an output carries (no quantization_config once
dequantized, the dtype its tensors are in, MTP layers no longer counted once dropped, the family's explicit
fields), the HF index as transformers 5 writes it, and which of SRC's top-level files are copied beside the
weights. (The explicit routing and rope fields themselves, per family: tests/test_config_rewrite.py.)"""

from __future__ import annotations

import copy

from ckpttool.io.layout import INDEX_NAME, MANIFEST
from ckpttool.plan.rewrite import files_to_copy, floating_dtype, hf_index, rewrite_config
from ckpttool.plan.types import TensorPlan, layout

QUANT = {"quant_method": "fp8", "weight_block_size": [128, 128]}


def t(name: str, dtype: str, shape: tuple, file: str = "model-00001-of-00002.safetensors") -> TensorPlan:
    return TensorPlan(name, dtype, shape, source=name, file=file)


def test_floating_dtype_is_where_most_elements_are():
    """An F32 checkpoint with nothing to dequantize stays F32 and must say float32; integer and FP8 tensors
    (scales aside) do not count."""
    assert floating_dtype([t("a", "BF16", (4, 4)), t("b", "F32", (10, 10))]) == "F32"
    assert floating_dtype([t("a", "BF16", (100, 4)), t("b", "F32", (10, 10)), t("c", "F8_E4M3", (1000, 1000))]) == "BF16"
    assert floating_dtype([t("a", "F16", (8,)), t("b", "BF16", (8,))]) in ("F16", "BF16")  # a tie: either, stably
    assert floating_dtype([t("a", "F16", (8,)), t("b", "BF16", (8,))]) == floating_dtype(
        [t("b", "BF16", (8,)), t("a", "F16", (8,))])
    assert floating_dtype([t("codes", "I32", (4, 4)), t("q", "F8_E4M3", (4, 4))]) is None


def test_dequantized_config_drops_quantization_and_states_the_dtype():
    raw = {"model_type": "deepseek_v3", "quantization_config": QUANT, "torch_dtype": "bfloat16", "hidden_size": 7}
    before = copy.deepcopy(raw)
    out = rewrite_config(raw, dequantized=True, dtype="F16", mtp_key=None, mtp_dropped=False)
    assert "quantization_config" not in out and out["torch_dtype"] == "float16" and "dtype" not in out
    assert out["hidden_size"] == 7 and raw == before  # the input's dict is left as it was
    with_dtype = rewrite_config({**raw, "dtype": "bfloat16"}, dequantized=True, dtype="F32", mtp_key=None,
                                mtp_dropped=False)
    assert with_dtype["dtype"] == "float32" and with_dtype["torch_dtype"] == "float32"


def test_a_kept_quantization_is_not_touched():
    """shard with FP8 kept: the output is still FP8, and its config says so."""
    raw = {"quantization_config": QUANT, "torch_dtype": "bfloat16"}
    assert rewrite_config(raw, dequantized=False, dtype="BF16", mtp_key=None, mtp_dropped=False) == raw


def test_dropped_mtp_layers_are_no_longer_counted_even_nested():
    """num_nextn_predict_layers is zeroed where MTP layers were dropped, also inside a wrapper's text_config,
    also where config.json left it to the class default; the input's nested dict is not changed."""
    raw = {"num_nextn_predict_layers": 1, "text_config": {"num_nextn_predict_layers": 1, "x": 1}}
    before = copy.deepcopy(raw)
    top = rewrite_config(raw, dequantized=False, dtype=None, mtp_key="num_nextn_predict_layers", mtp_dropped=True)
    assert top["num_nextn_predict_layers"] == 0 and top["text_config"] == before["text_config"]
    nested = rewrite_config(raw, dequantized=False, dtype=None, mtp_key="text_config.num_nextn_predict_layers",
                            mtp_dropped=True)
    assert nested["text_config"] == {"num_nextn_predict_layers": 0, "x": 1} and nested["num_nextn_predict_layers"] == 1
    assert raw == before
    unstated = rewrite_config({}, dequantized=False, dtype=None, mtp_key="num_nextn_predict_layers", mtp_dropped=True)
    assert unstated == {"num_nextn_predict_layers": 0}
    kept = rewrite_config(raw, dequantized=False, dtype=None, mtp_key="num_nextn_predict_layers", mtp_dropped=False)
    assert kept == raw


def test_the_familys_explicit_fields_are_applied_first():
    seen = []

    def explicit(config: dict, source) -> dict:
        seen.append(source)
        return {**config, "scoring_func": "sigmoid", "quantization_config": config.get("quantization_config")}

    out = rewrite_config({"quantization_config": QUANT}, dequantized=True, dtype="BF16", mtp_key=None,
                         mtp_dropped=False, explicit=explicit, source="SRC/config.json")
    assert out == {"scoring_func": "sigmoid", "torch_dtype": "bfloat16"} and seen == ["SRC/config.json"]


def test_index_counts_bytes_and_parameters_as_transformers_does():
    """total_size is every tensor's bytes; total_parameters leaves out what the model holds as buffers (named
    by their endings after a dot, never by a partial word); the weight map is sorted."""
    tensors = [t("model.layers.1.mlp.gate.e_score_correction_bias", "F32", (8,)),
               t("model.layers.0.mlp.gate.weight", "BF16", (8, 16)),
               t("model.my_e_score_correction_bias", "F32", (3,)),
               t("lm_head.weight", "BF16", (32, 16), file="model-00002-of-00002.safetensors")]
    files = layout(tensors, ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
    index = hf_index(files, buffers=("e_score_correction_bias",))
    assert index["metadata"] == {"total_parameters": 8 * 16 + 3 + 32 * 16, "total_size": (8 + 3) * 4 + (128 + 512) * 2,
                                 "format": "pt"}
    assert list(index["weight_map"]) == sorted(x.name for x in tensors)
    assert index["weight_map"]["lm_head.weight"] == "model-00002-of-00002.safetensors"
    assert hf_index(files)["metadata"]["total_parameters"] == 8 + 8 * 16 + 3 + 32 * 16


def test_side_files_copied_are_everything_but_weights_and_what_the_plan_writes(tmp_path):
    for name in ("config.json", INDEX_NAME, MANIFEST, "tokenizer.json", "generation_config.json", "LICENSE",
                 "modeling_deepseek.py", ".gitattributes", "model-00001-of-00002.safetensors", "pytorch_model.bin",
                 "weights.gguf", "consolidated.pth"):
        (tmp_path / name).write_text("x")
    (tmp_path / "original").mkdir()  # folders are not copied
    assert files_to_copy(tmp_path) == ["LICENSE", "generation_config.json", "modeling_deepseek.py", "tokenizer.json"]
    # a hub repo: the names come from its listing, nothing is listed on disk
    assert files_to_copy(tmp_path / "absent", ["tokenizer_config.json", "model.safetensors", "config.json"]) == \
        ["tokenizer_config.json"]
