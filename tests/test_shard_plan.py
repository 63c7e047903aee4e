"""plan/shard.py on its own, without the CLI or any weights: the TensorPlans a family's key table makes of an HF
checkpoint's tensors at mp N. Column-parallel rows are cut in whole heads (KV heads replicated when fewer than
ranks), row-parallel ones along dim 1, replicated tensors copied to every rank, routed experts whole on the rank
owning their range, FP8 weights kept as FP8 cut only on 128x128 block boundaries (with their scales cut to
match), a wrapper's vision tower whole on rank 0; everything else is refused by name before a byte is read."""

from __future__ import annotations

import copy

import pytest

from ckpttool.errors import PlanError
from ckpttool.families.deepseek.demo import PRESETS
from ckpttool.families.deepseek.spec import is_fp8_in_published_checkpoint
from ckpttool.families.table import family_for
from ckpttool.formats import FP8_SCALE, SCALE_SUFFIX
from ckpttool.io.layout import mp_file
from ckpttool.plan.shard import shard
from ckpttool.plan.types import TensorPlan

LLAMA = {"model_type": "llama", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}


def checkpoint(raw: dict, *, fp8: bool = False, in_file: str = "model-00001-of-00002.safetensors"):
    """(family, parsed config, the HF tensors the config implies as TensorPlans, files_of); with `fp8`, every
    weight DeepSeek publishes in FP8 is F8_E4M3 with its F32 `weight_scale_inv` beside it."""
    family = family_for(raw)
    cfg = family.parse_config(raw, "config.json")
    tensors = []
    for name, shape in family.expected_shapes(cfg, False).items():
        if fp8 and is_fp8_in_published_checkpoint(name):
            tensors.append(TensorPlan(name, "F8_E4M3", shape, source=name, file=in_file))
            scale = (-(-shape[0] // FP8_SCALE.block), -(-shape[1] // FP8_SCALE.block))
            tensors.append(TensorPlan(name + SCALE_SUFFIX, "F32", scale, source=name + SCALE_SUFFIX, file=in_file))
        else:
            tensors.append(TensorPlan(name, "BF16", shape, source=name, file=in_file))
    return family, cfg, tensors, {t.name: in_file for t in tensors}


def by_name(out: list[TensorPlan]) -> dict[str, list[TensorPlan]]:
    found: dict[str, list[TensorPlan]] = {}
    for t in out:
        found.setdefault(t.name, []).append(t)
    return found


def test_dense_heads_cut_whole_and_kv_heads_replicated():
    """Llama, 4 query heads and 2 KV heads at mp 4: each rank one query head; KV head 0 on ranks 0 and 1,
    head 1 on ranks 2 and 3; o_proj and down_proj along dim 1; norms on every rank; one file per rank."""
    family, cfg, tensors, files_of = checkpoint(LLAMA)
    out = by_name(shard(tensors, family, cfg, 4, files_of))
    assert {t.file for ts in out.values() for t in ts} == {mp_file(r, 4) for r in range(4)}
    wq = out["layers.0.attention.wq.weight"]
    assert [t.narrow for t in wq] == [(0, r * 64, 64) for r in range(4)]
    assert [t.file for t in wq] == [mp_file(r, 4) for r in range(4)] and all(t.shape == (64, 256) for t in wq)
    for kv in ("wk", "wv"):
        parts = out[f"layers.1.attention.{kv}.weight"]
        assert [t.narrow for t in parts] == [(0, 0, 64), (0, 0, 64), (0, 64, 64), (0, 64, 64)]
        assert all(t.source == f"model.layers.1.self_attn.{kv[1]}_proj.weight" for t in parts)
    assert [t.narrow for t in out["layers.0.attention.wo.weight"]] == [(1, r * 64, 64) for r in range(4)]
    assert [t.narrow for t in out["layers.0.feed_forward.w2.weight"]] == [(1, r * 128, 128) for r in range(4)]
    assert [t.narrow for t in out["tok_embeddings.weight"]] == [(0, r * 128, 128) for r in range(4)]
    norm = out["layers.0.attention_norm.weight"]
    assert len(norm) == 4 and all(t.narrow is None and t.shape == (256,) for t in norm)
    assert len(out) == len(tensors)  # each HF tensor is one mp name


def test_mp1_keeps_every_tensor_whole():
    family, cfg, tensors, files_of = checkpoint(LLAMA)
    out = shard(tensors, family, cfg, 1, files_of)
    assert len(out) == len(tensors) and all(t.narrow is None and t.file == mp_file(0, 1) for t in out)


def test_deepseek_fp8_kept_experts_by_rank_and_scales_on_blocks():
    """DeepSeek-V3 at mp 2, FP8 kept: expert e (of 8) whole on rank e // 4; a column-parallel FP8 weight cut
    in halves of whole 128-blocks, its scale cut in the matching block rows; a row-parallel one along dim 1;
    the router and its correction bias on both ranks."""
    family, cfg, tensors, files_of = checkpoint(PRESETS["tiny-v3"], fp8=True)
    out = by_name(shard(tensors, family, cfg, 2, files_of))
    for e in range(8):
        for w in ("w1", "w2", "w3"):
            for leaf in ("weight", "scale"):
                (t,) = out[f"layers.1.ffn.experts.{e}.{w}.{leaf}"]
                assert t.file == mp_file(e // 4, 2) and t.narrow is None
    wkv_b, scale = out["layers.0.attn.wkv_b.weight"], out["layers.0.attn.wkv_b.scale"]
    rows = wkv_b[0].shape[0]
    assert [t.narrow for t in wkv_b] == [(0, 0, rows), (0, rows, rows)] and rows % 128 == 0
    assert [t.narrow for t in scale] == [(0, 0, rows // 128), (0, rows // 128, rows // 128)]
    assert all(t.dtype == "F8_E4M3" for t in wkv_b) and all(t.dtype == "F32" for t in scale)
    assert [t.narrow[0] for t in out["layers.0.attn.wo.weight"]] == [1, 1]
    assert [t.narrow[0] for t in out["layers.0.attn.wo.scale"]] == [1, 1]
    for name in ("layers.1.ffn.gate.weight", "layers.1.ffn.gate.bias", "layers.0.attn.wkv_a.weight"):
        assert [t.file for t in out[name]] == [mp_file(0, 2), mp_file(1, 2)]
        assert all(t.narrow is None for t in out[name])


def test_fp8_kept_off_the_blocks_is_refused_and_dequantized_is_not():
    """At mp 4 the shared expert's 256 rows of w1 cut into 64: a 128x128 block's scale would straddle two ranks.
    Refused naming the tensor, the file and --dtype bf16; the same weight dequantized (a transform on it) cuts."""
    family, cfg, tensors, files_of = checkpoint(PRESETS["tiny-v3"], fp8=True)
    with pytest.raises(PlanError) as err:
        shard(tensors, family, cfg, 4, files_of)
    assert "block boundaries" in str(err.value) and "--dtype bf16" in str(err.value)
    assert err.value.tensor and err.value.file == files_of[err.value.tensor]
    dequantized = [t.with_(dtype="BF16", transform="fp8_block") for t in tensors if not t.name.endswith(SCALE_SUFFIX)]
    out = by_name(shard(dequantized, family, cfg, 4, files_of))
    assert [t.narrow for t in out["layers.1.ffn.shared_experts.w1.weight"]] == [(0, r * 64, 64) for r in range(4)]


@pytest.mark.parametrize("raw,mp,what", [
    ({**LLAMA, "num_attention_heads": 4}, 3, "heads"),
    ({**LLAMA, "vocab_size": 510}, 4, "vocab_size"),
    ({**PRESETS["tiny-v3"], "n_routed_experts": 6, "n_group": 2}, 4, "n_routed_experts"),
])
def test_an_mp_that_cuts_a_unit_is_refused_before_any_tensor(raw, mp, what):
    """Sizes that divide are not enough: the family's check_mp refuses an mp that cuts a head, an expert range
    or the vocabulary, naming the field and the fix."""
    family, cfg, tensors, files_of = checkpoint(raw)
    with pytest.raises(PlanError) as err:
        shard(tensors, family, cfg, mp, files_of)
    assert what in str(err.value) and "--mp" in err.value.fix


def test_a_tensor_without_a_row_is_refused_naming_it_and_its_file():
    family, cfg, tensors, files_of = checkpoint(LLAMA)
    stray = TensorPlan("model.layers.0.mlp.extra_proj.weight", "BF16", (8, 8), source="model.layers.0.mlp.extra_proj.weight")
    with pytest.raises(PlanError) as err:
        shard(tensors + [stray], family, cfg, 2, {**files_of, stray.name: "model-00002-of-00002.safetensors"})
    assert "no row in the key table" in str(err.value)
    assert err.value.tensor == stray.name and str(err.value.file) == "model-00002-of-00002.safetensors"


def test_a_wrappers_vision_tower_goes_whole_to_rank0():
    """Kimi-K2.5: its DeepSeek-V3 text tower is cut as DeepSeek's; the vision tower and projector are passed
    through whole, under their HF names, on rank 0 only."""
    text = copy.deepcopy(PRESETS["tiny-v3"])
    raw = {"model_type": "kimi_k25", "text_config": text}
    family = family_for(raw)
    cfg = family.parse_config(raw, "config.json")
    vision = ["vision_tower.blocks.0.attn.qkv.weight", "mm_projector.proj.0.weight"]
    cfg = family.spelled(cfg, [*family.expected_shapes(cfg, False), *vision])  # the hub's spelling
    inner = family_for(text).parse_config(text)
    tensors = [TensorPlan(n, "BF16", s, source=n) for n, s in family.expected_shapes(cfg, False).items()]
    tensors += [TensorPlan(n, "BF16", (32, 16), source=n) for n in vision]
    out = by_name(shard(tensors, family, cfg, 2, {}))
    for n in vision:
        (t,) = out[n]
        assert t.file == mp_file(0, 2) and t.narrow is None and t.shape == (32, 16)
    assert [t.narrow for t in out["embed.weight"]] == [(0, 0, inner.vocab_size // 2),
                                                       (0, inner.vocab_size // 2, inner.vocab_size // 2)]
