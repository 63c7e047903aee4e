"""quantize --to FORMAT for compressed-tensors' layouts: every tensor byte for byte and the quantization_config as
compressed-tensors 0.20's own compress_model writes them for the same BF16 weights (tests/ct_oracle.py), read back
by the library's decompress and by ckpttool's own readers to the same BF16, loaded by transformers with the same
greedy ids as the library's output; formats and shapes that cannot be written refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import load_dir, run_cli
from ct_oracle import PRESETS, compress_model
from dense_models import BLOCK_LLAMA, build_hf

FORMATS = tuple(PRESETS)
PROMPT = [3, 17, 42, 99]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny llama whose widths the 128-column groups and 128x128 blocks divide."""
    spec = {**BLOCK_LLAMA, "num_hidden_layers": 2}
    return build_hf("llama", tmp_path_factory.mktemp("ct") / "llama", seed=11, spec=spec)


@pytest.fixture(scope="module")
def outputs(llama, tmp_path_factory):
    """fmt -> (ckpttool's output, the library's), each made once."""
    root, made = tmp_path_factory.mktemp("ct-out"), {}

    def get(fmt: str):
        if fmt not in made:
            run_cli("quantize", llama, root / f"ours-{fmt}", "--to", fmt, "--quiet")
            made[fmt] = (root / f"ours-{fmt}", compress_model(llama, root / f"lib-{fmt}", fmt))
        return made[fmt]
    return get


