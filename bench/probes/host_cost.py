"""What one FP8 block dequant call costs the host, layer by layer, against DeepSeek's `weight_dequant`: on a
small tensor the GPU's time (about 14 us on [7168, 2048] on the H100) is below any launch's, so calls
streamed back to back run at the host's pace. Each row: microseconds of host time per call, the median of
--reps timings of --calls calls enqueued back to back (the GPU drained between timings). Prints JSON lines.

    python bench/probes/host_cost.py --seeds DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import triton

from ckpttool.formats import BY_NAME
from ckpttool.kernels import fp8_triton, nan_flag
from ckpttool.kernels.fp8 import dequant_fp8_block_lazy


def host_us(fn, calls: int, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
    return round(statistics.median(times), 1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", help="directory holding the reference kernel.py")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    rows, cols = 7168, 2048
    x = torch.randint(0, 126, (rows, cols), dtype=torch.uint8).view(torch.float8_e4m3fn).cuda()
    s = (torch.rand(rows // 128, cols // 128) + 0.5).cuda()
    out = torch.empty((rows, cols), dtype=torch.bfloat16, device="cuda")
    bad = nan_flag.claim(x.device, lambda: None)
    grid = (triton.cdiv(rows, 128), triton.cdiv(cols, 128))
    kernel = fp8_triton._dequant_kernel

    def launch_only():
        kernel[grid](x, s, out, bad.flags, bad.slot, bad.tag, rows, cols, s.shape[1], BLOCK=128, WIDE=False,
                     num_warps=fp8_triton.NUM_WARPS)

    def empty_and_launch():
        y = torch.empty((rows, cols), dtype=torch.bfloat16, device=x.device)
        kernel[grid](x, s, y, bad.flags, bad.slot, bad.tag, rows, cols, s.shape[1], BLOCK=128, WIDE=False,
                     num_warps=fp8_triton.NUM_WARPS)

    calls = {
        "launch only": launch_only,
        "torch.empty + launch": empty_and_launch,
        "nan_flag.claim": lambda: nan_flag.claim(x.device, lambda: None),
        "fp8_triton.dequant": lambda: fp8_triton.dequant(x, s, torch.bfloat16, 128),
        "dequant_fp8_block_lazy": lambda: dequant_fp8_block_lazy(x, s),
        "format row .cuda": lambda: BY_NAME["fp8_block"].cuda(x, s, torch.bfloat16),
    }
    if args.seeds:
        sys.path.insert(0, os.path.abspath(args.seeds))
        from kernel import weight_dequant  # DeepSeek's reference kernel, unmodified

        torch.set_default_dtype(torch.bfloat16)
        calls["reference weight_dequant"] = lambda: weight_dequant(x, s)
    for round_ in range(2):
        for name, fn in calls.items():
            print(json.dumps({"round": round_, "call": name, "host_us": host_us(fn, args.calls, args.reps)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
