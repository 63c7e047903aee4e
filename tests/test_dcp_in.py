"""A torch distributed checkpoint as an input: DCPs written by torch itself from a real gloo process group (DTensors
cut along dim 0 as FSDP2 cuts them, along dim 1 as tensor parallelism does, replicated, unevenly over 3 ranks),
read without torch and without unpickling anything but the DCP metadata classes; HF -> DCP -> HF byte-identical
per tensor, to mp shards as from the HF checkpoint, resumable; and every mistake a reader could make (a chunk's
byte range off by one, a chunk's box moved or transposed, a view saved transposed) refused by name, not misread."""

from __future__ import annotations

import pickle
import shutil
import signal

import pytest

from conftest import run_cli, run_cli_process
from dcp_builders import save_dcp
from ckpttool.io.layout import MANIFEST

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402


def _tensors(directory) -> dict:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _same_bytes(ours: dict, ref: dict) -> None:
    assert sorted(ours) == sorted(ref)
    for name, t in ref.items():
        assert ours[name].dtype == t.dtype and ours[name].shape == t.shape, name
        assert ours[name].reshape(-1).view(torch.uint8).equal(t.reshape(-1).view(torch.uint8)), name


@pytest.fixture(scope="module")
def dcps(tmp_path_factory) -> dict:
    """llama (2 KV heads) and qwen2 (q/k/v biases, tied embeddings), each from HF: 2 ranks with every third tensor
    cut on dim 0, dim 1 or replicated, under `model.` beside optimizer state and a step count; qwen2 also over 3
    ranks, bare names, cut on dim 1 then dim 0 (DTensor's uneven last chunks)."""
    from dense_models import build_hf

    root = tmp_path_factory.mktemp("dcp_in")
    hf = {family: build_hf(family, root / f"hf-{family}", seed=3) for family in ("llama", "qwen2")}
    return {
        "hf": hf,
        "llama": save_dcp(hf["llama"], root / "llama-2"),
        "qwen2": save_dcp(hf["qwen2"], root / "qwen2-2"),
        "qwen2-3": save_dcp(hf["qwen2"], root / "qwen2-3", world=3, dims=(1, 0), prefix="", optim=False),
    }


@pytest.mark.parametrize("which", ["llama", "qwen2", "qwen2-3"])
def test_hf_to_dcp_to_hf_is_byte_identical_per_tensor(dcps, tmp_path, which):
    family = which.split("-")[0]
    run_cli("convert", dcps[which], tmp_path / "hf", "--quiet")
    _same_bytes(_tensors(tmp_path / "hf"), _tensors(dcps["hf"][family]))
    assert not list((tmp_path / "hf").glob("*.distcp")) and not (tmp_path / "hf" / ".metadata").exists()
    assert run_cli("inspect", tmp_path / "hf", "--check").returncode == 0


def test_the_plan_says_what_it_read_and_left_out(dcps):
    import json

    notes = json.loads(run_cli("plan", dcps["llama"], "--json").stdout)["notes"]
    assert any("torch distributed checkpoint" in n and "2 .distcp files" in n for n in notes), notes
    assert "read the names under `model.` as the model's" in notes
    left = [n for n in notes if n.startswith("left out")]
    assert left and "optim.state." in left[0] and "step" not in left[0].split(":")[0], notes
    bare = json.loads(run_cli("plan", dcps["qwen2-3"], "--json").stdout)["notes"]
    assert not any(n.startswith(("left out", "read the names under")) for n in bare), bare


@pytest.mark.parametrize("which", ["llama", "qwen2-3"])
def test_dcp_to_mp_is_the_hf_checkpoints_shards(dcps, tmp_path, which):
    """Chunks cut one way re-cut for mp 2 another way, in one pass: the same files as from the HF checkpoint."""
    family = which.split("-")[0]
    run_cli("convert", dcps[which], tmp_path / "dcp-mp", "--mp", 2, "--quiet")
    run_cli("convert", dcps["hf"][family], tmp_path / "hf-mp", "--mp", 2, "--quiet")
    for name in ("model0-mp2.safetensors", "model1-mp2.safetensors", "config.json"):
        assert (tmp_path / "dcp-mp" / name).read_bytes() == (tmp_path / "hf-mp" / name).read_bytes(), name


