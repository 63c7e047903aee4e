"""plan/merge.py on its own, without the CLI: the plan that puts mp shards back into an HF checkpoint, from their
headers and config.json. Each HF tensor comes back with its original name, dtype and shape, from the right
pieces: cut tensors concatenated along the row's split from every rank in order, replicated ones from rank 0,
replicated KV heads from the first rank holding each, routed experts from the one rank owning them, FP8 scales
beside their weights; files fill in layer order up to max_shard_bytes. Shards that do not add up are refused,
naming the shard file, the tensor and the fix. The shards are real, written by ckpttool's own runner."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from ckpttool.errors import InputError
from ckpttool.io.checkpoint import Checkpoint
from ckpttool.io.layout import MANIFEST, mp_file
from ckpttool.plan.build import Spec
from ckpttool.plan.merge import MergeSpec, plan_merge
from ckpttool.runner import ExecOptions, convert


def sharded(src: Path, dst: Path, mp: int, *, dequant: bool = False) -> Path:
    convert(src, dst, Spec(mp=mp, dequant=dequant), ExecOptions(quiet=True, processes=1, workers=2))
    return dst


def planned(shards: Path, max_shard_bytes: int = 50 << 30):
    spec = MergeSpec(max_shard_bytes=max_shard_bytes)
    with spec.open(shards) as inputs:
        return plan_merge(inputs, max_shard_bytes=max_shard_bytes)


def merged_tensors(plan) -> dict:
    return {p.tensor.name: p.tensor for f in plan.files for p in f.tensors}


def original(src: Path) -> dict[str, tuple[str, tuple]]:
    with Checkpoint(src) as ckpt:
        return {n: (s.info.dtype, tuple(s.info.shape)) for n, s in ckpt.tensors.items()}


@pytest.fixture(scope="module")
def llama_mp4(tiny_llama, tmp_path_factory) -> Path:
    """4 query heads and 2 KV heads at mp 4: each KV head is held by two ranks."""
    return sharded(tiny_llama, tmp_path_factory.mktemp("merge") / "llama-mp4", 4)


def test_every_tensor_comes_back_as_it_was(tiny_llama, llama_mp4):
    plan = planned(llama_mp4)
    got = {n: (t.dtype, t.shape) for n, t in merged_tensors(plan).items()}
    assert got == original(tiny_llama)
    assert plan.format == "hf" and [f.name for f in plan.files] == ["model.safetensors"] and plan.index is None
    assert "config.json" in plan.copies and plan.config is None  # config.json is copied as shard wrote it


def test_pieces_follow_each_rows_split(llama_mp4):
    """Which rank files make each tensor, and along which dim they are joined."""
    t = merged_tensors(planned(llama_mp4))
    ranks = [mp_file(r, 4) for r in range(4)]
    q = t["model.layers.0.self_attn.q_proj.weight"]
    assert [f for f, _ in q.parts] == ranks and q.concat_dim == 0
    assert {n for _, n in q.parts} == {"layers.0.attention.wq.weight"}
    k = t["model.layers.0.self_attn.k_proj.weight"]  # KV head 0 on ranks 0-1, head 1 on ranks 2-3: first holders
    assert [f for f, _ in k.parts] == [ranks[0], ranks[2]] and k.concat_dim == 0
    o = t["model.layers.1.self_attn.o_proj.weight"]
    assert [f for f, _ in o.parts] == ranks and o.concat_dim == 1
    norm = t["model.layers.1.input_layernorm.weight"]
    assert norm.parts == ((ranks[0], "layers.1.attention_norm.weight"),)


def test_files_fill_in_layer_order_with_an_index(tiny_llama, llama_mp4):
    """Over max_shard_bytes the output is model-0000i-of-0000n files in transformers' way, filled layer by
    layer, with an index whose total_size is the tensors' bytes."""
    one = planned(llama_mp4)
    biggest = max(p.tensor.nbytes for f in one.files for p in f.tensors)
    plan = planned(llama_mp4, max_shard_bytes=biggest)
    n = len(plan.files)
    assert n > 2 and [f.name for f in plan.files] == [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    by_layer = sorted((int(p.tensor.name.split(".")[2]), i) for i, f in enumerate(plan.files) for p in f.tensors
                      if p.tensor.name.startswith("model.layers."))
    assert [i for _, i in by_layer] == sorted(i for _, i in by_layer)  # no file goes back to an earlier layer
    assert plan.index["metadata"]["total_size"] == sum(p.end - p.start for f in plan.files for p in f.tensors)
    assert set(plan.index["weight_map"]) == set(original(tiny_llama))


def test_deepseek_fp8_experts_and_scales(tiny_v3_no_mtp, tmp_path):
    """DeepSeek-V3 at mp 2 with FP8 kept: each expert (and its scale) from the one rank holding it, the scales
    back under `weight_scale_inv`, every other tensor as the input had it."""
    shards = sharded(tiny_v3_no_mtp, tmp_path / "v3-mp2", 2)
    t = merged_tensors(planned(shards))
    assert {n: (x.dtype, x.shape) for n, x in t.items()} == original(tiny_v3_no_mtp)
    for e in range(8):
        for name in (f"model.layers.1.mlp.experts.{e}.down_proj.weight",
                     f"model.layers.1.mlp.experts.{e}.down_proj.weight_scale_inv"):
            assert [f for f, _ in t[name].parts] == [mp_file(e // 4, 2)]
    scale = t["model.layers.0.self_attn.kv_b_proj.weight_scale_inv"]
    assert [f for f, _ in scale.parts] == [mp_file(0, 2), mp_file(1, 2)]
    assert {n for _, n in scale.parts} == {"layers.0.attn.wkv_b.scale"}


def edited(shards: Path, tmp_path: Path, rank: int, change) -> Path:
    """A copy of the shards without their manifest (as DeepSeek's convert.py writes them), rank `rank`'s file
    rewritten by change({name: tensor}) -> {name: tensor}."""
    copy = tmp_path / "edited"
    shutil.copytree(shards, copy)
    (copy / MANIFEST).unlink()
    path = copy / mp_file(rank, len(list(copy.glob("model*-mp*.safetensors"))))
    save_file(change(load_file(str(path))), str(path), metadata={"format": "pt"})
    return copy


def refused(shards: Path) -> InputError:
    with pytest.raises(InputError) as err:
        planned(shards)
    return err.value


def test_a_rank_missing_a_tensor_is_named(llama_mp4, tmp_path):
    gone = "layers.1.feed_forward.w1.weight"
    err = refused(edited(llama_mp4, tmp_path, 3, lambda d: {k: v for k, v in d.items() if k != gone}))
    assert "rank(s) [3] lack this tensor" in str(err) and err.tensor == gone
    assert Path(err.file).name == mp_file(3, 4)


def test_ranks_that_disagree_on_a_dtype_are_refused(llama_mp4, tmp_path):
    name = "layers.0.feed_forward.w3.weight"
    err = refused(edited(llama_mp4, tmp_path, 2, lambda d: {**d, name: d[name].float()}))
    assert "ranks disagree on the dtype" in str(err) and err.tensor == name


def test_a_name_no_row_reads_back_is_refused(llama_mp4, tmp_path):
    err = refused(edited(llama_mp4, tmp_path, 1, lambda d: {**d, "layers.0.feed_forward.w9.weight": d["norm.weight"].clone()}))
    assert "not a dense mp tensor name" in str(err) and err.tensor == "layers.0.feed_forward.w9.weight"
    assert Path(err.file).name == mp_file(1, 4)


def test_shapes_that_contradict_config_json_are_refused(llama_mp4, tmp_path):
    name = "layers.1.feed_forward.w2.weight"
    err = refused(edited(llama_mp4, tmp_path, 0, lambda d: {**d, name: d[name][:, :-1].contiguous()}))
    assert "contradicts config.json" in str(err) and err.tensor == name


def test_an_expert_on_two_ranks_is_refused(tiny_v3_no_mtp, tmp_path):
    shards = sharded(tiny_v3_no_mtp, tmp_path / "v3-mp2", 2, dequant=True)
    expert = "layers.1.ffn.experts.0.w1.weight"
    donor = load_file(str(shards / mp_file(0, 2)))[expert]
    err = refused(edited(shards, tmp_path, 1, lambda d: {**d, expert: donor}))
    assert "routed expert tensor is on ranks [0, 1]" in str(err) and err.tensor == expert


def test_a_config_json_of_another_model_is_refused(llama_mp4, tmp_path):
    copy = tmp_path / "other-config"
    shutil.copytree(llama_mp4, copy)
    (copy / MANIFEST).unlink()
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] * 2}))
    err = refused(copy)
    assert "contradicts config.json" in str(err) and "config.json belongs to these shards" in err.fix
