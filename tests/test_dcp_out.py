"""A torch distributed checkpoint as an output (`convert SRC DST --layout dcp [--mp N]`): what torch's own
`torch.distributed.checkpoint.load` reads into an FSDP2-sharded transformers model in a real gloo program, every
tensor equal to the source, also into another world size than the DCP was cut for (DCP's resharding); read back
by ckpttool byte-identical per tensor; the core install still imports no torch for it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import run_cli
from dcp_builders import torchrun

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

_LOAD = r'''
import json, os, sys
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp, transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from safetensors.torch import load_file

hf, ckpt, out = sys.argv[1:4]
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(1234 + dist.get_rank())  # weights unlike the source: only the load can make them equal
model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(hf),
                                                      torch_dtype=torch.bfloat16)
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
sd = model.state_dict()
dcp.load(sd, checkpoint_id=ckpt)
ref = load_file(f"{hf}/model.safetensors")
full = {k: v.full_tensor() for k, v in model.state_dict().items()}
result = {"sharded": sum(type(v).__name__ == "DTensor" for v in sd.values()), "names": sorted(full),
          "unequal": sorted(k for k in ref if not (full[k].dtype == ref[k].dtype and torch.equal(full[k], ref[k])))}
if dist.get_rank() == 0:
    open(out, "w").write(json.dumps(result))
dist.destroy_process_group()
os._exit(0)  # done: a rank aborting in C++ teardown ("terminate called without an active exception") is not a failure
'''


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from dense_models import build_hf

    return build_hf("llama", tmp_path_factory.mktemp("dcp_out") / "hf", seed=7)


@pytest.mark.parametrize("mp,world", [(2, 2), (3, 2), (None, 2)])
def test_torch_loads_it_into_an_fsdp2_model(llama, tmp_path, mp, world):
    """Cut for `mp` ranks (None: one chunk each), loaded by `world` ranks: every tensor equal to the source."""
    run_cli("convert", llama, tmp_path / "dcp", "--layout", "dcp", *(("--mp", mp) if mp else ()), "--quiet")
    files = sorted(p.name for p in (tmp_path / "dcp").iterdir())
    assert ".metadata" in files and [f for f in files if f.endswith(".distcp")] == [
        f"__{r}_0.distcp" for r in range(mp or 1)]
    script = tmp_path / "load.py"
    script.write_text(_LOAD)
    torchrun([str(script), str(llama), str(tmp_path / "dcp"), str(tmp_path / "out.json")], world)
    result = json.loads((tmp_path / "out.json").read_text())
    ref = load_file(llama / "model.safetensors")
    assert result["unequal"] == [] and set(ref) == set(result["names"]) and result["sharded"] == len(ref)


@pytest.mark.parametrize("mp", [None, 3])
def test_read_back_byte_identical_and_checked(llama, tmp_path, mp):
    run_cli("convert", llama, tmp_path / "dcp", "--layout", "dcp", *(("--mp", mp) if mp else ()), "--quiet")
    assert run_cli("inspect", tmp_path / "dcp", "--check").returncode == 0
    run_cli("convert", tmp_path / "dcp", tmp_path / "hf", "--quiet")
    ours, ref = load_file(tmp_path / "hf" / "model.safetensors"), load_file(llama / "model.safetensors")
    assert sorted(ours) == sorted(ref)
    for name, t in ref.items():
        assert ours[name].dtype == t.dtype and ours[name].view(torch.uint8).equal(t.view(torch.uint8)), name


def test_chunks_are_dim0_cuts_as_fsdp2_makes_them(llama, tmp_path):
    """torch.chunk's sizes: ceil(rows / N) each, the last rank fewer (a 64-row norm weight over 3 ranks: 22, 22, 20)."""
    import pickle

    run_cli("convert", llama, tmp_path / "dcp", "--layout", "dcp", "--mp", 3, "--quiet")
    md = pickle.loads((tmp_path / "dcp" / ".metadata").read_bytes())
    norm = md.state_dict_metadata["model.norm.weight"]
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in norm.chunks] == [((0,), (22,)), ((22,), (22,)), ((44,), (20,))]


def test_reading_and_planning_import_no_torch(llama, tmp_path):
    """The layouts table, reading a DCP and converting it to HF stay torch-free; only writing .metadata needs it."""
    run_cli("convert", llama, tmp_path / "dcp", "--layout", "dcp", "--mp", 2, "--quiet")
    code = ("import sys; from ckpttool.cli import main; code = main(['convert', sys.argv[1], sys.argv[2], '--quiet']);"
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "dcp"), str(tmp_path / "hf")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("point", ["pwrite:3", "publish:2"])
def test_killed_then_resumed_is_byte_identical(llama, tmp_path, point):
    """The chunks' framing is written with each file, the rows by the executor: a run killed mid-write or while
    publishing and resumed writes what an uninterrupted one does, .metadata included."""
    import signal

    from conftest import run_cli_process

    flags = ("--layout", "dcp", "--mp", "2", "--quiet", "--workers", "2", "--processes", "1")
    run_cli("convert", llama, tmp_path / "clean", *flags)
    proc = run_cli_process("convert", llama, tmp_path / "m", *flags,
                           env={"CKPTTOOL_FAULT": point, "CKPTTOOL_JOURNAL_BYTES": "20000"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    run_cli("convert", llama, tmp_path / "m", *flags, "--resume")
    assert {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()} == \
        {p.name: p.read_bytes() for p in (tmp_path / "clean").iterdir()}