def test_torchrun_ranks_and_dequant_shard_presets_read_a_dcp(dcps, tmp_path):
    """Under torchrun each rank assembles its share of the files from the chunks; `shard` and `dequant` (presets of
    the same pipeline) read a DCP as convert does: the bytes of one process's convert."""
    import os
    import subprocess
    import sys

    run_cli("convert", dcps["qwen2-3"], tmp_path / "one", "--mp", 2, "--quiet")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "ckpttool",
         "convert", str(dcps["qwen2-3"]), str(tmp_path / "ranks"), "--mp", "2", "--quiet", "--workers", "1"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_cli("shard", dcps["qwen2-3"], tmp_path / "shard", "--mp", 2, "--dtype", "bf16", "--quiet")
    for out in ("ranks", "shard"):
        assert {p.name: p.read_bytes() for p in (tmp_path / out).iterdir()} == \
            {p.name: p.read_bytes() for p in (tmp_path / "one").iterdir()}, out
    run_cli("dequant", dcps["qwen2-3"], tmp_path / "dequant", "--quiet")
    _same_bytes(_tensors(tmp_path / "dequant"), _tensors(dcps["hf"]["qwen2"]))


def test_inspect_lists_every_stored_chunk(dcps):
    import json

    rep = json.loads(run_cli("inspect", dcps["qwen2-3"], "--json").stdout)
    assert rep["layout"] == "dcp" and sorted(rep["files"]) == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    assert rep["model_type"] == "qwen2"


