"""The same conversion of two checkpoints, interleaved round by round: the rate per output byte of each and
their ratio, on one machine in one run (issue 36: a DeepSeek-V4-shaped synthetic, FP8 with E8M0 scales beside
MXFP4 experts, against V3's FP8 128x128 blocks).

    python bench/make_synthetic.py --out /dev/shm/v3syn --layers 2 --dense-layers 1 --experts 32
    python bench/make_synthetic.py --model v4 --out /dev/shm/v4syn --layers 2 --dense-layers 1 --experts 32
    python bench/family_rates.py /dev/shm/v3syn /dev/shm/v4syn --dst /dev/shm/out --rounds 5 [-- --mp 8]

Each round converts every source once (BF16, `--mp 8` unless other arguments follow `--`) into a fresh
directory, deleted after; prints one JSON object: per source, every round's execute seconds, output bytes and
GB/s, their median, and each source's median rate over the first's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path


def convert(src: Path, dst: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "ckpttool", "convert", str(src), str(dst), "--quiet", "--json", *extra]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    execute = out["timing"]["phases_s"]["execute"]
    return {"execute_s": execute, "total_s": out["timing"]["phases_s"]["total"], "bytes": out["bytes_written"],
            "gb_per_s": round(out["bytes_written"] / execute / 1e9, 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sources", nargs="+", type=Path)
    p.add_argument("--dst", type=Path, required=True, help="a directory to convert into (made, emptied, removed)")
    p.add_argument("--rounds", type=int, default=3)
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)  # convert's own arguments follow `--`
    args = p.parse_args(argv[:split])
    extra = argv[split + 1:] or ["--mp", "8"]
    runs: dict[str, list[dict]] = {str(s): [] for s in args.sources}
    for _ in range(args.rounds + 1):  # the first round warms the page cache and the kernels: not counted
        for src in args.sources:
            shutil.rmtree(args.dst, ignore_errors=True)
            runs[str(src)].append(convert(src, args.dst, extra))
    shutil.rmtree(args.dst, ignore_errors=True)
    result = {"extra": extra, "rounds": args.rounds, "sources": {}}
    first = None
    for src, rounds in runs.items():
        median = statistics.median(r["gb_per_s"] for r in rounds[1:])
        first = first or median
        result["sources"][src] = {"median_gb_per_s": median, "ratio_to_first": round(median / first, 3),
                                  "rounds": rounds[1:], "warm_up": rounds[0]}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
