"""The CPU FP8 kernels loaded on a thread from the executable's first line, beside the CLI's own imports.

A CPU conversion of an FP8 checkpoint starts with two fixed costs in a row: importing the CLI (0.8-1.1 s of
CPU on the H100 machine) and numba's import and cache load at the first FP8 chunk, while every worker waits
for it. Much of the second is LLVM's work through ctypes, without the GIL, so on a thread it overlaps the
first: on the H100 machine the run itself took 2.37-2.65 s against 2.77-3.30 without, the whole process
0.86-0.97x the wall time (bench/RESULTS.md). Loading numba when no chunk needs it would only take CPU from
the run, so this looks at the command line and the source's config.json first, and guesses low: a guess
that misses costs the same start-up as before, never a wrong result (the kernels load on first use anyway).

Imports nothing heavy itself: it runs before the CLI (ckpttool.__main__.entry).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

COMMANDS = ("convert", "dequant", "shard")
"""the commands that may dequantize FP8 on the CPU (shard only with --dtype bf16)"""
CONFIG_MAX_BYTES = 1 << 20
"""a config.json larger than this is not read here (the plan reads it, with its own checks)"""


def wanted(args: list[str]) -> bool:
    """Whether `ckpttool ARGS` will likely dequantize FP8 block weights on the CPU: convert, dequant, or
    shard --dtype bf16, not on CUDA, with numba on, of a local directory whose config.json names
    quant_method fp8."""
    words = [a for a in args if not a.startswith("-")]
    if (os.environ.get("CKPTTOOL_NUMBA", "1") == "0" or not words or words[0] not in COMMANDS
            or "--help" in args or "-h" in args):
        return False
    options = dict(zip(args, args[1:]))
    dtype = next((a.split("=", 1)[1] for a in args if a.startswith("--dtype=")), options.get("--dtype"))
    device = next((a.split("=", 1)[1] for a in args if a.startswith("--device=")), options.get("--device"))
    if device == "cuda" or dtype == "fp8" or (words[0] == "shard" and dtype != "bf16"):
        return False
    return any(_fp8_config(Path(a)) for a in words[1:])


def _fp8_config(src: Path) -> bool:
    try:
        config = src / "config.json"
        if config.stat().st_size > CONFIG_MAX_BYTES:
            return False
        quant = json.loads(config.read_bytes()).get("quantization_config")
        return isinstance(quant, dict) and quant.get("quant_method") == "fp8"
    except (OSError, ValueError, AttributeError, RecursionError):
        return False


def _load() -> None:
    try:
        import numpy as np

        from ckpttool.kernels import fp8_cpu

        fp8_cpu.dequant(np.zeros((128, 256), np.uint8), np.ones((1, 2), np.float32), "F8_E4M3", "BF16")
    except Exception:  # noqa: BLE001 - a warm-up only: the real first call loads (and reports) the same
        pass


def start(args: list[str]) -> threading.Thread | None:
    """Start loading the FP8 kernels on a daemon thread when `wanted(args)`; the thread, or None."""
    if not wanted(args):
        return None
    thread = threading.Thread(target=_load, name="ckpttool-warm", daemon=True)
    thread.start()
    return thread
