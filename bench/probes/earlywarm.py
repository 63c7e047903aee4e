"""`python -m bench.probes.earlywarm ARGS` runs `ckpttool ARGS` with the CPU FP8 kernels (numba's import and cache
load) started on a thread at the process's first line, beside the CLI's own imports and the plan: does
start-up overlap itself (bench/device_run.sh phase 14, `WRAP_MODULE=bench.probes.earlywarm`)? A measurement aid."""

import os
import threading

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as ckpttool.cli sets it, before numpy loads


def _warm() -> None:
    import numpy as np

    from ckpttool.kernels import fp8_cpu

    fp8_cpu.dequant(np.zeros((128, 256), np.uint8), np.ones((1, 2), np.float32), "F8_E4M3", "BF16")


threading.Thread(target=_warm, name="ckpttool-early-warm", daemon=True).start()

from ckpttool.cli import entry  # noqa: E402 - beside the thread

entry()
