"""FP8 128x128 block dequant microbenchmark: achieved memory bandwidth vs the device's.

Times ckpttool.kernels.fp8.dequant_fp8_block on a [7168, 18432] FP8 weight (V3's dense
down_proj transposed: the largest FP8 matrix of the model) on CUDA (Triton), and for context the
reference kernel.weight_dequant (if --seeds is given) and the CPU path. Bytes moved = FP8 read +
scales read + BF16 written. Prints one JSON object.

    python bench/kernel_bench.py [--seeds DIR] [--rows 7168 --cols 18432] [--cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from ckpttool.kernels.fp8 import dequant_fp8_block

# datasheet HBM bandwidth (bytes/s) by device-name substring, used when torch cannot say
PEAK_BY_NAME = [("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("H800", 3.35e12), ("GH200", 4.0e12),
                ("A100-SXM4-80GB", 2.039e12), ("A100", 1.555e12), ("L40S", 0.864e12), ("L4", 0.3e12),
                ("B200", 8.0e12)]


def random_fp8(rows: int, cols: int, device: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    raw = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=gen)
    raw[(raw & 0x7F) == 0x7F] ^= 1  # no NaN encodings
    scale = torch.exp(torch.empty(-(-rows // 128), -(-cols // 128)).uniform_(-11.5, -4.6, generator=gen))
    return raw.view(torch.float8_e4m3fn).to(device), scale.to(device)


def peak_bandwidth(props, name: str) -> tuple[float | None, str]:
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    table = next((bw for key, bw in PEAK_BY_NAME if key in name), None)
    if table is not None:
        return table, "datasheet"
    if clock_khz and bus_bits:  # double data rate
        return 2 * clock_khz * 1e3 * bus_bits / 8, "clock x bus width"
    return None, "unknown"


def time_cuda(fn, reps: int, calls: int = 1, warmup: int = 3) -> float:
    """Median seconds per call, CUDA events, after warm-up: each of reps timings spans `calls` calls
    queued back to back (calls > 1 hides the host's launch cost behind the GPU)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    times.sort()
    return times[len(times) // 2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=7168)
    p.add_argument("--cols", type=int, default=18432)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--seeds", help="directory holding the reference kernel.py, to time weight_dequant too")
    p.add_argument("--cpu", action="store_true", help="also time the CPU path (all cores)")
    args = p.parse_args()
    rows, cols = args.rows, args.cols
    gen = torch.Generator().manual_seed(0)
    result: dict = {"shape": [rows, cols], "torch": torch.__version__, "cpu_threads": torch.get_num_threads()}
    moved = rows * cols * (1 + 2) + (-(-rows // 128)) * (-(-cols // 128)) * 4
    result["bytes_moved"] = moved

    if args.cpu or not torch.cuda.is_available():
        w, s = random_fp8(rows, cols, "cpu", gen)
        dequant_fp8_block(w, s)  # warm-up
        t0 = time.perf_counter()
        n = 3
        for _ in range(n):
            cpu_out = dequant_fp8_block(w, s)
        sec = (time.perf_counter() - t0) / n
        result["cpu"] = {"seconds": sec, "gb_per_s": moved / sec / 1e9}
        del cpu_out

    if not torch.cuda.is_available():
        result["cuda"] = {"skipped": "no CUDA device"}
        print(json.dumps(result, indent=2))
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        result["cuda"] = {"skipped": "triton is not installed"}
        print(json.dumps(result, indent=2))
        return 0

    props = torch.cuda.get_device_properties(0)
    name = torch.cuda.get_device_name(0)
    peak, peak_source = peak_bandwidth(props, name)
    result["device"] = name
    result["peak_bytes_per_s"] = peak
    result["peak_source"] = peak_source
    result["triton"] = __import__("triton").__version__

    # a practical ceiling: a large device-to-device copy, bytes read + bytes written
    buf = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(buf)
    sec = time_cuda(lambda a=dst, b=buf: a.copy_(b), 20)
    result["d2d_copy_bytes_per_s"] = 2 * buf.numel() / sec
    del buf, dst

    # rotate among input sets larger than L2 so the cache does not serve repeated calls
    sets = [random_fp8(rows, cols, "cuda", gen) for _ in range(2)]
    state = {"i": 0}

    def rotating(kernel):
        def call():
            w, s = sets[state["i"] % len(sets)]
            state["i"] += 1
            return kernel(w, s)
        return call

    sec = time_cuda(rotating(dequant_fp8_block), args.reps)
    result["ckpttool"] = {"seconds": sec, "bytes_per_s": moved / sec,
                          "fraction_of_peak": moved / sec / peak if peak else None,
                          "fraction_of_d2d_copy": moved / sec / result["d2d_copy_bytes_per_s"]}

    # the executor's path: the NaN flag is read after a synchronize the caller does anyway
    from ckpttool.kernels.fp8 import dequant_fp8_block_lazy

    sec = time_cuda(rotating(dequant_fp8_block_lazy), args.reps)
    result["ckpttool_no_sync"] = {"seconds": sec, "bytes_per_s": moved / sec,
                                  "fraction_of_peak": moved / sec / peak if peak else None}
    w, s = sets[0]
    ours_out = dequant_fp8_block(w, s)
    cpu_ref = dequant_fp8_block(w.cpu(), s.cpu())
    result["ckpttool"]["bit_identical_to_cpu"] = bool(torch.equal(ours_out.cpu().view(torch.int16),
                                                                  cpu_ref.view(torch.int16)))

    if args.seeds:
        sys.path.insert(0, os.path.abspath(args.seeds))
        try:
            from kernel import weight_dequant  # the reference Triton kernel, unmodified

            torch.set_default_dtype(torch.bfloat16)  # as fp8_cast_bf16.py does: output dtype
            try:
                sec = time_cuda(rotating(weight_dequant), args.reps)
                ref_out = weight_dequant(*sets[0])
            finally:
                torch.set_default_dtype(torch.float32)
            result["reference"] = {"seconds": sec, "bytes_per_s": moved / sec,
                                   "fraction_of_peak": moved / sec / peak if peak else None,
                                   "bit_identical_to_ckpttool": bool(torch.equal(ref_out.view(torch.int16),
                                                                                 ours_out.view(torch.int16)))}
            result["bandwidth_vs_reference"] = {  # ours / the reference kernel's, same shape, same session
                "api_with_nan_check_sync": result["ckpttool"]["bytes_per_s"] / result["reference"]["bytes_per_s"],
                "executor_path_no_sync": result["ckpttool_no_sync"]["bytes_per_s"] / result["reference"]["bytes_per_s"]}
        except Exception as exc:  # report, do not fail the benchmark over the reference
            result["reference"] = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