def test_killed_then_resumed_is_byte_identical(dcps, tmp_path):
    flags = ("--mp", "2", "--quiet", "--workers", "2", "--processes", "1")
    run_cli("convert", dcps["llama"], tmp_path / "clean", *flags)
    proc = run_cli_process("convert", dcps["llama"], tmp_path / "m", *flags,
                           env={"CKPTTOOL_FAULT": "pwrite:4", "CKPTTOOL_JOURNAL_BYTES": "20000"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    run_cli("convert", dcps["llama"], tmp_path / "m", *flags, "--resume")
    assert {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()} == \
        {p.name: p.read_bytes() for p in (tmp_path / "clean").iterdir()}


# -- what a reader could get wrong, made on purpose in the metadata (pickled here by torch: trusted) ------------

def _tampered(dcps, tmp_path, change) -> object:
    dst = tmp_path / "dcp"
    shutil.copytree(dcps["llama"], dst)
    md = pickle.loads((dst / ".metadata").read_bytes())
    change(md)
    (dst / ".metadata").write_bytes(pickle.dumps(md))
    return dst


def _refused(src, tmp_path, *words) -> str:
    proc = run_cli("convert", src, tmp_path / "out", check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    for word in words:
        assert word in proc.stderr, (word, proc.stderr)
    assert not (tmp_path / "out").exists()
    return proc.stderr


def _split_entry(md):
    """A tensor stored as two chunks, and its storage_data entries."""
    fqn, entry = next((k, v) for k, v in sorted(md.state_dict_metadata.items())
                      if hasattr(v, "chunks") and len(v.chunks) == 2 and k.startswith("model."))
    return fqn, entry


def test_a_chunk_byte_range_off_by_one_is_refused(dcps, tmp_path):
    def shift(md):
        fqn, _ = _split_entry(md)
        index = next(i for i in md.storage_data if i.fqn == fqn)
        info = md.storage_data[index]
        info.offset += 1
    _refused(_tampered(dcps, tmp_path, shift), tmp_path, "chunk", ".distcp")


def test_a_chunk_box_moved_by_one_row_is_refused(dcps, tmp_path):
    """Its second chunk said to start a row early: the chunks overlap, which no reading could make right."""
    def move(md):
        fqn, entry = _split_entry(md)
        chunk = entry.chunks[1]
        dim = next(d for d, o in enumerate(chunk.offsets) if o)
        offsets = list(chunk.offsets)
        offsets[dim] -= 1
        old = next(i for i in md.storage_data if i.fqn == fqn and tuple(i.offset) == tuple(chunk.offsets))
        info = md.storage_data.pop(old)
        chunk.offsets = torch.Size(offsets)
        md.storage_data[type(old)(fqn, torch.Size(offsets), old.index)] = info
    _refused(_tampered(dcps, tmp_path, move), tmp_path, "overlap")


def test_a_chunk_said_transposed_is_refused(dcps, tmp_path):
    """A 2-D chunk's sizes swapped in the metadata (and the tensor's with them): its archive still holds the
    shape it was saved with, so the reader refuses rather than read the bytes in the wrong order."""
    def transpose(md):
        fqn, entry = next((k, v) for k, v in sorted(md.state_dict_metadata.items())
                          if hasattr(v, "chunks") and len(v.chunks) == 1 and len(v.size) == 2 and v.size[0] != v.size[1])
        entry.size = torch.Size(reversed(entry.size))
        entry.chunks[0].sizes = torch.Size(reversed(entry.chunks[0].sizes))
    _refused(_tampered(dcps, tmp_path, transpose), tmp_path, "the metadata says")


def test_a_view_saved_transposed_is_refused(tmp_path):
    """torch saves a transposed view as it is (its strides in the archive): read as rows it would be wrong."""
    import json

    import torch.distributed.checkpoint as dcp

    from dense_models import build_hf

    hf = build_hf("llama", tmp_path / "hf", seed=1)
    sd = _tensors(hf)
    sd["lm_head.weight"] = sd["lm_head.weight"].t().contiguous().t()  # same values, column-major storage
    dcp.save(sd, checkpoint_id=tmp_path / "dcp", no_dist=True)
    (tmp_path / "dcp" / "config.json").write_text(json.dumps(json.loads((hf / "config.json").read_text())))
    _refused(tmp_path / "dcp", tmp_path, "strides", "lm_head.weight", ".contiguous()")


def test_a_hostile_pickle_is_refused_by_name_and_never_run(dcps, tmp_path):
    import os

    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    dst = tmp_path / "dcp"
    shutil.copytree(dcps["llama"], dst)
    (dst / ".metadata").write_bytes(pickle.dumps(Boom()))
    err = _refused(dst, tmp_path, "system", "not a torch.distributed.checkpoint metadata class")
    assert not (tmp_path / "ran").exists(), err
    assert run_cli("inspect", dst, check=False).returncode == 1 and not (tmp_path / "ran").exists()


def test_a_chunk_file_outside_the_directory_is_refused(dcps, tmp_path):
    def escape(md):
        next(iter(md.storage_data.values())).relative_path = "../elsewhere.distcp"
    _refused(_tampered(dcps, tmp_path, escape), tmp_path, "'..'", ".metadata")


def test_a_missing_config_says_where_to_put_it(dcps, tmp_path):
    dst = tmp_path / "dcp"
    shutil.copytree(dcps["llama"], dst)
    (dst / "config.json").unlink()
    _refused(dst, tmp_path, "config.json is missing", "beside .metadata", "--config")


def test_a_config_from_elsewhere_is_read_with_config(dcps, tmp_path):
    """A trainer's DCP directory holds no config.json: --config names the model's, and convert, shard and plan read
    it as if it were beside .metadata (the same bytes); merge and a hub input refuse the flag."""
    dst = tmp_path / "dcp"
    shutil.copytree(dcps["llama"], dst)
    (dst / "config.json").rename(tmp_path / "llama-config.json")
    run_cli("convert", dcps["llama"], tmp_path / "beside", "--mp", 2, "--quiet")
    run_cli("convert", dst, tmp_path / "given", "--mp", 2, "--quiet", "--config", tmp_path / "llama-config.json")
    assert {p.name: p.read_bytes() for p in (tmp_path / "given").iterdir()} == \
        {p.name: p.read_bytes() for p in (tmp_path / "beside").iterdir()}
    assert run_cli("plan", dst, "--config", tmp_path / "llama-config.json").returncode == 0
    hf = tmp_path / "hf-without-config"  # an HF directory reads it the same way
    shutil.copytree(dcps["hf"]["llama"], hf)
    (hf / "config.json").unlink()
    run_cli("convert", hf, tmp_path / "hf-given", "--mp", 2, "--quiet", "--config", tmp_path / "llama-config.json")
    for name in ("model0-mp2.safetensors", "model1-mp2.safetensors", "config.json"):  # its side files differ
        assert (tmp_path / "hf-given" / name).read_bytes() == (tmp_path / "beside" / name).read_bytes(), name
    proc = run_cli("merge", tmp_path / "given", tmp_path / "m", "--config", tmp_path / "llama-config.json",
                   check=False)
    assert proc.returncode == 2 and not (tmp_path / "m").exists(), proc.stderr  # merge has no --config
    proc = run_cli("convert", dst, tmp_path / "bad", "--config", tmp_path / "missing.json", check=False)
    assert proc.returncode == 1 and "config.json is missing" in proc.stderr and "missing.json" in proc.stderr
    assert not (tmp_path / "bad").exists()


def test_manifest_is_written(dcps, tmp_path):
    run_cli("convert", dcps["llama"], tmp_path / "hf", "--quiet")
    assert (tmp_path / "hf" / MANIFEST).is_file()
