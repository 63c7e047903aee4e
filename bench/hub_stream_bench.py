"""Overlap of downloading and converting (issue 19): `convert REPO_ID` against the same checkpoint's
download and conversion run separately, through the project's hub server on 127.0.0.1 (tests/hub_server.py)
and the real huggingface_hub client, with the server throttled to a link speed.

    A = `ckpttool download REPO DIR`        (the link alone)
    B = `ckpttool convert DIR OUT --mp N`   (the conversion alone, input in the page cache)
    C = `ckpttool convert REPO OUT --mp N`  (streamed: at most --max-input-files files on disk)

The target is C <= 1.2 x max(A, B). `--rate 0` throttles to input bytes / B, where download and
conversion take as long as each other: the case overlap has to earn most. Example:

    python bench/make_synthetic.py --out /tmp/syn --layers 1 --experts 8 --shards 4 --vocab 4096
    PYTHONPATH=. python bench/hub_stream_bench.py --src /tmp/syn --work /tmp/hubbench --mp 8 --reps 2

`--stream-args '' --stream-args '--workers 8'` times C once per variant in each rep (which one goes first
alternates), against the same A and B.

`--server-cpus 2` keeps the hub server (this process) on the last two CPUs and ckpttool on the others, in
A, B and C alike. A real hub's server is another machine; sharing the cores, the test server's sending
slows down while C converts (bench/RESULTS.md, 2026-11-23 evening).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from hub_server import HubServer, load_repo  # noqa: E402
from test_download import hub_env  # noqa: E402


def timed(env: dict, cpus: set[int] | None, *args) -> tuple[float, dict | None]:
    """One ckpttool command on `cpus` (None: wherever it likes); (seconds, its --json report or None)."""
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ckpttool", *map(str, args)], env=env, capture_output=True, text=True,
                          preexec_fn=pin)
    seconds = time.perf_counter() - t
    # each step as it ends: a phase cut off by its time limit still shows how far it got
    print(f"  {seconds:7.2f} s  ckpttool {' '.join(map(str, args))}", file=sys.stderr, flush=True)
    if done.returncode != 0:
        sys.exit(f"ckpttool {' '.join(map(str, args))} failed:\n{done.stderr}")
    return seconds, (json.loads(done.stdout) if "--json" in args else None)


def tail_split(wall: float, report: dict, last_ready: float | None) -> dict | None:
    """C's seconds outside the link: before the run's clock (interpreter start-up, resolving the repo and
    reading its remote headers), the run's set-up before the fetcher starts (plan, checks, staging), and
    after the last input file is verified (its conversion, the hash wait, publish). The fetcher's timeline
    starts with the execute phase."""
    phases = report.get("timing", {}).get("phases_s")
    if not phases or last_ready is None:
        return None
    end = phases.get("hash_wait", 0) + phases.get("publish", 0)
    return {"start_up": round(wall - report["seconds"], 3),
            "set_up": round(report["seconds"] - phases["execute"] - end, 3),
            "after_last_ready": round(phases["execute"] - last_ready + end, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", type=Path, required=True, help="checkpoint directory the hub serves")
    p.add_argument("--work", type=Path, required=True, help="scratch directory (emptied)")
    p.add_argument("--mp", type=int, default=8)
    p.add_argument("--rate", type=float, default=0, help="MB/s the hub sends at; 0: input bytes / conversion time")
    p.add_argument("--max-input-files", type=int, default=2)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--stream-args", action="append", default=None, metavar="ARGS",
                   help="more arguments of C, one streamed run per --stream-args ('' for none; default: one run)")
    p.add_argument("--server-cpus", type=int, default=0,
                   help="CPUs kept for the hub server (this process), the others for ckpttool; 0: all shared")
    a = p.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if not 0 <= a.server_cpus < len(cpus):
        p.error(f"--server-cpus must leave ckpttool at least one of the {len(cpus)} CPUs")
    client = set(cpus[: len(cpus) - a.server_cpus]) if a.server_cpus else None
    if a.server_cpus:  # this thread, and so the server's threads started from it
        os.sched_setaffinity(0, set(cpus[len(cpus) - a.server_cpus:]))
    shutil.rmtree(a.work, ignore_errors=True)
    a.work.mkdir(parents=True)
    convert = ("--mp", a.mp, "--device", "cpu", "--json")
    size = sum(f.stat().st_size for f in a.src.glob("*.safetensors"))
    largest = max(f.stat().st_size for f in a.src.glob("*.safetensors"))
    rows = []
    with HubServer([load_repo("bench/syn", a.src)]) as hub:
        # the tree under test first, then whatever the caller's PYTHONPATH adds (wheels carried to a machine)
        env = {**hub_env(hub.url, a.work / "home"),
               "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
        local, dl, out = a.work / "local", a.work / "dl", a.work / "out"
        hub.throttle(None)
        timed(env, client, "download", "bench/syn", local, "-q")  # unthrottled, once: B's input, in the page cache
        for rep in range(a.reps):
            hub.throttle(None)
            b, _ = timed(env, client, "convert", local, out, *convert)
            shutil.rmtree(out)
            rate = a.rate * 1e6 if a.rate else size / b
            hub.throttle(rate)
            a_s, _ = timed(env, client, "download", "bench/syn", dl, "-q")
            shutil.rmtree(dl)
            variants = a.stream_args or [""]
            for extra in (variants if rep % 2 == 0 else variants[::-1]):  # alternating which runs first
                c, report = timed(env, client, "convert", "bench/syn", out, *convert, "--max-input-files", a.max_input_files,
                                  *extra.split())
                shutil.rmtree(out)
                d = report["download"]
                ready = max((t.get("ready", 0) for t in (d.get("timeline") or {}).values()), default=None)
                phases = report.get("timing", {}).get("phases_s")
                rows.append({"rep": rep, "stream_args": extra, "ckpttool_cpus": len(client or cpus),
                             "server_cpus": a.server_cpus or "shared", "input_gb": size / 1e9, "rate_mb_s": rate / 1e6,
                             "A_download_s": a_s, "B_convert_s": b, "C_stream_s": c, "ratio": c / max(a_s, b),
                             "peak_disk_gb": d["peak_disk_bytes"] / 1e9, "output_gb": report["bytes_written"] / 1e9,
                             "largest_input_gb": largest / 1e9,
                             "C_link_busy_s": d["download_seconds"], "C_room_wait_s": d.get("room_wait_seconds"),
                             # where C's time beyond the link goes (tail_split)
                             "C_tail_s": tail_split(c, report, ready), "C_phases_s": phases,
                             "C_timeline": d.get("timeline")})  # per input file, seconds from the fetcher's start
                print(json.dumps(rows[-1]), flush=True)
    print(f"ckpttool on {len(client or cpus)} CPUs, the hub server on "
          f"{a.server_cpus or 'the same ones'}")
    print("| rep | C's arguments | input GB | link MB/s | A download s | B convert s | C streamed s | C / max(A, B) | "
          "peak disk GB (output GB + largest input GB) |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['rep']} | {r['stream_args'] or '-'} | {r['input_gb']:.2f} | {r['rate_mb_s']:.0f} "
              f"| {r['A_download_s']:.2f} | {r['B_convert_s']:.2f} | {r['C_stream_s']:.2f} | **{r['ratio']:.2f}** "
              f"| {r['peak_disk_gb']:.2f} ({r['output_gb']:.2f} + {r['largest_input_gb']:.2f}) |")


if __name__ == "__main__":
    main()
