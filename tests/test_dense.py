"""Dense families (llama, qwen2, qwen3, mistral): shard --mp N, then verify gives transformers' greedy tokens.

Inputs are tiny checkpoints saved by transformers; the oracle is transformers' own generate() on
them, independent of our key table, split rules and bundled model.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import load_dir, run_cli
from family_checks import verify_equals_transformers
from dense_models import NEW_TOKENS, PROMPT, TINY, build_hf, config_of, greedy_oracle


pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def dense_hf(tmp_path_factory) -> dict:
    """family -> (HF dir, transformers' greedy ids, their logits), built once."""
    root = tmp_path_factory.mktemp("dense")
    out = {}
    for family in TINY:
        hf = build_hf(family, root / family)
        out[family] = (hf, *greedy_oracle(hf))
    return out


@pytest.mark.parametrize("mp", [2, 4])
@pytest.mark.parametrize("family", sorted(TINY))
def test_shard_then_verify_gives_transformers_greedy_tokens(dense_hf, tmp_path, family, mp):
    hf, ids, logits = dense_hf[family]
    out = tmp_path / "mp"
    run_cli("shard", hf, out, "--mp", mp, "--quiet")
    assert sorted(load_dir(out)) == [f"model{r}-mp{mp}.safetensors" for r in range(mp)]
    verify_equals_transformers(out, hf, ids, logits, tmp_path, PROMPT, NEW_TOKENS)


def test_mp_layout_names_splits_and_gqa_replication(dense_hf, tmp_path):
    """qwen2 has one KV head: at mp=4 every rank holds that head (and its bias) whole; q is cut on heads;
    o/down on dim 1; no output.weight, because the embeddings are tied."""
    hf = dense_hf["qwen2"][0]
    run_cli("shard", hf, tmp_path / "out", "--mp", 4, "--quiet")
    src = load_file(str(hf / "model.safetensors"))
    shards = load_dir(tmp_path / "out")
    cfg = config_of(hf)
    d = cfg["hidden_size"] // cfg["num_attention_heads"]
    for r in range(4):
        s = shards[f"model{r}-mp4.safetensors"]
        assert "output.weight" not in s
        assert torch.equal(s["layers.0.attention.wk.weight"], src["model.layers.0.self_attn.k_proj.weight"])
        assert torch.equal(s["layers.0.attention.wv.bias"], src["model.layers.0.self_attn.v_proj.bias"])
        assert torch.equal(s["layers.1.attention.wq.weight"], src["model.layers.1.self_attn.q_proj.weight"][r * d:(r + 1) * d])
        assert torch.equal(s["layers.1.attention.wq.bias"], src["model.layers.1.self_attn.q_proj.bias"][r * d:(r + 1) * d])
        assert torch.equal(s["layers.0.attention.wo.weight"], src["model.layers.0.self_attn.o_proj.weight"][:, r * d:(r + 1) * d])
        assert torch.equal(s["layers.0.feed_forward.w2.weight"], src["model.layers.0.mlp.down_proj.weight"].chunk(4, 1)[r])
        assert torch.equal(s["tok_embeddings.weight"], src["model.embed_tokens.weight"].chunk(4, 0)[r])
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is True


def test_llama_kv_heads_at_mp4_are_each_held_by_two_ranks(dense_hf, tmp_path):
    hf = dense_hf["llama"][0]
    run_cli("shard", hf, tmp_path / "out", "--mp", 4, "--quiet")
    src = load_file(str(hf / "model.safetensors"))["model.layers.0.self_attn.k_proj.weight"]
    heads = src.chunk(2, 0)
    shards = load_dir(tmp_path / "out")
    for r in range(4):  # rank r holds KV head r * 2 // 4
        assert torch.equal(shards[f"model{r}-mp4.safetensors"]["layers.0.attention.wk.weight"], heads[r * 2 // 4])


def test_mp_that_cuts_heads_is_refused(dense_hf, tmp_path):
    """8 ranks for 4 query heads: a row split would divide the rows evenly but cut heads in half."""
    proc = run_cli("shard", dense_hf["qwen3"][0], tmp_path / "out", "--mp", 8, "--quiet", check=False)
    assert proc.returncode != 0
    assert "4 heads (num_attention_heads) cannot be cut evenly over mp=8" in proc.stderr
    assert not (tmp_path / "out" / "model0-mp8.safetensors").exists()


def test_head_split_ranges():
    from ckpttool.families.base import HeadSplit

    kv = HeadSplit(dim=0, count="num_key_value_heads", replicate=True)
    assert kv.ranges(32, 2, 2) == [(0, 16), (16, 16)]
    assert kv.ranges(32, 2, 8) == [(0, 16)] * 4 + [(16, 16)] * 4
    assert isinstance(kv.ranges(48, 3, 2), str)  # neither divides
    assert isinstance(HeadSplit(dim=0, count="num_attention_heads").ranges(64, 4, 8), str)  # no replication for q


def test_sliding_window_changes_mistral_output(dense_hf):
    """The mistral fixture's window (4) is shorter than prompt + generation, so verify's agreement with
    transformers above exercises the window mask."""
    import transformers

    hf, ids, _ = dense_hf["mistral"]
    config = transformers.AutoConfig.from_pretrained(hf)
    config.sliding_window = None
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, config=config, dtype=torch.float32).eval()
    with torch.no_grad():
        full = model(torch.tensor([PROMPT + ids[:-1]])).logits[0, len(PROMPT) - 1:]
    assert full.argmax(-1).tolist() != ids


@pytest.mark.parametrize("flags", [{}, {"attention_bias": True, "mlp_bias": True}])
@pytest.mark.parametrize("family", sorted(TINY))
def test_each_model_types_row_names_the_tensors_transformers_builds(family, flags):
    """families/dense/spec.TYPES says which config fields each model_type's biases and norms follow: its tensor set
    and shapes equal transformers' own model built from the same config (llama reads both bias flags, qwen3
    attention_bias only, qwen2 always has q/k/v biases, mistral none), with and without the flags set."""
    import transformers

    from ckpttool.families.dense.spec import DenseConfig, hf_tensor_shapes

    spec = {**TINY[family], **flags}
    cls, config_cls = getattr(transformers, spec.pop("cls")), getattr(transformers, spec.pop("config"))
    config = config_cls(**spec)
    with torch.device("meta"):
        model = cls(config)
    want = {name: tuple(t.shape) for name, t in model.state_dict().items()
            if not (config.tie_word_embeddings and name == "lm_head.weight")}
    assert hf_tensor_shapes(DenseConfig.from_dict(config.to_dict())) == want
