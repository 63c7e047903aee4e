"""THE table of layouts: the planner, inspect, merge and verify read it, and no other module names a layout.

An input directory is in the first layout whose row `holds` it (HF last: it is what anything else is read as);
an output is in the layout its command names (`--layout`, or mp with `--mp N` and HF without).
"""

from __future__ import annotations

from pathlib import Path

from ckpttool.errors import InputError, did_you_mean
from ckpttool.layouts.dcp import DCP
from ckpttool.layouts.hf import HF
from ckpttool.layouts.mp import MP
from ckpttool.layouts.mp import rank_files as MP_RANK_FILES
from ckpttool.layouts.row import Layout

LAYOUTS: tuple[Layout, ...] = (DCP, MP, HF)
"""in the order an input directory is matched against them"""
NAMES: tuple[str, ...] = tuple(sorted(row.name for row in LAYOUTS))


def by_name(name: str) -> Layout:
    for row in LAYOUTS:
        if row.name == name:
            return row
    raise InputError(f"unknown layout {name!r}{did_you_mean(name, NAMES)}", fix=f"use one of {', '.join(NAMES)}")


def output_layout(name: str | None, ranks: int | None) -> Layout:
    """The layout a command writes: the one it names, else model-parallel shards with --mp N and HF without."""
    if name is None:
        return HF if ranks is None else MP
    return by_name(name)


def of_directory(path: Path) -> Layout:
    """The layout of an input directory (HF where no other row holds it: Checkpoint says what is wrong)."""
    path = Path(path)
    if not path.is_dir():
        return HF
    return next(row for row in LAYOUTS if row.holds(path))


def verify_ranks(directory: Path, mp: int | None = None) -> int:
    """The ranks of a directory `verify` loads (model-parallel shards); another per-rank layout (a DCP) is refused
    with its row's reason, anything else as no mp shards."""
    row = of_directory(directory)
    if row.verify is not None and row.per_rank:
        raise InputError(f"this is a {row.title} directory: {row.verify}", file=directory)
    return len(MP_RANK_FILES(directory, mp))
