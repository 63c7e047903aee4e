"""DCP -> HF safetensors: ckpttool's streaming convert against torch's way (dcp_to_torch_save, torch.load, then
safetensors' save_file), in the same run, alternating, each a fresh process (imports included). The DCP is
written by torch itself from a 2-rank gloo group (every tensor a DTensor cut on dim 0, as FSDP2 saves) for a
Llama-shaped model of random BF16 weights; both outputs are checked equal tensor by tensor.

    python bench/dcp_bench.py [--hidden 1024] [--layers 8] [--rounds 2] [--dir /tmp/dcp-bench]

Prints one JSON line per run (seconds, peak RSS of the converting process) and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

SAVE = r'''
import json, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp, transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
config = transformers.AutoConfig.from_pretrained(sys.argv[1])
with torch.device("meta"):
    shapes = {k: v.shape for k, v in transformers.AutoModelForCausalLM.from_config(config).state_dict().items()}
torch.manual_seed(0)
sd = {k: distribute_tensor(torch.randn(s, dtype=torch.bfloat16), mesh, [Shard(0)]) for k, s in sorted(shapes.items())}
dcp.save({"model": sd}, checkpoint_id=sys.argv[1])
'''
TORCH_WAY = r'''
import resource, sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from safetensors.torch import save_file
src, dst = sys.argv[1], sys.argv[2]
dcp_to_torch_save(src, dst + "/state.pt")
state = torch.load(dst + "/state.pt", weights_only=True)["model"]
save_file({k: v.contiguous() for k, v in state.items()}, dst + "/model.safetensors", metadata={"format": "pt"})
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
'''
OURS = r'''
import resource, sys
from ckpttool.cli import main
code = main(["convert", sys.argv[1], sys.argv[2], "--quiet"])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
sys.exit(code)
'''


def _timed(code: str, *args: str) -> tuple[float, int]:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return time.perf_counter() - t, int(proc.stdout.split()[-1]) * 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/dcp-bench")
    a = ap.parse_args()
    import transformers

    root = Path(a.dir)
    shutil.rmtree(root, ignore_errors=True)
    src = root / "dcp"
    src.mkdir(parents=True)
    transformers.LlamaConfig(hidden_size=a.hidden, intermediate_size=a.hidden * 11 // 4, num_hidden_layers=a.layers,
                             num_attention_heads=a.hidden // 64, num_key_value_heads=a.hidden // 64, vocab_size=32000,
                             tie_word_embeddings=False).save_pretrained(src)
    (root / "save.py").write_text(SAVE)
    for attempt in range(3):  # torch's own writer failed now and then on the loaded 2-core box ("unexpected pos")
        saved = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                str(root / "save.py"), str(src)], capture_output=True, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
        if saved.returncode == 0:
            break
        print(json.dumps({"dcp_save_failed": attempt, "error": saved.stderr[-300:]}), flush=True)
    else:
        raise SystemExit("torch could not save the DCP")
    size = sum(p.stat().st_size for p in src.glob("*.distcp"))
    runs: dict[str, list[float]] = {"ckpttool": [], "torch": []}
    for r in range(a.rounds):
        for name, code in (("ckpttool", OURS), ("torch", TORCH_WAY)):
            out = root / f"{name}-{r}"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir() if name == "torch" else None
            seconds, rss = _timed(code, str(src), str(out))
            runs[name].append(seconds)
            if r:  # round 0's outputs are compared below; later ones only cost disk
                shutil.rmtree(out)
            else:
                (out / "state.pt").unlink(missing_ok=True)
            print(json.dumps({"run": name, "round": r, "seconds": round(seconds, 2), "peak_rss_mb": rss >> 20,
                              "dcp_mb": size >> 20}), flush=True)
    from safetensors.torch import load_file

    ours, theirs = load_file(root / "ckpttool-0" / "model.safetensors"), load_file(root / "torch-0" / "model.safetensors")
    assert sorted(ours) == sorted(theirs) and all(ours[k].equal(theirs[k]) for k in ours), "outputs differ"
    med = {k: sorted(v)[len(v) // 2] for k, v in runs.items()}
    print(json.dumps({"median_s": med, "torch_over_ckpttool": round(med["torch"] / med["ckpttool"], 2),
                      "outputs_equal": True}))
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
