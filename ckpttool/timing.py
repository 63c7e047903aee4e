"""Where a run's time went: wall seconds per phase, and thread-seconds per activity.

Workers overlap, so activity totals are summed over threads and can exceed the wall time; compared
with it they say what a run waited on: reads, dequant, page-cache writes, flushes to disk, hashing.
`--json` reports both (and a few counts, such as chunks transformed on the GPU and on the CPU), and
the benchmark records them. Under torchrun rank 0's report also holds every rank's timeline (`ranks`: when its
process started, when it began converting, its phases and when it reached the final barrier, in seconds after
the earliest process start), so where a multi-node run's time goes is read from one report.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path


class Timings:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.phases: dict[str, float] = {}
        self.busy: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.ranks: list[dict] | None = None  # under torchrun, on rank 0: every rank's timeline (rank_timeline)
        self.began = time.time()  # wall clock when this run began (the timeline's "convert")

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[what] = self.counts.get(what, 0) + n

    def add(self, activity: str, seconds: float) -> None:
        self._add(self.busy, activity, seconds)

    def activity(self, name: str):
        """Time a block as thread-seconds of `name` (blocks on several threads add up)."""
        return self._timed(self.busy, name)

    def phase(self, name: str):
        """Time a block as wall seconds of the run's phase `name`."""
        return self._timed(self.phases, name)

    def _add(self, store: dict[str, float], key: str, seconds: float) -> None:
        with self._lock:
            store[key] = store.get(key, 0.0) + seconds

    @contextmanager
    def _timed(self, store: dict[str, float], key: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self._add(store, key, time.perf_counter() - t)

    def merge(self, other: dict) -> None:
        """Add another process's thread-seconds and counts (a forked rank's to_json()); its phases are its own."""
        for k, v in other.get("thread_s", {}).items():
            self.add(k, v)
        for k, v in other.get("counts", {}).items():
            self.count(k, v)

    def to_json(self) -> dict:
        with self._lock:
            return {"phases_s": {k: round(v, 3) for k, v in self.phases.items()},
                    "thread_s": {k: round(v, 3) for k, v in sorted(self.busy.items())},
                    **({"counts": dict(sorted(self.counts.items()))} if self.counts else {}),
                    **({"ranks": self.ranks} if self.ranks is not None else {})}

    def rank_note(self, rank: int) -> dict:
        """What this rank contributes to the timeline, as wall-clock times: its process's start, its run's, now."""
        return {"rank": rank, "process": process_started(), "convert": self.began, "barrier": time.time(),
                "phases_s": self.to_json()["phases_s"]}


def rank_timeline(notes: list[dict]) -> list[dict]:
    """Every rank's note with its times made seconds after the earliest process start (or run start)."""
    zero = min(n["process"] or n["convert"] for n in notes)
    rel = lambda v: None if v is None else round(v - zero, 3)  # noqa: E731
    return [{**n, "process": rel(n["process"]), "convert": rel(n["convert"]), "barrier": rel(n["barrier"])}
            for n in notes]


def process_started() -> float | None:
    """This process's start as wall-clock seconds (Linux /proc; None elsewhere): the timeline's import cost."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None
