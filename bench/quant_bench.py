"""Dequant kernels of issues 16 and 35 (GPTQ, AWQ) against today's FP8 block path, in one run on one machine.

Every format dequantizes a weight of the same output shape ([7168, 2048] BF16 by default) from random
codes and scales, so "per byte" compares like with like: each kernel's throughput is given per output
byte (Gelem/s x 2) and per byte moved (input + scales + output). CPU: one numpy call stream (one core;
the executor runs one per worker thread), the median of --reps, formats interleaved so the machine's
load hits them alike. `vs_fp8_block` is each CPU row's rate per output byte over FP8 block's in the same run (issue 35 asks >= 0.9).
CUDA (if present, the formats of issue 16): Triton, formats interleaved in --reps rounds, each timed
streamed, replayed from a CUDA graph (the kernel alone) and on the host (cuda_call_times).
Prints one JSON object.

    python bench/quant_bench.py [--rows 7168 --cols 2048] [--reps 7] [--no-cuda] [--seeds DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import numpy as np
import torch

from kernel_bench import peak_bandwidth, time_cuda  # bench/ is the script's directory

from ckpttool.formats import BY_NAME, Chunk

FORMATS = ("fp8_block", "ct_int4_g32", "ct_fp8_channel", "ct_nvfp4", "modelopt_nvfp4", "fp8_block:32x32:ue8m0:scale",
           "fp8_block:1x32:ue8m0:weight_scale_inv", "fp8_block:1x128:float:weight_scale_inv", "fp8_tensor:weight_scale",
           "mxfp4_experts:scale")
PACKED = ("gptq:b4:g128:gptq", "gptq:b4:g32:gptq", "gptq:b4:g128:gptq:desc_act", "gptq:b8:g128:gptq_v2",
          "awq_gemm:g128", "awq_gemm:g32", "awq_gemv:g128")
"""GPTQ and AWQ (formats/gptq.py, awq.py): several side tensors, so their chunks are made by packed_chunk"""
VARIANTS = {  # label: (row, scale dtype) of issue 35's compressed-tensors and ModelOpt rows
    "ct_int:pack:4:group128:asym": ("ct_int:pack:4:group128:asym", "BF16"),  # W4A16_ASYM
    "ct_int:pack:4:group32:asym": ("ct_int:pack:4:group32:asym", "BF16"),
    "ct_int:pack:8:group128:sym": ("ct_int:pack:8:group128:sym", "BF16"),  # W8A16
    "ct_int:pack:8:group128:asym": ("ct_int:pack:8:group128:asym", "BF16"),
    "ct_int:int:8:channel:sym": ("ct_int:int:8:channel:sym", "BF16"),  # INT8 W8A8
    "ct_int:int:8:channel:asym": ("ct_int:int:8:channel:asym", "BF16"),
    "ct_int:pack:4:group128:sym:gidx": ("ct_int:pack:4:group128:sym:gidx", "BF16"),  # act-order group
    "ct_int:pack:8:group128:sym:gidx": ("ct_int:pack:8:group128:sym:gidx", "BF16"),
    "ct_int4_g128 (F16 scales)": ("ct_int4_g128", "F16"),
    "ct_fp8_channel (F16 scales)": ("ct_fp8_channel", "F16"),
    "ct_fp8_block:128x128": ("ct_fp8_block:128x128", "BF16"),
    "ct_fp8_block:128x128 (F16 scales)": ("ct_fp8_block:128x128", "F16"),
    "ct_fp8_group:128": ("ct_fp8_group:128", "BF16"),
    "ct_mxfp4": ("ct_mxfp4", "U8"),
    "modelopt_fp8_tensor": ("modelopt_fp8_tensor", "F32"),
    "modelopt_fp8_channel": ("modelopt_fp8_channel", "F32"),
    "mxfp4 (gpt-oss experts, transposed)": ("mxfp4", "U8"),  # one gpt-oss gate_up expert: [1, 5760, 90, 16]
}
_TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def variant_inputs(label: str, rows: int, cols: int, gen: torch.Generator) -> tuple[torch.Tensor, str, dict, dict]:
    """(values, their dtype code, sides by role, side dtypes) of a [rows, cols] weight in one of VARIANTS: random
    codes, scales of one weight's spread (a few thousand distinct BF16 values), random zero points."""
    row_name, sdt = VARIANTS[label]
    row = BY_NAME[row_name]

    def u8(*shape):
        x = torch.randint(0, 256, shape, dtype=torch.int32, generator=gen).to(torch.uint8)
        x[(x & 0x7F) == 0x7F] ^= 1  # no NaN codes (FP8 values)
        return x

    def scale(*shape):
        return (torch.rand(shape, generator=gen) * 1e-2 + 1e-4).to(_TORCH[sdt])

    if row_name == "mxfp4":  # its own shape (gpt-oss' gate_up_proj, [1, 2880, 5760] out): per output byte all the same
        exponents = torch.randint(107, 122, (1, 5760, 90), generator=gen, dtype=torch.uint8)
        return u8(1, 5760, 90, 16), "U8", {"scale": exponents}, {"scale": "U8"}
    if row_name == "ct_mxfp4":
        return (u8(rows, cols // 2), "U8", {"scale": torch.randint(107, 122, (rows, cols // 32), generator=gen,
                                                                     dtype=torch.uint8)}, {"scale": "U8"})
    if "fp8" in row_name:
        shape = {"ct_fp8_channel": (rows, 1), "ct_fp8_block:128x128": (rows // 128, cols // 128),
                 "ct_fp8_group:128": (rows, cols // 128), "modelopt_fp8_tensor": (), "modelopt_fp8_channel": (rows,)}
        return u8(rows, cols).view(torch.float8_e4m3fn), "F8_E4M3", {"scale": scale(*shape[row_name])}, {"scale": sdt}
    storage, bits = ("pack", 4) if row_name.startswith("ct_int4") else row_name.split(":")[1:3]
    bits, group = int(bits), 128 if "128" in row_name else 32
    groups = cols // group if "group" in row_name or row_name.startswith("ct_int4") else 1
    values = u8(rows, cols * bits // 8)
    values, dtype = (values.view(torch.int32), "I32") if storage == "pack" else (values.view(torch.int8), "I8")
    sides, dtypes = {"scale": scale(rows, groups)}, {"scale": sdt}
    if row_name.endswith(":asym"):
        sides["zero"] = u8(rows * bits // 32, groups * 4).view(torch.int32) if storage == "pack" else \
            u8(rows, groups).view(torch.int8)
        dtypes["zero"] = "I32" if storage == "pack" else "I8"
    if row_name.endswith(":gidx"):  # GPTQ act-order: column j's rank in a random order, divided by the group size
        rank = torch.empty(cols, dtype=torch.int32)
        rank[torch.randperm(cols, generator=gen)] = torch.arange(cols, dtype=torch.int32)
        sides["g_idx"], dtypes["g_idx"] = rank // group, "I32"
    assert all(side.role in sides for side in row.read_sides), label
    return values, dtype, sides, dtypes


def inputs(name: str, rows: int, cols: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(source, scale, source dtype code) of a [rows, cols] weight in the format."""
    def u8(*shape):
        x = torch.randint(0, 256, shape, dtype=torch.int32, generator=gen).to(torch.uint8)
        x[(x & 0x7F) == 0x7F] ^= 1  # no NaN codes (FP8 values, F8_E4M3 scales)
        return x

    if name == "fp8_block":
        return (u8(rows, cols).view(torch.float8_e4m3fn),
                torch.rand(-(-rows // 128), -(-cols // 128), generator=gen) * 1e-3 + 1e-4, "F8_E4M3")
    if name.startswith("fp8_block:"):  # E8M0 scales: exponents a weight's blocks take (2**-20 .. 2**-5)
        b0, b1 = map(int, name.split(":")[1].split("x"))
        shape = (-(-rows // b0), -(-cols // b1))
        if "ue8m0" in name:
            return u8(rows, cols).view(torch.float8_e4m3fn), torch.randint(107, 122, shape, generator=gen,
                                                                           dtype=torch.uint8), "F8_E4M3"
        return u8(rows, cols).view(torch.float8_e4m3fn), torch.rand(*shape, generator=gen) * 1e-3 + 1e-4, "F8_E4M3"
    if name.startswith("fp8_tensor"):
        return u8(rows, cols).view(torch.float8_e4m3fn), torch.rand(1, generator=gen) * 1e-3 + 1e-4, "F8_E4M3"
    if name.startswith("mxfp4_experts"):
        return (u8(rows, cols // 2).view(torch.int8),
                torch.randint(107, 122, (rows, cols // 32), generator=gen, dtype=torch.uint8), "I8")
    if name == "ct_int4_g32":
        return u8(rows, cols // 2).view(torch.int32), (torch.rand(rows, cols // 32, generator=gen) * 1e-2).bfloat16(), "I32"
    if name == "ct_fp8_channel":
        return u8(rows, cols).view(torch.float8_e4m3fn), (torch.rand(rows, 1, generator=gen) * 1e-2).bfloat16(), "F8_E4M3"
    return u8(rows, cols // 2), u8(rows, cols // 16).view(torch.float8_e4m3fn), "U8"


def packed_chunk(name: str, rows: int, cols: int, gen: np.random.Generator) -> tuple[Chunk, int]:
    """(a chunk of the GPTQ/AWQ row `name` for a [rows, cols] output, the bytes it moves): random words, F16 scales
    spread over 3.5 binades as a layer's are (a few thousand distinct values), zero points in every word."""
    from ckpttool.formats import BY_NAME as rows_by_name
    from ckpttool.formats.awq import zeros_width

    def words(*shape):
        return gen.integers(-2 ** 31, 2 ** 31, size=shape, dtype=np.int64).astype(np.int32)

    def scales(*shape):
        return (gen.random(shape, dtype=np.float32) * 1e-2 + 1e-3).astype(np.float16)

    group = int(name.split(":g")[1].split(":")[0])
    n_groups = cols // group
    if name.startswith("gptq"):
        per = 32 // int(name.split(":b")[1].split(":")[0])
        g_idx = (np.arange(cols) // group).astype(np.int32)
        if name.endswith("desc_act"):
            g_idx = g_idx[gen.permutation(cols)]
        sides = {"scale": scales(n_groups, rows), "zero": words(n_groups, rows // per), "g_idx": g_idx}
        values = words(cols // per, rows)
    elif name.startswith("awq_gemm"):
        sides, values = {"scale": scales(n_groups, rows), "zero": words(n_groups, rows // 8)}, words(cols, rows // 8)
    else:
        width = zeros_width(cols, group)
        sides, values = {"scale": scales(rows, width * 8), "zero": words(rows, width)}, words(rows, cols // 8)
    dtypes = {s.role: s.dtypes[0] for s in rows_by_name[name].read_sides}
    return Chunk(values, "I32", sides, dtypes), values.nbytes + sum(v.nbytes for v in sides.values()) + rows * cols * 2


def carrier(t: torch.Tensor) -> np.ndarray:
    """The array a Chunk carries for a tensor (dtypes.CARRIERS): F16 as numpy's float16, BF16 as uint16 bits."""
    if t.dtype == torch.float16:
        return t.numpy()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]).numpy().view(
        {1: np.uint8, 2: np.uint16, 4: np.int32 if t.dtype == torch.int32 else np.float32}[t.element_size()])


def moved(x: torch.Tensor, s: torch.Tensor, rows: int, cols: int) -> int:
    return x.numel() * x.element_size() + s.numel() * s.element_size() + rows * cols * 2


def cuda_call_times(fn, calls: int = 20) -> dict[str, float]:
    """Seconds per call three ways: `streamed`, calls queued back to back between two CUDA events (the
    host's launch cost hides behind the GPU only where the kernel is the longer); `graph`, the same calls
    replayed from a CUDA graph (the GPU's time alone, no host work); `host`, the wall time of enqueueing
    one call (what each call costs a worker's thread)."""
    streamed = time_cuda(fn, 5, calls=calls, warmup=2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    replay = time_cuda(graph.replay, 5, warmup=1) / calls
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t) / calls
    torch.cuda.synchronize()
    return {"streamed": streamed, "graph": replay, "host": host}


def chunk(name: str, x, s, dtype: str, global_scale: float) -> Chunk:
    """A row's kernel input: values, their scale rows and (NVFP4) the global scale, unused by the other rows."""
    byte_scale = s.dtype in (torch.uint8, np.uint8)  # numpy carriers on the CPU, tensors on CUDA
    scale_dtype = "U8" if byte_scale and "U8" in BY_NAME[name].side("scale").dtypes \
        else BY_NAME[name].side("scale").dtypes[0]
    return Chunk(x, dtype, {"scale": s}, {"scale": scale_dtype}, global_scale)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=7168)
    p.add_argument("--cols", type=int, default=2048)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--no-cuda", action="store_true")
    p.add_argument("--no-variants", action="store_true", help="only issue 16's formats and the FP8 family")
    p.add_argument("--only", help="comma-separated prefixes: time only the CPU rows named so (fp8_block always)")
    p.add_argument("--thread-time", action="store_true", help="CPU rows timed by the thread's CPU time, not the wall "
                   "clock: steadier where other processes share the cores (the time waiting for a core not counted)")
    p.add_argument("--seeds", help="directory holding DeepSeek's kernel.py: its weight_dequant joins the CUDA rounds "
                                   "on fp8_block's input (issue 17's reference)")
    args = p.parse_args()
    rows, cols = args.rows, args.cols
    gen = torch.Generator().manual_seed(0)
    data = {n: inputs(n, rows, cols, gen) for n in FORMATS}
    packed = {n: packed_chunk(n, rows, cols, np.random.default_rng(0)) for n in PACKED}
    kw = {n: (2688.0 / 3.1 if n.startswith("ct") else 3.1 / 2688.0) for n in FORMATS}
    result: dict = {"shape": [rows, cols], "out_dtype": "BF16", "torch": torch.__version__, "cpu": {}, "cuda": None}

    variants = {v: variant_inputs(v, rows, cols, gen) for v in VARIANTS} if not args.no_variants else {}
    chunks = {n: chunk(n, carrier(data[n][0]), carrier(data[n][1]), data[n][2], kw[n]) for n in FORMATS}
    chunks |= {n: packed[n][0] for n in PACKED}  # made before any clock starts, as each variant's below
    calls = {n: (lambda n=n, c=c: BY_NAME[n].cpu(c, "BF16", None)) for n, c in chunks.items()}
    for v, (x, dtype, sides, dtypes) in variants.items():
        c = Chunk(carrier(x), dtype,
                  {r: t.numpy() if t.dtype in (torch.int32, torch.int8) else carrier(t) for r, t in sides.items()},
                  dtypes)
        calls[v] = (lambda v=v, c=c: BY_NAME[VARIANTS[v][0]].cpu(c, "BF16", None))
    out_bytes = {v: math.prod(BY_NAME[VARIANTS[v][0]].out_shape(tuple(x.shape))) * 2 for v, (x, *_) in variants.items()}
    if args.only:
        calls = {n: c for n, c in calls.items() if n == "fp8_block" or n.startswith(tuple(args.only.split(",")))}
    times: dict[str, list[float]] = {n: [] for n in calls}
    clock = time.thread_time if args.thread_time else time.perf_counter
    result["clock"] = clock.__name__
    for rep in range(args.reps + 1):
        for n, call in calls.items():  # interleaved: the machine's load hits every format alike
            t0 = clock()
            call()
            if rep:  # the first round warms tables and caches
                times[n].append(clock() - t0)
    for n in calls:
        nbytes = packed[n][1] if n in packed else moved(*data[n][:2], rows, cols) if n in data else \
            sum(t.numel() * t.element_size() for t in (variants[n][0], *variants[n][2].values())) + out_bytes[n]
        sec = statistics.median(times[n])
        out = out_bytes.get(n, rows * cols * 2)
        result["cpu"][n] = {"seconds": round(sec, 4), "gb_moved_per_s_per_core": round(nbytes / sec / 1e9, 3),
                            "gb_out_per_s_per_core": round(out / sec / 1e9, 3), "bytes_moved": nbytes,
                            # per round, FP8 block's time per output byte over this one's: their median
                            "vs_fp8_block": round(statistics.median(b / t * out / (rows * cols * 2) for b, t in
                                                                    zip(times["fp8_block"], times[n])), 3)}

    if not args.no_cuda and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        peak, how = peak_bandwidth(props, props.name)
        result["cuda"] = {"device": props.name, "peak_bytes_per_s": peak, "peak_source": how, "formats": {}}
        calls = {}
        for n in FORMATS:
            x, s, _ = data[n]
            xc, sc = x.cuda(), (s.float() if n == "fp8_block" else s).cuda()
            on_gpu = chunk(n, xc, sc, data[n][2], kw[n])
            calls[n] = (lambda c=on_gpu, n=n: BY_NAME[n].cuda(c, torch.bfloat16))
        names = list(FORMATS)
        if args.seeds:
            sys.path.insert(0, os.path.abspath(args.seeds))
            from kernel import weight_dequant  # DeepSeek's reference Triton kernel, unmodified

            xc, sc = (t.cuda() for t in (data["fp8_block"][0], data["fp8_block"][1].float()))

            def reference():  # its output dtype is torch's default, as fp8_cast_bf16.py sets it
                torch.set_default_dtype(torch.bfloat16)
                try:
                    return weight_dequant(xc, sc)
                finally:
                    torch.set_default_dtype(torch.float32)

            calls["deepseek_weight_dequant"] = reference
            data["deepseek_weight_dequant"] = data["fp8_block"]
            names.append("deepseek_weight_dequant")
        cuda_times = {n: {k: [] for k in ("streamed", "graph", "host")} for n in names}
        for _ in range(args.reps):  # rounds, formats interleaved in each, as on the CPU
            for n in names:
                for k, v in cuda_call_times(calls[n]).items():
                    cuda_times[n][k].append(v)
        for n in names:
            x, s, _ = data[n]
            row = {}
            for k, v in cuda_times[n].items():
                sec = statistics.median(v)
                row[f"{k}_us"] = round(sec * 1e6, 1)
                if k != "host":
                    row[f"{k}_gb_out_per_s"] = round(rows * cols * 2 / sec / 1e9, 1)
            row["graph_fraction_of_peak"] = round(moved(x, s, rows, cols) / statistics.median(cuda_times[n]["graph"])
                                                  / peak, 3) if peak else None
            result["cuda"]["formats"][n] = row
        base = result["cuda"]["formats"]["fp8_block"]
        for row in result["cuda"]["formats"].values():
            for k in ("streamed", "graph"):
                row[f"{k}_vs_fp8_block"] = round(row[f"{k}_gb_out_per_s"] / base[f"{k}_gb_out_per_s"], 3)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
