"""The CUDA path's steady rate, start-up excluded (issue 17: what `--device auto` should weigh).

`convert SRC DST --mp N --dtype bf16 --device cuda` in this process with every chunk waiting for CUDA
(`wait_for_cuda`, as the GPU tests force it): the wall time, CUDA's start-up (import torch, context,
kernels) and the rest, which is the GPU path's rate once started. Prints one JSON object.

    python bench/probes/gpu_steady.py SRC DST [--mp 8] [--workers N]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from ckpttool.plan.build import Spec
from ckpttool.runner import ExecOptions, convert


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--mp", type=int, default=8)
    p.add_argument("--workers", type=int, default=0, help="0: the default")
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    shutil.rmtree(a.dst, ignore_errors=True)
    opts = ExecOptions(quiet=True, device=a.device, wait_for_cuda=True, **({"workers": a.workers} if a.workers else {}))
    t = time.perf_counter()
    result = convert(a.src, a.dst, Spec(dequant=True, mp=a.mp), opts)
    wall = time.perf_counter() - t
    timing = result.timings.to_json()
    start = timing.get("thread_s", {}).get("cuda_start", timing.get("phases_s", {}).get("cuda_start", 0.0))
    out = sum(f.stat().st_size for f in a.dst.iterdir())
    print(json.dumps({"wall_s": round(wall, 2), "cuda_start_s": round(start, 2), "gb_out": round(out / 1e9, 2),
                      "gbps_after_start": round(out / 1e9 / max(wall - start, 1e-9), 2), "workers": opts.workers,
                      "timing": timing}))
    shutil.rmtree(a.dst, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
