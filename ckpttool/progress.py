"""Byte-based progress on stderr (rich), silent with --quiet or when nothing is to be done."""

from __future__ import annotations

import sys

from rich.progress import BarColumn, DownloadColumn, Progress as RichProgress, TextColumn, TimeRemainingColumn, TransferSpeedColumn


class Progress:
    def __init__(self, total: int, label: str, *, quiet: bool = False):
        self.enabled = not quiet and total > 0
        self._bar = None
        if self.enabled:
            from rich.console import Console

            self._bar = RichProgress(
                TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                TimeRemainingColumn(), console=Console(file=sys.stderr), transient=False,
            )
            self._task = self._bar.add_task(label, total=total)

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def __enter__(self) -> "Progress":
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
