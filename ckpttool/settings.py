"""Every setting ckpttool reads from the environment, declared once here and read when it is used (never at
import, so a test or a caller may set one before the call that needs it), and documented by its entry in
SETTINGS (README's Settings table is checked against it by tests/test_settings.py). No module writes the
environment on import; the entry point (`ckpttool.__main__`) sets the two library knobs ckpttool needs before
numpy and pydantic load (`library_defaults`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True, slots=True)
class Setting:
    name: str
    default: str
    parse: Callable[[str], object]
    doc: str

    def get(self):
        """Its value now: the environment's, else the default, parsed (a value that does not parse is the
        default's, as a mistyped knob should not stop a conversion)."""
        raw = os.environ.get(self.name)
        if raw is not None:
            try:
                return self.parse(raw)
            except ValueError:
                pass
        return self.parse(self.default)


def _flag(text: str) -> bool:
    return text.strip() not in ("", "0")


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("CKPTTOOL_DEBUG", "0", _flag, "1: print the traceback behind an error (as `ckpttool -v`)"),
    Setting("CKPTTOOL_NATIVE", "1", _flag, "0: do not use the C loops built at install (numba's or numpy's instead; the same bits)"),
    Setting("CKPTTOOL_NUMBA", "1", _flag, "0: do not use numba's loops (C's, else numpy's; the same bits)"),
    Setting("CKPTTOOL_SIMD", "2", int, "cap the C loops' vector instructions: 0 none, 1 SSSE3, 2 AVX2 (the same bits)"),
    Setting("CKPTTOOL_JOURNAL_BYTES", str(1 << 30), int, "bytes written between two journal commits (work a crash redoes)"),
    Setting("CKPTTOOL_JOURNAL_SECONDS", "2.0", float, "seconds between two journal commits, at most"),
    Setting("CKPTTOOL_RANK_TIMEOUT_S", "60", float, "a forked rank silent this long is ended and fails the run, named"),
    Setting("CKPTTOOL_JOIN_TIMEOUT_S", "300", float, "how long a torchrun rank or a node waits for the others to join"),
    Setting("CKPTTOOL_NODES", "", str, "`HOST:PORT,N,R`: this process is node R of N running the same command, node 0 "
            "listening on HOST:PORT (several machines without torchrun or torch; docs/performance.md)"),
    Setting("CKPTTOOL_HUB_STALL_S", "30", float, "a hub transfer that makes no progress this long is given up"),
    Setting("CKPTTOOL_HUB_MIN_BYTES", str(256 << 10), int, "the bytes a hub transfer must move in each stall window"),
    Setting("CKPTTOOL_FAULT", "", str, "tests only: a failpoint, point:n[:kill|enospc|stop][@rank] (faults.py)"),
)}


def get(name: str):
    """A setting's value now (KeyError for a name not declared above: every setting is declared once)."""
    return SETTINGS[name].get()


LIBRARY_DEFAULTS = {
    # OpenBLAS starts a thread per core that spins for work ckpttool never gives it (no CPU path calls BLAS;
    # verify's torch has its own threads): on the 2-core box they took 7% of a shard's CPU time.
    "OPENBLAS_NUM_THREADS": "1",
    # pydantic's plugin lookup reads every installed package's entry points when the first model is built:
    # 0.05-0.15 s of each run's start in an environment of 197 packages. Only our own recipes are validated.
    "PYDANTIC_DISABLE_PLUGINS": "__all__",
}
"""what the entry point sets before numpy and pydantic load, where the user has not set it"""


def library_defaults() -> None:
    for name, value in LIBRARY_DEFAULTS.items():
        os.environ.setdefault(name, value)
