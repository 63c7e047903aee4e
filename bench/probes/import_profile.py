"""Where a conversion's start-up goes before any byte moves: `python -X importtime` of the CLI, summed per
top-level package (self time), and the first call of the numba FP8 kernel (its import and cache load).
Prints one JSON object. Run it twice: the first run also writes bytecode caches.

    python -m bench.probes.import_profile
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys

PROBE = """
import time, sys
t0 = time.perf_counter()
import ckpttool.cli
t1 = time.perf_counter()
import numpy as np
from ckpttool.kernels import fp8_cpu
fp8_cpu.dequant(np.zeros((128, 256), np.uint8), np.ones((1, 2), np.float32), "F8_E4M3", "BF16")
t2 = time.perf_counter()
print(round(t1 - t0, 3), round(t2 - t1, 3))
"""


def main() -> None:
    out = {}
    for label, env in (("default", {}), ("pydantic plugins off", {"PYDANTIC_DISABLE_PLUGINS": "__all__"})):
        runs = [subprocess.run([sys.executable, "-c", PROBE], env=dict(os.environ, **env), capture_output=True,
                               text=True, check=True).stdout.split() for _ in range(3)]
        out[label] = {"import_cli_s": [float(r[0]) for r in runs], "numba_first_call_s": [float(r[1]) for r in runs]}
    trace = subprocess.run([sys.executable, "-X", "importtime", "-c", PROBE], capture_output=True, text=True,
                           check=True).stderr
    per = collections.Counter()
    for line in trace.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| *(\S+)", line)
        if m:
            per[m[3].split(".")[0]] += int(m[1])
    out["self_ms_by_package"] = {k: round(v / 1000, 1) for k, v in per.most_common(20)}
    out["self_ms_total"] = round(sum(per.values()) / 1000, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