def _tensors(path) -> dict[str, torch.Tensor]:
    return {k: v for file in load_dir(path).values() for k, v in file.items()}


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("fmt", FORMATS)
def test_output_is_the_librarys_compress_model_byte_for_byte(outputs, fmt):
    ours, lib = outputs(fmt)
    a, b = _tensors(ours), _tensors(lib)
    assert sorted(a) == sorted(b)
    for name, ref in b.items():
        assert (a[name].dtype, a[name].shape) == (ref.dtype, ref.shape), name
        assert _bytes(a[name]) == _bytes(ref), name
    quantized = [n for n in b if n.endswith(("weight_scale",))]
    assert len(quantized) == 14  # 7 projections a layer, the head and embeddings left as they were
    assert json.loads((ours / "config.json").read_text())["quantization_config"] == \
        json.loads((lib / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_library_and_ckpttool_read_it_back_to_the_same_bf16(outputs, fmt, tmp_path):
    """compressed-tensors' decompress of each stored weight equals what ckpttool's dequant (main's readers)
    writes for it; the decompressed weight is within the format's rounding of the source."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    ours, _ = outputs(fmt)
    run_cli("dequant", ours, tmp_path / "bf16", "--quiet")
    back, stored = _tensors(tmp_path / "bf16"), _tensors(ours)
    scheme = preset_name_to_scheme(PRESETS[fmt], ["Linear"])
    fmt_name = json.loads((ours / "config.json").read_text())["quantization_config"]["format"]
    compressor = BaseCompressor.get_value_from_registry(fmt_name)
    n = 0
    for name in back:
        prefix = name[: -len("weight")]
        local = {k[len(prefix):]: v for k, v in stored.items() if k.startswith(prefix) and "." not in k[len(prefix):]}
        if "weight_scale" not in local:
            continue
        ref = compressor.decompress(local, scheme)["weight"]
        assert back[name].dtype == torch.bfloat16 and torch.equal(back[name], ref.to(torch.bfloat16)), name
        n += 1
    assert n == 14


@pytest.mark.parametrize("fmt", FORMATS)
def test_transformers_generates_on_it_what_it_generates_on_the_librarys(outputs, fmt):
    import transformers

    ours, lib = outputs(fmt)

    def greedy(path):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        with torch.no_grad():
            return model.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0].tolist()
    if fmt == "w4a16-asym":
        # transformers 5.24 + compressed-tensors 0.20 allocate W4A16_ASYM's zero points unpacked ([M, G]) and refuse
        # the packed [M/8, G] that the library itself writes: the library's own output fails to load the same way
        for path in (lib, ours):
            with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
                greedy(path)
        return
    assert greedy(ours) == greedy(lib)


def test_fp8_block_alias_writes_deepseeks_blocks(llama, tmp_path):
    """the old recipe name stays: fp8_block is fp8-block-deepseek, bytes and config alike"""
    run_cli("quantize", llama, tmp_path / "a", "--to", "fp8_block", "--quiet")
    run_cli("quantize", llama, tmp_path / "b", "--to", "fp8-block-deepseek", "--quiet")
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"


def test_unknown_format_and_unshardable_formats_are_refused_by_name(llama, tmp_path):
    proc = run_cli("quantize", llama, tmp_path / "x", "--to", "w3a16", check=False)
    assert proc.returncode != 0 and "w4a16" in proc.stderr  # the choices are listed
    proc = run_cli("quantize", llama, tmp_path / "y", "--to", "w4a16", "--mp", 2, check=False)
    assert proc.returncode != 0 and "w4a16 output is HF layout only" in proc.stderr
    assert "fp8-block-deepseek" in proc.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_a_shape_the_groups_do_not_divide_is_refused_naming_the_tensor(tmp_path):
    spec = dict(cls="LlamaForCausalLM", config="LlamaConfig", vocab_size=256, hidden_size=96, intermediate_size=192,
                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=48,
                max_position_embeddings=64, tie_word_embeddings=False)
    src = build_hf("llama", tmp_path / "odd", seed=1, spec=spec)
    proc = run_cli("quantize", src, tmp_path / "q", "--to", "w4a16", check=False)
    assert proc.returncode != 0
    assert "divisible by 128" in proc.stderr and "model.layers.0." in proc.stderr
    assert not (tmp_path / "q").exists()
    run_cli("quantize", src, tmp_path / "ok", "--to", "fp8-channel", "--quiet")  # a row takes any shape


def test_moe_routers_and_head_stay_and_are_ignored_in_the_config(tmp_path):
    """Which weights are quantized comes from the family's table: Qwen3-MoE's experts and projections are, its
    routers (Linear modules too) and head are not, and compressed-tensors' `ignore` lists them in the model's
    order (the library lists every Linear it left alone). transformers generates on the output what it generates
    on ckpttool's own dequantization of it."""
    import transformers

    spec = dict(cls="Qwen3MoeForCausalLM", config="Qwen3MoeConfig", vocab_size=256, hidden_size=256,
                intermediate_size=512, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                max_position_embeddings=64, tie_word_embeddings=False, decoder_sparse_step=1, norm_topk_prob=True)
    src = build_hf("qwen3", tmp_path / "moe", seed=3, spec=spec)
    run_cli("quantize", src, tmp_path / "w4", "--to", "w4a16", "--quiet")
    config = json.loads((tmp_path / "w4" / "config.json").read_text())["quantization_config"]
    assert config["ignore"] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "lm_head"]
    out = _tensors(tmp_path / "w4")
    assert out["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    assert "model.layers.1.mlp.experts.3.up_proj.weight_packed" in out
    run_cli("dequant", tmp_path / "w4", tmp_path / "bf16", "--quiet")

    def greedy(path):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        with torch.no_grad():
            return model.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0].tolist()
    assert greedy(tmp_path / "w4") == greedy(tmp_path / "bf16")


def test_a_tied_head_is_ignored_as_the_library_ignores_it(tmp_path):
    """tie_word_embeddings: no lm_head tensor is stored, but transformers' model has the Linear module, and the
    library lists it in `ignore`; so does ckpttool (from the family's key table), bytes and config alike."""
    spec = {**BLOCK_LLAMA, "tie_word_embeddings": True}
    src = build_hf("llama", tmp_path / "tied", seed=2, spec=spec)
    lib = compress_model(src, tmp_path / "lib", "w8a16")
    run_cli("quantize", src, tmp_path / "ours", "--to", "w8a16", "--quiet")
    ours = json.loads((tmp_path / "ours" / "config.json").read_text())["quantization_config"]
    assert ours == json.loads((lib / "config.json").read_text())["quantization_config"]
    assert ours["ignore"] == ["lm_head"]
    a, b = _tensors(tmp_path / "ours"), _tensors(lib)
    assert sorted(a) == sorted(b) and all(_bytes(a[k]) == _bytes(b[k]) for k in b)


def test_the_recipe_stage_writes_what_the_command_writes(outputs, llama, tmp_path):
    """`quantize: {format: mxfp4}` in a recipe is the command's preset: the same files."""
    ours, _ = outputs("mxfp4")
    recipe = tmp_path / "q.yaml"
    recipe.write_text("name: q\nstages:\n  - quantize: {format: mxfp4}\n")
    run_cli("run", recipe, "-i", llama, "-o", tmp_path / "out", "--quiet")
    for f in ours.glob("*.safetensors"):
        assert f.read_bytes() == (tmp_path / "out" / f.name).read_bytes()
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads((ours / "config.json").read_text())
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: q\nstages:\n  - quantize: {format: w3a16}\n")
    proc = run_cli("run", bad, "-i", llama, "-o", tmp_path / "x", check=False)
    assert proc.returncode != 0 and "w4a16" in proc.stderr  # the schema lists the formats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_rounding_and_packing_are_the_librarys_at_every_threshold(dtype):
    """kernels/quant_ct.fp4_packed (one bucketize) against compressed-tensors' cast_to_fp4 + pack_fp4_to_uint8 (its
    CPU forms): each threshold, the floats either side of it, both zeros, the range's ends, and random values."""
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    from ckpttool.kernels.quant_ct import fp4_packed

    edge = []
    for v in (0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0):
        t = torch.tensor([v])
        for d in (t, torch.nextafter(t, torch.tensor([10.0])), torch.nextafter(t, torch.tensor([-10.0]))):
            edge += [float(d), -float(d)]
    x = torch.cat([torch.tensor(edge + [-0.0, 0.0]), torch.randn(4096) * 3]).clamp(-6, 6).to(dtype)
    x = x[: x.numel() // 2 * 2].reshape(1, -1)
    assert torch.equal(fp4_packed(x), pack_fp4_to_uint8(cast_to_fp4(x.clone())))
