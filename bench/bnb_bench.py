"""bitsandbytes' CPU dequant (formats/bnb.py) against FP8 block's (formats.FP8_BLOCK), in one run on one machine.

Every row dequantizes a weight of the same output shape ([7168, 2048] BF16 by default) from random codes and
scales, so the rates compare per output byte: FP8 128x128 blocks, bitsandbytes NF4 and FP4 in blocks of 64 (with
and without double quant) and LLM.int8(). Each timing is what a worker does with one chunk: the side checks the
executor runs (row.bad_row on each side, the row's check_sides) and the row's CPU kernel, writing into a reused
buffer (`--into`, as the executor does) or a fresh one. One thread; rows interleaved in --reps rounds, the median
of each; the first round warms caches and is not counted. Prints one JSON object with each row's ratio to FP8 block.
CKPTTOOL_SIMD=0 or 1 caps bnb.c's instruction sets (portable loops, SSSE3; default AVX2 where the CPU has it).

    python bench/bnb_bench.py [--rows 7168 --cols 2048] [--reps 9] [--into]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np

from ckpttool.formats import BY_NAME, FP8_BLOCK, Chunk
from ckpttool.formats.row import BY_ROWS, WHOLE, bad_row
from ckpttool.kernels import fp8_gather, native


def fp8_chunk(rows: int, cols: int, rng: np.random.Generator) -> Chunk:
    codes = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] ^= 1  # no NaN codes
    scale = (rng.random((-(-rows // 128), -(-cols // 128)), dtype=np.float32) * 1e-3 + 1e-4).astype(np.float32)
    return Chunk(codes, "F8_E4M3", {"scale": scale}, {"scale": "F32"})


def bnb4_chunk(name: str, rows: int, cols: int, rng: np.random.Generator) -> Chunk:
    row = BY_NAME[name]
    n, bs = rows * cols, int(name.split(":")[2])
    packed = rng.integers(0, 256, (n // 2, 1), dtype=np.uint8)
    blocks = -(-n // bs)
    if row.side("scale").dtypes == ("U8",):  # double quant: 8-bit absmax codes, fp32 nested absmax per 256
        nbs = int(name.split(":")[4])
        sides = {"scale": rng.integers(0, 256, blocks, dtype=np.uint8),
                 "nested_scale": (rng.random(-(-blocks // nbs), dtype=np.float32) * 0.1).astype(np.float32),
                 "nested_map": np.linspace(-1, 1, 256, dtype=np.float32)}
        return Chunk(packed, "U8", sides, {"scale": "U8", "nested_scale": "F32", "nested_map": "F32"})
    return Chunk(packed, "U8", {"scale": (rng.random(blocks, dtype=np.float32) * 0.1).astype(np.float32)},
                 {"scale": "F32"})


def int8_chunk(rows: int, cols: int, rng: np.random.Generator) -> Chunk:
    return Chunk(rng.integers(-128, 128, (rows, cols), dtype=np.int8), "I8",
                 {"scale": (rng.random(rows, dtype=np.float32) * 3).astype(np.float32)}, {"scale": "F32"})


def work(row, chunk: Chunk, into: np.ndarray | None) -> None:
    """What a worker does with a chunk once it is read: check each side, check them together, dequantize."""
    for side in row.sides:
        if side.read in (WHOLE, BY_ROWS) and side.role in chunk.sides:
            assert bad_row(side, chunk.sides[side.role], chunk.side_dtypes[side.role]) is None
    assert row.check_sides(chunk.sides) is None
    row.cpu(chunk, "BF16", into)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=7168)
    p.add_argument("--cols", type=int, default=2048)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--into", action="store_true", help="write into one reused buffer, as the executor's workers do")
    args = p.parse_args()
    rows, cols = args.rows, args.cols
    rng = np.random.default_rng(0)
    shape = f"{rows}x{cols}"
    cases = {"fp8_block": (FP8_BLOCK, fp8_chunk(rows, cols, rng)),
             "bnb_int8": (BY_NAME["bnb_int8"], int8_chunk(rows, cols, rng))}
    for name in (f"bnb4:nf4:64:{shape}", f"bnb4:fp4:64:{shape}", f"bnb4:nf4:64:{shape}:256:3e000000"):
        cases[name] = (BY_NAME[name], bnb4_chunk(name, rows, cols, rng))
    into = np.empty(rows * cols * 2, dtype=np.uint8) if args.into else None
    times: dict[str, list[float]] = {n: [] for n in cases}
    for rep in range(args.reps + 1):
        for n, (row, chunk) in cases.items():
            t0 = time.perf_counter()
            work(row, chunk, into)
            if rep:
                times[n].append(time.perf_counter() - t0)
    out_bytes = rows * cols * 2
    base = statistics.median(times["fp8_block"])
    result = {"shape": [rows, cols], "out_dtype": "BF16", "into": args.into, "loops": fp8_gather.cpu_loops(),
              "simd": native.simd() if native.library() is not None else None,
              "machine": platform.processor() or platform.machine(), "reps": args.reps, "rows": {}}
    for n, t in times.items():
        sec = statistics.median(t)
        result["rows"][n] = {"seconds": round(sec, 5), "gb_out_per_s": round(out_bytes / sec / 1e9, 3),
                             "vs_fp8_block": round(base / sec, 3),
                             "spread": [round(min(t), 5), round(max(t), 5)]}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
