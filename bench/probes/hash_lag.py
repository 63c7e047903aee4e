"""Where the manifest's hashing stands during a conversion (issue 17: the wait for hashes at the end).

Runs `convert SRC DST --mp N` in this process and samples every output file's hasher every --every
seconds: bytes written, bytes whose final contents are written from offset 0 on (the frontier) and bytes
hashed, summed over the files and per file ([written, frontier, hashed] MB). A frontier far ahead of the
hash means hashing lacks CPU; a frontier far behind the bytes written means pieces land out of order and
the hash has to wait for them. Prints one JSON object: the samples, and the run's --json timing.

    python bench/probes/hash_lag.py SRC DST [--mp 8] [--device cpu] [--workers N]
"""

from __future__ import annotations

import argparse
import json
import shutil
import threading
import time
from pathlib import Path

from ckpttool.execute import staging as staging_module
from ckpttool.plan.build import Spec
from ckpttool.runner import ExecOptions, convert


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--mp", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--every", type=float, default=0.25)
    a = p.parse_args()
    shutil.rmtree(a.dst, ignore_errors=True)
    stagings: list = []
    init = staging_module.Staging.__init__

    def keep(self, *args, **kwargs):
        init(self, *args, **kwargs)
        stagings.append(self)

    staging_module.Staging.__init__ = keep
    samples: list[dict] = []
    t0 = time.perf_counter()
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(a.every):
            hashers = list(stagings[0]._hashers.values()) if stagings else []
            if hashers:
                written = [h._frontier + sum(e - max(s, h._frontier) for s, e in list(h._ranges) if e > h._frontier)
                           for h in hashers]
                samples.append({"t": round(time.perf_counter() - t0, 2),
                                "written_gb": round(sum(written) / 1e9, 2),
                                "frontier_gb": round(sum(h._frontier for h in hashers) / 1e9, 2),
                                "hashed_gb": round(sum(h._hashed for h in hashers) / 1e9, 2),
                                "size_gb": round(sum(h.size for h in hashers) / 1e9, 2),
                                "per_file_mb": [[round(w / 1e6), round(h._frontier / 1e6), round(h._hashed / 1e6)]
                                                for w, h in zip(written, hashers)]})

    threading.Thread(target=sample, daemon=True).start()
    opts = ExecOptions(quiet=True, device=a.device, **({"workers": a.workers} if a.workers else {}))
    result = convert(a.src, a.dst, Spec(dequant=True, mp=a.mp), opts)
    stop.set()
    print(json.dumps({"wall_s": round(time.perf_counter() - t0, 2), "samples": samples,
                      "timing": result.timings.to_json()}))
    shutil.rmtree(a.dst, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
