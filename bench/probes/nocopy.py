"""`python -m bench.probes.nocopy ARGS` runs `ckpttool ARGS` with the kernel's copies (copy_file_range) turned
off, so byte-moving pieces are read and written like the rest: what copy_file_range saves or costs a run
on a given filesystem. A measurement aid, never a way to convert."""

from ckpttool.execute.staging import Staging

Staging.copy_range = lambda self, *args: False

from ckpttool.cli import entry  # noqa: E402 - after the patch

entry()
