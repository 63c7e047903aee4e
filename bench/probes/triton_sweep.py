"""Tile shapes of the Triton dequant kernels, measured (issue 16: tune before choosing).

For each kernel and each candidate tile (rows x values per program, warps), on a large and a small BF16
output ([7168, 18432] and [7168, 2048], the shapes of bench/quant_bench.py): bandwidth per output byte
streamed (20 calls queued back to back between two CUDA events, so the host's launch cost hides behind
the GPU, as it does in the executor with one stream per worker) and per call (median of single calls,
each between its own events). Every tile's bytes are compared with the CPU path's (small shape) and with
the default tile's (large shape). The FP8 block kernel is also timed with 64-bit offsets forced, and
DeepSeek's reference `weight_dequant` beside it when --seeds names its directory. Prints JSON lines.

    python bench/probes/triton_sweep.py [--seeds DIR] [--only int4,fp8_rows,nvfp4,nvfp4_modelopt,fp8_block]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # bench/: the benchmarks
from kernel_bench import time_cuda  # noqa: E402
from quant_bench import carrier, chunk, inputs

from ckpttool.formats import BY_NAME
from ckpttool.kernels import fp8_triton, nan_flag, nvfp4_triton, scaled_triton
from ckpttool.kernels.scaled_triton import Tile

SHAPES = {"large": (7168, 18432), "small": (7168, 2048)}
FORMAT = {"int4": "ct_int4_g32", "fp8_rows": "ct_fp8_channel", "nvfp4": "ct_nvfp4", "nvfp4_modelopt": "modelopt_nvfp4",
          "fp8_block": "fp8_block"}
GRID = [Tile(r, c, w) for r, c, w in itertools.product((2, 4, 8), (256, 512, 1024), (2, 4, 8))]


def streamed(fn) -> float:
    """Seconds per call with 20 calls queued back to back (median of 5)."""
    return time_cuda(fn, 5, calls=20, warmup=1)


def rates(row: dict, shape: str, sets: list, call) -> None:
    """GB/s of output, streamed and per call, alternating the two input sets."""
    state = {"i": 0}

    def rotating():
        _, _, _, xc, sc = sets[state["i"] % 2]
        state["i"] += 1
        return call(xc, sc)

    rows, cols = SHAPES[shape]
    row[f"{shape}_out_gbps_streamed"] = round(rows * cols * 2 / streamed(rotating) / 1e9, 1)
    row[f"{shape}_out_gbps_per_call"] = round(rows * cols * 2 / time_cuda(rotating, 30) / 1e9, 1)


def set_tile(kernel: str, tile: Tile) -> None:
    if kernel.startswith("nvfp4"):  # one tile for both spellings
        nvfp4_triton.TILE = tile
    else:
        scaled_triton.TILES[kernel] = tile


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", help="directory holding the reference kernel.py")
    p.add_argument("--only", default="int4,fp8_rows,nvfp4,fp8_block")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    out = torch.bfloat16
    for kernel in args.only.split(","):
        fmt = BY_NAME[FORMAT[kernel]]
        g = 2688.0 / 3.1 if kernel == "nvfp4" else 3.1 / 2688.0
        data, want = {}, {}
        for shape, (rows, cols) in SHAPES.items():
            sets = []
            for _ in range(2):  # two input sets, alternated: each larger than L2 on the large shape
                x, s, dtype = inputs(FORMAT[kernel], rows, cols, gen)
                if kernel == "fp8_block":
                    s = s.float()
                sets.append((x, s, dtype, x.cuda(), s.cuda()))
            data[shape] = sets
            x, s, dtype, _, _ = sets[0]
            if shape == "small":
                want[shape] = torch.from_numpy(fmt.cpu(chunk(FORMAT[kernel], carrier(x), carrier(s), dtype, g), "BF16", None).view("int16"))
        default = (scaled_triton.TILES.get(kernel) if not kernel.startswith("nvfp4") else nvfp4_triton.TILE)
        if kernel == "fp8_block":
            candidates = [("tile", w, wide) for w in (2, 4, 8, 16) for wide in (False, True)]
        else:
            candidates = [("tile", t, None) for t in GRID]
        for _, cfg, wide in candidates:
            if kernel == "fp8_block":
                def call(x, s, cfg=cfg, wide=wide):
                    rows, cols = x.shape
                    y = torch.empty((rows, cols), dtype=out, device=x.device)
                    bad = nan_flag.claim(x.device, lambda: None)
                    fp8_triton._dequant_kernel[(triton.cdiv(rows, 128), triton.cdiv(cols, 128))](
                        x, s, y, bad.flags, bad.slot, bad.tag, rows, cols, s.shape[1], BLOCK=128, WIDE=wide,
                        num_warps=cfg)
                    return y, bad
            else:
                set_tile(kernel, cfg)

                def call(x, s):
                    return fmt.cuda(chunk(FORMAT[kernel], x, s, dtype, g), out)
            row = {"kernel": kernel, "config": list(cfg) if kernel != "fp8_block" else {"warps": cfg, "wide": wide},
                   "default": cfg == default if kernel != "fp8_block" else (cfg == fp8_triton.NUM_WARPS and not wide)}
            try:
                for shape, sets in data.items():
                    y = call(sets[0][3], sets[0][4])[0].view(torch.int16).cpu()
                    if shape == "large" and "large" not in want:
                        want["large"] = y  # the first candidate's; the small shape checks it against the CPU
                    row[f"{shape}_same_bits"] = bool(torch.equal(y, want[shape]))
                    rates(row, shape, sets, call)
            except Exception as exc:  # a tile that does not compile or run is a result, not a stop
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            print(json.dumps(row), flush=True)
        if kernel != "fp8_block":
            set_tile(kernel, default)
        elif args.seeds:
            sys.path.insert(0, os.path.abspath(args.seeds))
            from kernel import weight_dequant  # DeepSeek's reference kernel, unmodified

            torch.set_default_dtype(torch.bfloat16)
            try:
                row = {"kernel": "reference weight_dequant"}
                for shape, sets in data.items():
                    rates(row, shape, sets, weight_dequant)
            finally:
                torch.set_default_dtype(torch.float32)
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
