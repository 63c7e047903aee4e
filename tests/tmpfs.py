"""A small real tmpfs for tests of a full disk: mounted for the test, unmounted after. Mounting needs
privileges (root, or CAP_SYS_ADMIN); without them the test is skipped with a reason that says so."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str):
    """A tmpfs of `size` (e.g. "24m") mounted at `where` for the block's duration."""
    where.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a {size} tmpfs here (needs root or CAP_SYS_ADMIN): "
                    f"{proc.stderr.decode(errors='replace').strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)
