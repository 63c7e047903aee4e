"""`python -m bench.probes.nohash ARGS` runs `ckpttool ARGS` with the manifest's hash replaced by one that does
nothing (every digest zeros): what a run would take without hashing, to weigh the hash's cost
(bench/device_run.sh phase 13, `THIS_MODULE=bench.probes.nohash`). A measurement aid, never a way to convert."""

from ckpttool.io import hashing


class _NoHash:
    def update(self, data) -> None:
        pass

    def hexdigest(self) -> str:
        return "0" * 64


hashing.new_hash = lambda algorithm=hashing.ALGORITHM: _NoHash()

from ckpttool.cli import entry  # noqa: E402 - after the patch

entry()
