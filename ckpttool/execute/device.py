"""Where dequant runs: `--device auto | cpu | cuda[:N]`, decided without importing torch."""

from __future__ import annotations

import os

from ckpttool import defaults
from ckpttool.dtypes import torch_installed
from ckpttool.errors import InputError

AUTO_CPU_MIN_CORES = 8
"""`--device auto` dequantizes on the CPU from this many cores up, even beside a GPU: the numpy path
then keeps up with the disk (bench/RESULTS.md, 16 cores: 1.43 GB/s written, at the disk's speed),
and the GPU path first pays for torch's import and CUDA's start (5-14 s on the benchmark machine,
1.5 GB of libraries read, 0.6 GiB more RSS): a 10.9 GB conversion ran 3.2x faster than the
reference with the GPU and 4.7x on the CPU."""


def no_cuda() -> InputError:
    return InputError("--device cuda was asked for but no CUDA device is available",
                      fix="use --device cpu (the same bits, computed on the CPU)")


def gpu_present() -> bool:
    """Whether this machine shows a GPU driver at all, without importing torch: `--device auto`
    starts CUDA only where one may be. torch decides in the end (torch.cuda.is_available)."""
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg"))


def resolve_device(device: str) -> str:
    """One of cpu, auto (the GPU, looked for while the CPU starts: only on a machine with a GPU
    driver and fewer than AUTO_CPU_MIN_CORES cores; else cpu) or cuda[:N].

    Decided without importing torch: only a run that may use the GPU pays for it, and then on a
    thread of its own (cuda.CudaTransforms)."""
    if device == "auto":
        few_cores = defaults.cores() < AUTO_CPU_MIN_CORES
        return "auto" if few_cores and gpu_present() else "cpu"
    if device.startswith("cuda") and not gpu_present():
        raise no_cuda()
    if device.startswith("cuda") and not torch_installed():
        raise InputError("--device cuda needs torch and Triton, which the core install leaves out",
                         fix="pip install 'ckpttool[triton]' (after your CUDA build of torch), or use --device cpu "
                             "(the same bits)")
    return device
