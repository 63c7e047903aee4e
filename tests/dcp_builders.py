"""Torch distributed checkpoints written by torch itself, for tests: an HF checkpoint's tensors saved by
`torch.distributed.checkpoint.save` from a real gloo process group of `world` ranks, each tensor a DTensor cut the
way FSDP2 (dim 0) or tensor parallelism (dim 1) cuts it, under a `model.` prefix beside optimizer-like state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_RANK = r'''
import json, os, sys
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, Replicate, distribute_tensor
from safetensors.torch import load_file

src, dst, how = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
dist.init_process_group("gloo")
world = dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
sd = {}
for f in sorted(os.listdir(src)):
    if f.endswith(".safetensors"):
        sd.update(load_file(os.path.join(src, f)))
out, optim = {}, {}
for i, (name, t) in enumerate(sorted(sd.items())):
    dim = how["dims"][i % len(how["dims"])]
    placement = Replicate() if dim is None or t.dim() <= dim else Shard(dim)
    out[name] = distribute_tensor(t, mesh, [placement])
    if how.get("optim"):
        optim[f"state.{name}.exp_avg"] = distribute_tensor(torch.zeros(t.shape, dtype=torch.float32), mesh, [placement])
state = {how.get("prefix", "model"): out} if how.get("prefix", "model") else dict(out)
if how.get("optim"):
    state["optim"] = optim
    state["step"] = 7
dcp.save(state, checkpoint_id=dst)
dist.destroy_process_group()
os._exit(0)  # done: a rank aborting in C++ teardown ("terminate called without an active exception") is not a failure
'''


def torchrun(args: list[str], world: int) -> None:
    """`args` run as `world` gloo ranks by torchrun. A launch whose rank died by SIGABRT before doing anything
    (seen a few times on the loaded 2-core box: "terminate called without an active exception" in C++ teardown after the work, which the ranks now skip with os._exit) is run
    once more; any other failure, or a second one, fails the test with both ends of the ranks' output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for attempt in (1, 2):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if proc.returncode == 0 or attempt == 2 or "SIGABRT" not in proc.stderr:
            break
    assert proc.returncode == 0, proc.stderr[:3000] + "\n...\n" + proc.stderr[-3000:]


def save_dcp(hf: Path, dst: Path, *, world: int = 2, dims=(0, 1, None), prefix: str = "model",
             optim: bool = True) -> Path:
    """`hf`'s tensors as a DCP at `dst` (config.json copied beside it), tensor i cut along dims[i % len(dims)]
    (None: replicated) over `world` gloo ranks."""
    script = dst.parent / f"_save_{dst.name}.py"
    script.write_text(_RANK)
    how = json.dumps({"dims": list(dims), "prefix": prefix, "optim": optim})
    torchrun([str(script), str(hf), str(dst), how], world)
    (dst / "config.json").write_bytes((hf / "config.json").read_bytes())
    return dst
