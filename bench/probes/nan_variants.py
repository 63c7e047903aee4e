"""Ways to refuse NaN codes inside the Triton FP8 block dequant, against DeepSeek's `weight_dequant` (no NaN
check at all): the kernel alone, replayed from a CUDA graph, and streamed, on a small and a large tensor,
variants interleaved in rounds. Each variant writes the same bits; the ones that record a NaN row are
checked to name the right one. Prints one JSON line per (round, variant, shape).

    python bench/probes/nan_variants.py --seeds DIR [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # bench/: the benchmarks
from quant_bench import cuda_call_times  # noqa: E402

from ckpttool.kernels import fp8_triton, nan_flag

SHAPES = {"small": (7168, 2048), "large": (7168, 18432)}


@triton.jit(do_not_specialize=["slot", "tag"])
def _variant(x_ptr, s_ptr, y_ptr, bad_ptr, slot, tag, M, N, S_COLS, BLOCK: tl.constexpr, HOW: tl.constexpr):
    pid_m = tl.program_id(axis=0)
    pid_n = tl.program_id(axis=1)
    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    offs_n = pid_n * BLOCK + tl.arange(0, BLOCK)
    offs = offs_m[:, None] * N + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if HOW == 5:  # the codes' bits: e4m3fn's NaN is magnitude 0x7F
        c = tl.load(x_ptr.to(tl.pointer_type(tl.uint8)) + offs, mask=mask)
        x = c.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        nan = ((c & 0x7F) == 0x7F) & mask
    else:
        x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
        nan = (x != x) & mask
    s = tl.load(s_ptr + pid_m * S_COLS + pid_n)
    if HOW == 1 or HOW == 5:  # every lane: an int64 per element, predicated atomics (today's)
        rows = offs_m[:, None].to(tl.int64) + tl.zeros([BLOCK, BLOCK], dtype=tl.int64)
        tl.atomic_max(bad_ptr + slot + tl.zeros([BLOCK, BLOCK], dtype=tl.int32), tag - rows, mask=nan)
    if HOW == 2:  # per row: a reduction along the row, then one predicated atomic per row
        hit = tl.max(nan.to(tl.int32), axis=1)
        tl.atomic_max(bad_ptr + slot + tl.zeros([BLOCK], dtype=tl.int32), tag - offs_m.to(tl.int64), mask=hit > 0)
    if HOW == 3:  # per tile: a reduction to one flag, then today's atomics only where it is set
        if tl.max(tl.max(nan.to(tl.int32), axis=1), axis=0) > 0:
            rows = offs_m[:, None].to(tl.int64) + tl.zeros([BLOCK, BLOCK], dtype=tl.int64)
            tl.atomic_max(bad_ptr + slot + tl.zeros([BLOCK, BLOCK], dtype=tl.int32), tag - rows, mask=nan)
    if HOW == 4:  # int32 cells (needs a fill per call, not timed here): what int64 costs
        rows32 = offs_m[:, None] + tl.zeros([BLOCK, BLOCK], dtype=tl.int32)
        tl.atomic_min(bad_ptr.to(tl.pointer_type(tl.int32)) + tl.zeros([BLOCK, BLOCK], dtype=tl.int32), rows32, mask=nan)
    tl.store(y_ptr + offs, (x * s).to(y_ptr.dtype.element_ty), mask=mask)


VARIANTS = {"none": 0, "elem64": 1, "row64": 2, "tile_if": 3, "elem32": 4, "codes": 5}


def call_of(how: int, warps: int):
    def call(x, s):
        rows, cols = x.shape
        y = torch.empty((rows, cols), dtype=torch.bfloat16, device=x.device)
        bad = nan_flag.claim(x.device, lambda: None)
        _variant[(triton.cdiv(rows, 128), triton.cdiv(cols, 128))](
            x, s, y, bad.flags, bad.slot, bad.tag, rows, cols, s.shape[1], BLOCK=128, HOW=how, num_warps=warps)
        return y, bad
    return call


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", help="directory holding the reference kernel.py")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warps", default="4,8")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    data = {}
    for shape, (rows, cols) in SHAPES.items():
        x = torch.randint(0, 256, (rows, cols), dtype=torch.int32, generator=gen).to(torch.uint8)
        x[(x & 0x7F) == 0x7F] ^= 1
        s = torch.rand(-(-rows // 128), -(-cols // 128), generator=gen) * 1e-3 + 1e-4
        data[shape] = (x.view(torch.float8_e4m3fn).cuda(), s.cuda())
    calls = {f"{name}-w{w}": call_of(how, int(w)) for name, how in VARIANTS.items() for w in args.warps.split(",")}
    calls["today"] = lambda x, s: fp8_triton.dequant(x, s, torch.bfloat16, 128)
    if args.seeds:
        sys.path.insert(0, os.path.abspath(args.seeds))
        from kernel import weight_dequant  # DeepSeek's reference kernel, unmodified

        def reference(x, s):
            torch.set_default_dtype(torch.bfloat16)
            try:
                return weight_dequant(x, s), None
            finally:
                torch.set_default_dtype(torch.float32)
        calls["reference"] = reference
    # bits, and the NaN row where one is planted
    want = {shape: calls["today"](*d)[0].view(torch.int16) for shape, d in data.items()}
    x_bad = data["small"][0].view(torch.uint8).clone()
    x_bad[4000, 77], x_bad[300, 5] = 0x7F, 0xFF
    for name, fn in calls.items():
        same = all(torch.equal(fn(*d)[0].view(torch.int16), want[shape]) for shape, d in data.items())
        row = None
        if name not in ("reference",) and not name.startswith(("none", "elem32")):
            row = fn(x_bad.view(torch.float8_e4m3fn), data["small"][1])[1].row()
        print(json.dumps({"variant": name, "same_bits": same, "nan_row": row}), flush=True)
    for r in range(args.rounds):
        for name, fn in calls.items():
            for shape, (x, s) in data.items():
                t = cuda_call_times(lambda fn=fn, x=x, s=s: fn(x, s))
                gb = x.numel() * 2 / 1e9
                print(json.dumps({"round": r, "variant": name, "shape": shape,
                                  "graph_gb_s": round(gb / t["graph"], 1), "streamed_gb_s": round(gb / t["streamed"], 1),
                                  "host_us": round(t["host"] * 1e6, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
