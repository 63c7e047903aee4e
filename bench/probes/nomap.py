"""`python -m bench.probes.nomap ARGS` runs `ckpttool ARGS` with an input in RAM read by pread into each worker's
reusable buffer, as before mapped reads (io/checkpoint.py `mapped_range`): what the mappings save or
cost a run. A measurement aid, never a way to convert."""

from ckpttool.execute import tasks
from ckpttool.io.checkpoint import ShardFiles

_read_rows = ShardFiles.read_rows


def _pread_rows(self, fname, info, r0, r1, into=None, *, mapped=False):
    if mapped:  # the buffer the CPU path used before
        row_bytes = info.nbytes // info.shape[0] if info.shape[0] else 0
        into = tasks.scratch("in", (r1 - r0) * row_bytes)
    return _read_rows(self, fname, info, r0, r1, into)


ShardFiles.read_rows = _pread_rows

from ckpttool.cli import entry  # noqa: E402 - after the patch

entry()
