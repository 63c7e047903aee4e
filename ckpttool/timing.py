"""Where a run's time went: wall seconds per phase, and thread-seconds per activity.

Workers overlap, so activity totals are summed over threads and can exceed the wall time; compared
with it they say what a run waited on: reads, dequant, page-cache writes, flushes to disk, hashing.
`--json` reports both (and a few counts, such as chunks transformed on the GPU and on the CPU), and
the benchmark records them.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager


class Timings:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.phases: dict[str, float] = {}
        self.busy: dict[str, float] = {}
        self.counts: dict[str, int] = {}

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
                    **({"counts": dict(sorted(self.counts.items()))} if self.counts else {})}
