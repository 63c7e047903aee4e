"""How many cores a command keeps busy over its run, and the memory it holds: samples the CPU time
of the process and of the processes it forked (all their threads, /proc/PID/stat) every TICK seconds,
and their summed RSS and PSS. Prints one JSON object: wall s, CPU s, peak RSS and PSS, the busy cores
of each tenth of the run and of each BIN seconds, and the command's own JSON output where it printed
one. A conversion that leaves cores idle while it is slower than the write ceiling waits on something
(a lock, the memory); one that keeps every core busy needs less work per byte.

    python -m bench.probes.cpu_timeline -- ckpttool convert SRC DST --mp 8 --dtype bf16 --quiet
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import threading
import time

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (fields 14 and 15 of stat)


def tree(pid: int) -> list[int]:
    """`pid` and its descendants (a run's forked ranks)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) in KiB: PSS splits the pages forked processes share between them, so its sum over a
    tree is what the tree holds."""
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1])
    except OSError:
        pass
    return rss, pss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tick", type=float, default=0.02)
    p.add_argument("--bin", type=float, default=0.1)
    p.add_argument("command", nargs=argparse.REMAINDER)
    a = p.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE)
    out = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read()))
    reader.start()
    samples = [(0.0, 0.0)]
    done: dict[int, float] = {}  # a child's last CPU seconds, kept once it is gone
    peak_rss = peak_pss = 0
    while proc.poll() is None:
        time.sleep(a.tick)
        pids = tree(proc.pid)
        for p in pids:
            c = cpu_seconds(p)
            if c is not None:
                done[p] = c
        mem = [memory_kib(p) for p in pids]
        peak_rss, peak_pss = max(peak_rss, sum(m[0] for m in mem)), max(peak_pss, sum(m[1] for m in mem))
        if proc.poll() is None:
            samples.append((time.perf_counter() - t0, sum(done.values())))
    wall = time.perf_counter() - t0
    reader.join()
    cpu = os.times()
    total = cpu.children_user + cpu.children_system
    try:
        report = json.loads(out[0])
    except ValueError:
        report = None
    print(json.dumps({"rc": proc.returncode, "wall_s": round(wall, 3), "cpu_s": round(total, 2),
                      "peak_rss_gib": round(peak_rss / 2**20, 3), "peak_pss_gib": round(peak_pss / 2**20, 3),
                      "busy_cores_by_tenth": busy(samples, wall / 10, 10),
                      f"busy_cores_by_{a.bin}_s": busy(samples, a.bin, math.ceil(wall / a.bin)),
                      "report": report}))


def busy(samples: list[tuple[float, float]], width: float, bins: int) -> list[float | None]:
    """Cores busy in each of `bins` intervals of `width` seconds (None where under two samples fell)."""
    out = []
    for k in range(bins):
        inside = [s for s in samples if width * k <= s[0] <= width * (k + 1)]
        out.append(round((inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0]), 1)
                   if len(inside) >= 2 and inside[-1][0] > inside[0][0] else None)
    return out


if __name__ == "__main__":
    main()
