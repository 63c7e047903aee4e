"""Where the CUDA kernels record the first output row holding a NaN, without a launch of its own.

A flag that must start at "none" for every call needs a fill before the kernel: a second launch, which on
a [7168, 2048] FP8 tensor held the dequant at 0.70x the bandwidth of DeepSeek's kernel (no NaN check at
all) from a CUDA graph (bench/HISTORY.md). Here each device keeps a ring of int64 cells, zeroed once, and
each call takes the next epoch: its lanes that see a NaN store `epoch << 32 | (ROW_MASK - row)` by
atomic max into the epoch's cell. A cell holding an older epoch means no NaN in this call; this epoch,
the smallest bad row (the largest value). A newer epoch means a later call with a NaN took the cell
before this one was read (SLOTS calls in between): then the kernel runs again with a cell of its own
(`launched`), so the answer never rests on SLOTS being large enough.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

SLOTS = 1 << 12
"""cells per device (32 KiB): a call's cell is reused SLOTS calls later"""
ROW_MASK = (1 << 31) - 1
"""rows fit in 31 bits (a tensor's dim 0 is below 2**31); the low 32 bits hold ROW_MASK - row"""
LAST_EPOCH = (1 << 31) - 1
"""epochs fit in the high 32 bits of a signed int64; after this one, new rings and epochs from 1 again"""

_lock = threading.Lock()
_rings: dict[torch.device, torch.Tensor] = {}
_epoch = 0


class FirstBad:
    """One kernel call's record of the first row holding a NaN: pass `flags`, `slot` and `tag` to the
    kernel (lanes holding a NaN at row r atomically max `tag - r` into flags[slot]); once the kernel has
    run, `row()` (or `decode` of the cell's value, copied out with other results) gives that row or None."""

    __slots__ = ("flags", "slot", "epoch", "recheck")

    def __init__(self, flags: torch.Tensor, slot: int, epoch: int, recheck: Callable[[], int | None]):
        self.flags, self.slot, self.epoch, self.recheck = flags, slot, epoch, recheck

    @property
    def tag(self) -> int:
        return (self.epoch << 32) | ROW_MASK

    @property
    def cell(self) -> torch.Tensor:
        """The one-element int64 device tensor the kernel writes."""
        return self.flags[self.slot:self.slot + 1]

    def decode(self, value: int) -> int | None:
        """The first bad row from the cell's value read after the kernel ran, or None."""
        epoch = value >> 32
        if epoch == self.epoch:
            return ROW_MASK - (value & 0xFFFFFFFF)
        if epoch < self.epoch:
            return None
        return self.recheck()  # taken by a call SLOTS later: the kernel runs again (launched)

    def row(self) -> int | None:
        """Wait for the kernel and decode its cell."""
        return self.decode(int(self.cell.item()))


def claim(device: torch.device, recheck: Callable[[], int | None]) -> FirstBad:
    """The next epoch's cell on `device`. `recheck()`, run only after the kernel, finds the first bad row
    without this cell (rarely: see the module's docstring)."""
    global _epoch
    with _lock:
        if _epoch == LAST_EPOCH:  # two billion calls: new rings (calls not yet read keep theirs)
            _rings.clear()
            _epoch = 0
        flags = _rings.get(device)
        if flags is None:
            flags = _rings[device] = torch.zeros(SLOTS, dtype=torch.int64, device=device)
            if flags.is_cuda:  # the zeros land before any stream's kernel can store into the ring
                torch.cuda.current_stream(flags.device).synchronize()
        _epoch += 1
        return FirstBad(flags, _epoch % SLOTS, _epoch, recheck)


def launched(out: torch.Tensor, run: Callable[[torch.Tensor, FirstBad], None]) -> FirstBad:
    """`run(out, first_bad)` launches a kernel writing `out` and recording NaN rows in first_bad's cell.
    Should a later call take that cell before it is read, the recheck launches the same kernel again into
    a scratch output (the output cannot be asked: a NaN rounded to bf16 by integer arithmetic is not
    always a NaN, and the caller may have changed it) and reads that call's own cell at once. So read a
    FirstBad on the device and stream it was launched on, before its inputs change; until then it holds
    them (and the output) alive."""
    first_bad = claim(out.device, lambda: launched(torch.empty_like(out), run).row())
    run(out, first_bad)
    return first_bad
