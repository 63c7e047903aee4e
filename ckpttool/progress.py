"""Byte-based progress on stderr, silent with --quiet or when nothing is to be done: a rich bar on a
terminal; elsewhere (CI logs, `2> file`) a plain line every few seconds and one at the end, since a
bar redrawn in place is invisible or garbage there."""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable, TextIO

LINE_INTERVAL_S = 10.0


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return f"{n:.1f} TB"


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class _Row:
    def __init__(self, label: str, total: int):
        self.label, self.total, self.done, self.start = label, total, 0, time.monotonic()


class Progress:
    """One row (what the run writes); `add_row` adds another, e.g. the download of a run streamed
    from the hub, so each rate is shown on its own."""

    def __init__(self, total: int, label: str, *, quiet: bool = False, stream: TextIO | None = None,
                 interval: float = LINE_INTERVAL_S):
        self.enabled = not quiet and total > 0
        self.total, self.label, self.interval = total, label, interval
        self._stream = stream or sys.stderr
        self._bar = None
        self._lines = False
        self._rows = [_Row(label, total)]
        self._lock = threading.Lock()
        self._next = time.monotonic() + interval
        if not self.enabled:
            return
        if self._stream.isatty():  # rich only here: its import is 30 ms of every run's start, for a bar
            from rich.console import Console
            from rich.progress import (BarColumn, DownloadColumn, Progress as RichProgress, TextColumn,
                                       TimeRemainingColumn, TransferSpeedColumn)

            self._bar = RichProgress(
                TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                TimeRemainingColumn(), console=Console(file=self._stream), transient=False,
            )
            self._tasks = [self._bar.add_task(label, total=total)]
        else:
            self._lines = True

    def add_row(self, label: str, total: int) -> Callable[[int], None]:
        """Another row, shown above the first; returns its `advance`."""
        row = _Row(label, total)
        self._rows.insert(0, row)
        if self._bar is not None:
            task = self._bar.add_task(label, total=total)
            return lambda n: self._bar.advance(task, n)
        return lambda n: self._advance(row, n)

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._tasks[0], n)
        else:
            self._advance(self._rows[-1], n)

    def _advance(self, row: _Row, n: int) -> None:
        if not self._lines:
            return
        with self._lock:
            row.done += n
            if time.monotonic() >= self._next:
                for r in self._rows:
                    self._line(r)
                self._next = time.monotonic() + self.interval

    def _line(self, row: _Row, final: bool = False) -> None:
        elapsed = max(time.monotonic() - row.start, 1e-9)
        rate = row.done / elapsed
        pct = 100.0 * row.done / max(row.total, 1)
        tail = f"in {_clock(elapsed)}" if final else (
            f"ETA {_clock((row.total - row.done) / rate)}" if rate > 0 else "ETA ?")
        print(f"{row.label}: {_size(row.done)} / {_size(row.total)} ({pct:.0f}%), {_size(rate)}/s, {tail}",
              file=self._stream, flush=True)

    def __enter__(self) -> "Progress":
        if self._bar is not None:
            self._bar.start()
        for row in self._rows:
            row.start = time.monotonic()
        self._next = time.monotonic() + self.interval
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
        elif self._lines and exc[0] is None:
            with self._lock:
                for row in self._rows:
                    self._line(row, final=True)
