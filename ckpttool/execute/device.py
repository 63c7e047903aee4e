"""Where dequant runs: `--device auto | cpu | cuda[:N]`, decided without importing torch."""

from __future__ import annotations

import os

from ckpttool import defaults
from ckpttool.dtypes import torch_installed
from ckpttool.errors import InputError

# `--device auto`'s model of one dequantizing conversion, RAM to RAM, fitted to the H100 machine's runs at 2 to 16
# of its CPUs (the measurements, dated, are in bench/HISTORY.md under issue 17)
AUTO_CPU_GB_S_PER_CORE = 0.8
"""GB of output per second per core on the CPU path with the C loops, fitted to the runs at 2 and 4 cores"""
AUTO_GPU_START_S = 6.5
"""import torch, the CUDA context, the first Triton compile: 5-6.4 s fitted, during which the CPU converts"""


def auto_gpu_gb_s(cores: int) -> float:
    """GB of output per second on the CUDA path once started. Its CPU side (reading, writing, hashing)
    limits it: 2.4 measured at 2 cores, 3.5 at 4, 4.0-4.7 at 16."""
    return 5.0 * cores / (cores + 2)


def auto_uses_gpu(cores: int, out_bytes: int) -> bool:
    """Whether the GPU's start pays for itself: start + out / gpu < out / cpu. From 8 cores up the CPU
    path is as fast as the CUDA path's CPU side, so never (at 8 cores, in 10 s the GPU took no chunk);
    at 2 cores from about 29 GB of output (measured, CUDA against CPU: 18.46 GB 13.6 s against 11.2-14.0 s;
    2.56 GB 4.7 against 2.0-2.7), at 4 from about 520 GB (18.46 GB: 8.1 s against 6.0-6.1 s)."""
    cpu, gpu = AUTO_CPU_GB_S_PER_CORE * cores, auto_gpu_gb_s(cores)
    return gpu > cpu and out_bytes / 1e9 * (1 / cpu - 1 / gpu) > AUTO_GPU_START_S


def no_cuda() -> InputError:
    return InputError("--device cuda was asked for but no CUDA device is available",
                      fix="use --device cpu (the same bits, computed on the CPU)")


def gpu_present() -> bool:
    """Whether this machine shows a GPU driver at all, without importing torch: `--device auto`
    starts CUDA only where one may be. torch decides in the end (torch.cuda.is_available)."""
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg"))


def resolve_device(device: str, out_bytes: int = 0) -> str:
    """One of cpu, auto (the GPU, looked for while the CPU starts: only on a machine with a GPU driver
    where auto_uses_gpu says the job of `out_bytes` is large enough for these cores; else cpu) or cuda[:N].

    Decided without importing torch: only a run that may use the GPU pays for it, and then on a
    thread of its own (cuda.CudaTransforms)."""
    if device == "auto":
        return "auto" if auto_uses_gpu(defaults.cores(), out_bytes) and gpu_present() else "cpu"
    if device.startswith("cuda") and not gpu_present():
        raise no_cuda()
    if device.startswith("cuda") and not torch_installed():
        raise InputError("--device cuda needs torch and Triton, which the core install leaves out",
                         fix="pip install 'ckpttool[triton]' (after your CUDA build of torch), or use --device cpu "
                             "(the same bits)")
    return device
