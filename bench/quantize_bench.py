"""The quantize stage's CPU rate per output byte, each --to format against DeepSeek's FP8 blocks (today's
`fp8_block`, now `fp8-block-deepseek`) in the same run, and the exact MXFP4 -> FP8 repack.

Each format quantizes one random BF16 weight ([2048, 2048] by default) the way the executor does: every output
tensor is its own task (formats/outputs.py rows; each recomputes the format from the weight's rows it reads, so
a format with more outputs pays for them), streamed rows through their row kernel on one chunk, whole-tensor rows
(gpt-fast int4's scales) through QUANTIZE_TRANSFORMS. One thread (torch.set_num_threads(1): the executor runs one
such call per worker), timed by that thread's CPU time (time.thread_time: what the shared machine's other load
does not inflate), formats interleaved in --reps rounds so the load hits them alike, the median per format.
`vs_fp8_block_deepseek` is each format's rate per output byte over FP8 block's in the same run. The formats with C
loops (kernels/native/quant.c) run once more with CKPTTOOL_NATIVE=0, as "FORMAT (torch)": the loops' gain in the
same run. The repack is timed as one call of its loop and as the executor runs it (the codes row and the scale row,
each over the whole weight). Prints one JSON object.

    python bench/quantize_bench.py [--rows 2048 --cols 2048] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np
import torch

from ckpttool.formats import BY_NAME, QUANTIZE_TRANSFORMS, Chunk
from ckpttool.formats.outputs import FORMATS, target
from ckpttool.kernels import repack


def _runner(fmt: str, w: torch.Tensor, plain: bool = False):
    """A callable doing one weight's every output task, and the output bytes it writes (plain: without C loops)."""
    row = target(fmt)
    rows, cols = w.shape
    values = w.view(torch.int16).numpy().view(np.uint16)
    calls, nbytes = [], 0
    if row.prepass is not None:  # NVFP4's first pass (the weight's amax), once a weight as the executor runs it
        first = BY_NAME[row.outputs[0].transform_for(rows, cols)]
        calls.append(lambda: first.prepass(Chunk(values, "BF16")))
    for o in row.outputs:
        name = o.transform_for(rows, cols)
        shape = o.shape(rows, cols)
        itemsize = {"I32": 4, "I64": 8, "U8": 1, "I8": 1, "F8_E4M3": 1, "F32": 4, "BF16": 2, None: 2}[o.dtype]
        nbytes += int(np.prod(shape)) * itemsize
        if name in QUANTIZE_TRANSFORMS:
            calls.append(lambda fn=QUANTIZE_TRANSFORMS[name]: fn(w))
        else:
            kernel = BY_NAME[name]
            calls.append(lambda k=kernel: k.cpu(Chunk(values, "BF16"), o.dtype or "BF16", None))
    if not plain:
        return (lambda: [c() for c in calls]), nbytes

    def run():
        os.environ["CKPTTOOL_NATIVE"] = "0"
        try:
            [c() for c in calls]
        finally:
            del os.environ["CKPTTOOL_NATIVE"]
    return run, nbytes


def _without_c(run) -> None:
    os.environ["CKPTTOOL_NATIVE"] = "0"
    try:
        run()
    finally:
        del os.environ["CKPTTOOL_NATIVE"]


NATIVE = ("w4a16", "w4a16-asym", "w8a16", "nvfp4a16", "mxfp4")
"""the formats with C loops (kernels/quant_native.py)"""


def _repack_runner(rows: int, cols: int):
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    e8m0 = rng.integers(118, 126, (rows, cols // 32), dtype=np.uint8)

    def run():
        repack.mxfp4_to_fp8(packed, e8m0, (128, 128))  # the C loop where built (formats/repack.py's path)
    return run, rows * cols + (-(-rows // 128)) * (-(-cols // 128))


def _repack_rows_runner(rows: int, cols: int):
    """The repack as the executor runs it: the codes row and the scale row (formats/repack.py), each a task of its
    own over the whole weight (the scale row checks every value to name a refused block by its place)."""
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8).view(np.int8)
    e8m0 = rng.integers(118, 126, (rows, cols // 32), dtype=np.uint8)
    codes = BY_NAME["repack:codes:128x128:mxfp4_experts:scale"]
    scale = BY_NAME["repack:scale:128x128:mxfp4_experts:scale@bench"]

    def run():
        chunk = Chunk(packed, "I8", {"scale": e8m0}, {"scale": "U8"})
        codes.cpu(chunk, "F8_E4M3", None)
        scale.cpu(chunk, "U8", None)
    return run, rows * cols + (-(-rows // 128)) * (-(-cols // 128))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    w = (torch.randn(args.rows, args.cols, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    names = [f for f in FORMATS if f != "fp8_block" and not target(f).repack_only]  # the alias, repack-only rows
    jobs = {f: _runner(f, w) for f in names}
    jobs.update({f"{f} (torch)": _runner(f, w, plain=True) for f in NATIVE})
    jobs["repack mxfp4 -> fp8 128x128"] = _repack_runner(args.rows, args.cols)
    repack_run, nbytes = _repack_runner(args.rows, args.cols)
    jobs["repack mxfp4 -> fp8 128x128 (numpy)"] = (lambda r=repack_run: _without_c(r)), nbytes
    jobs["repack rows (codes + scale) mxfp4 -> fp8 128x128"] = _repack_rows_runner(args.rows, args.cols)
    times: dict[str, list[float]] = {k: [] for k in jobs}
    for _ in range(args.reps):
        for k, (run, _) in jobs.items():
            t0 = time.thread_time()
            run()
            times[k].append(time.thread_time() - t0)
    base = jobs["fp8-block-deepseek"][1] / statistics.median(times["fp8-block-deepseek"])
    out = {}
    for k, (_, nbytes) in jobs.items():
        s = statistics.median(times[k])
        out[k] = {"s": round(s, 4), "output_bytes": nbytes, "mb_per_s_output": round(nbytes / s / 1e6, 1),
                  "vs_fp8_block_deepseek": round(nbytes / s / base, 3)}
    print(json.dumps({"weight": [args.rows, args.cols], "reps": args.reps, "threads": 1, "clock": "thread_time",
                      "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "torch": torch.__version__,
                      "formats": out}, indent=1))


if __name__ == "__main__":
    main()
