"""One entry point for the maintained benchmarks: `python -m bench list`, `python -m bench run NAME [ARGS...]`,
`python -m bench smoke [NAME...]`.

A maintained benchmark is one whose current numbers bench/RESULTS.md keeps, re-run when the code it measures
changes; `smoke` runs each of them tiny (a few seconds, on the CPU, on a tiny checkpoint) so that one a change
breaks fails tests/test_bench_smoke.py in the default test run instead of on the next measuring day. The other
scripts in bench/ are one-off probes: kept to re-ask their question, guarded by no test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Benchmark:
    name: str
    module: str  # bench/<module>.py, run as `python bench/<module>.py ARGS` (its own directory first on sys.path)
    what: str
    smoke: tuple[str, ...]  # tiny arguments; {src} a tiny FP8 DeepSeek-V3 checkpoint, {work} a scratch directory
    prints_json: bool  # whether its stdout is one JSON object
    expect: str  # text its stdout holds when it measured something (a result's key or row)


BENCHMARKS = (
    Benchmark("convert", "run_bench", "fused convert against the reference two-pass pipeline and the disk",
              ("--src", "{src}", "--out", "{work}/out", "--work", "{work}/scratch", "--steps", "convert,dequant-cpu",
               "--mp", "2", "--no-drop-caches", "--min-step-s", "0"), False, "Summary: convert_gb_per_s"),
    Benchmark("kernel", "kernel_bench", "the FP8 block dequant kernel alone against the device's memory bandwidth",
              ("--rows", "256", "--cols", "512", "--reps", "2", "--cpu"), True, '"gb_per_s"'),
    Benchmark("quant", "quant_bench", "every dequant format per output byte against FP8 block (CPU, Triton)",
              ("--rows", "256", "--cols", "256", "--reps", "1", "--no-cuda"), False, '"vs_fp8_block"'),
    Benchmark("bnb", "bnb_bench", "bitsandbytes' formats per output byte against FP8 block on one CPU thread",
              ("--rows", "256", "--cols", "256", "--reps", "1"), False, '"vs_fp8_block"'),
    Benchmark("family-rates", "family_rates", "two checkpoints' conversion rates, interleaved round by round",
              ("{src}", "{src}", "--dst", "{work}/dst", "--rounds", "1", "--", "--mp", "2"), True, '"median_gb_per_s"'),
    Benchmark("hub-stream", "hub_stream_bench", "convert from a repo id against download and convert apart",
              ("--src", "{src}", "--work", "{work}/hub", "--mp", "2", "--reps", "1"), False, "| 0 | - |"),
)
BY_NAME = {b.name: b for b in BENCHMARKS}


def command(bench: Benchmark, args: list[str]) -> list[str]:
    return [sys.executable, str(REPO / "bench" / f"{bench.module}.py"), *args]


def environment() -> dict[str, str]:
    """The tree under test first on the path (the scripts also import `bench.<module>` and tests/)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}


def smoke(bench: Benchmark, src: Path, work: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `bench` tiny; raise naming the benchmark when it fails or prints no result."""
    work.mkdir(parents=True, exist_ok=True)
    args = [a.format(src=src, work=work) for a in bench.smoke]
    done = subprocess.run(command(bench, args), cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=environment())
    if done.returncode != 0:
        raise RuntimeError(f"bench {bench.name} exited {done.returncode}:\n{done.stdout[-2000:]}\n"
                           f"{done.stderr[-4000:]}")
    if not done.stdout.strip():
        raise RuntimeError(f"bench {bench.name} printed nothing")
    if bench.prints_json:
        json.loads(done.stdout)
    if bench.expect not in done.stdout:
        raise RuntimeError(f"bench {bench.name} measured nothing ({bench.expect!r} not in its output):\n"
                           f"{done.stdout[-2000:]}")
    return done


def tiny_checkpoint(root: Path) -> Path:
    from ckpttool.families.deepseek.demo import build_checkpoint

    return build_checkpoint(root / "tiny-v3", "tiny-v3")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("list", "run", "smoke"):
        print(__doc__)
        return 2
    if argv[0] == "list":
        for b in BENCHMARKS:
            print(f"{b.name:13} bench/{b.module + '.py':20} {b.what}")
        return 0
    names = argv[1:] if argv[0] == "smoke" else argv[1:2]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown or (argv[0] == "run" and not names):
        print(f"unknown benchmark {unknown or '(none)'}: one of {', '.join(BY_NAME)}", file=sys.stderr)
        return 2
    if argv[0] == "run":
        return subprocess.call(command(BY_NAME[names[0]], argv[2:]), cwd=REPO, env=environment())
    with tempfile.TemporaryDirectory(prefix="bench-smoke-") as tmp:
        src = tiny_checkpoint(Path(tmp))
        for name in names or list(BY_NAME):
            smoke(BY_NAME[name], src, Path(tmp) / name)
            print(f"{name}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
