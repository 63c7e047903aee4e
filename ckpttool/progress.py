"""Byte-based progress on stderr, silent with --quiet or when nothing is to be done: a rich bar on a
terminal; elsewhere (CI logs, `2> file`) a plain line every few seconds and one at the end, since a
bar redrawn in place is invisible or garbage there."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from rich.progress import BarColumn, DownloadColumn, Progress as RichProgress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

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


class Progress:
    def __init__(self, total: int, label: str, *, quiet: bool = False, stream: TextIO | None = None,
                 interval: float = LINE_INTERVAL_S):
        self.enabled = not quiet and total > 0
        self.total, self.label, self.interval = total, label, interval
        self._stream = stream or sys.stderr
        self._bar = None
        self._lines = False
        self._done = 0
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._next = self._start + interval
        if not self.enabled:
            return
        if self._stream.isatty():
            from rich.console import Console

            self._bar = RichProgress(
                TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                TimeRemainingColumn(), console=Console(file=self._stream), transient=False,
            )
            self._task = self._bar.add_task(label, total=total)
        else:
            self._lines = True

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)
        elif self._lines:
            with self._lock:
                self._done += n
                if time.monotonic() >= self._next:
                    self._line()
                    self._next = time.monotonic() + self.interval

    def _line(self, final: bool = False) -> None:
        elapsed = max(time.monotonic() - self._start, 1e-9)
        rate = self._done / elapsed
        pct = 100.0 * self._done / self.total
        tail = f"in {_clock(elapsed)}" if final else (
            f"ETA {_clock((self.total - self._done) / rate)}" if rate > 0 else "ETA ?")
        print(f"{self.label}: {_size(self._done)} / {_size(self.total)} ({pct:.0f}%), {_size(rate)}/s, {tail}",
              file=self._stream, flush=True)

    def __enter__(self) -> "Progress":
        if self._bar is not None:
            self._bar.start()
        self._start = time.monotonic()
        self._next = self._start + self.interval
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
        elif self._lines and exc[0] is None:
            with self._lock:
                self._line(final=True)
