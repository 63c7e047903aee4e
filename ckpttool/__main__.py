"""`python -m ckpttool` and the `ckpttool` executable (also what `torchrun -m ckpttool` runs).

Light on purpose: before the CLI's own imports, a CPU conversion of an FP8 checkpoint starts loading the
FP8 kernels on a thread (kernels/warm.py)."""

import os
import sys


def entry() -> None:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before the warm-up's numpy: see ckpttool.cli
    from ckpttool.kernels import warm

    warm.start(sys.argv[1:])
    from ckpttool.cli import entry as run

    run()


if __name__ == "__main__":
    entry()
