"""The defaults every command, recipe and torchrun rank shares, and the one parser of size strings.

Declared once so that `ckpttool run RECIPE` and `ckpttool convert` behave the same unless told
otherwise, and `--help`, the recipe schema and the runner cannot drift apart.
"""

from __future__ import annotations

import os

MAX_MEMORY = "4GiB"
"""budget for tensors in flight (execution.max_memory, --max-memory)"""
MIN_MAX_MEMORY = 16 << 20
DEVICE = "auto"
"""where dequant runs (execution.device, --device): see execute/device.py for what auto picks"""
MAX_WORKERS = 16
MAX_PROCESSES = 8
CORES_PER_PROCESS = 4
"""a CPU run forks one process per this many cores, from FORK_FROM_CORES up (layout)"""
FORK_FROM_CORES = 8
MAX_SHARD_SIZE = "50GB"
"""merge's largest output file: transformers' save_pretrained default"""
MAX_INPUT_FILES = 2
"""converting straight from a hub repo id: input files on disk at once (--max-input-files,
download.max_input_files); each is deleted once every tensor read from it is durable"""
CHUNK_BYTES = 32 << 20
"""output bytes per streamed run of rows (and per worker's pinned buffer on CUDA)"""


def cores() -> int:
    """The CPUs this process may run on: its affinity mask, which taskset, cpusets and batch schedulers
    (SLURM, Kubernetes CPU pinning) narrow, rather than the machine's count, so that a job given 4 of
    64 cores starts 4 workers, not 16."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this OS
        return os.cpu_count() or 1


def workers(n: int | None = None) -> int:
    """One worker per usable core up to 12; beyond that, every core but 4; at most 16. Each worker runs
    its transforms on one core. With a worker on every core of the 16-core device the manifest's hashes
    (a thread per output file) fell behind, re-read what they missed from the page cache and held the
    end of the run: 12 workers took 0.80-0.95x the wall time of 16 there. On 4 and 8 of its cores, one
    worker fewer per four cores was 15-21% slower, so small machines keep a worker per core
    (bench/HISTORY.md)."""
    n = cores() if n is None else n
    return max(1, min(MAX_WORKERS, max(min(n, 12), n - 4)))


def layout(files: int, total_workers: int | None = None, processes: int | None = None, *, can_split: bool = True,
           to_memory: bool = True, share: int = 1) -> tuple[int, int]:
    """(processes, workers in each) for a run writing `files` output files: execution.processes and
    execution.workers (--processes, --workers: a total), each None for the default.

    One Python process's workers share one interpreter lock: on the 16-core device twelve kept twelve
    cores busy and sixteen no more, while four forked processes of four kept 15-16 busy and took 0.73-0.97x
    the time of one writing into tmpfs, median 0.84x (bench/HISTORY.md; on 8 cores two took 0.94-0.99x). So
    from FORK_FROM_CORES cores up a run that can split (CPU dequant or byte moving from a local input, on
    Linux) and writes `to_memory` (tmpfs) forks one process per CORES_PER_PROCESS cores, at most one per
    output file, and the workers default to one per core in all; otherwise it stays one process with
    workers(). Onto that machine's disk (1.3-1.8 GB/s) four processes took 1.14-1.24x the time of one, so a
    disk gets them only when asked. A split never changes the bytes: each process writes whole files. `share`:
    how many torchrun ranks of this node share its cores (each lays out its part alike).

    A process given more than CORES_PER_PROCESS cores (its count capped by the files or MAX_PROCESSES) keeps one of
    them for its files' hash threads: on 64 cores as 2 or 4 pinned nodes (bench/nodes.sh) a worker per core let the
    hashes lag and took 1.07-1.11x the time of a core left free, in 4 of 4 paired runs; one 64-core tree ran alike
    either way (bench/RESULTS.md "nodes"). A torchrun rank sharing its node with others, one process, gets the same
    (4 ranks of 8 cores per node: hash waits of 1.0-3.5 s without it, at most 0.3 s with it, 0.90-1.24x one tree)."""
    n = max(1, cores() // share)
    if processes is None:
        processes = min(MAX_PROCESSES, n // CORES_PER_PROCESS) if n >= FORK_FROM_CORES and to_memory else 1
    processes = max(1, min(processes, files)) if can_split else 1
    if processes == 1:
        if total_workers:
            return 1, total_workers
        # a torchrun rank sharing its node is laid out as a forked process of as many cores (below)
        return 1, n - 1 if share > 1 and CORES_PER_PROCESS < n == workers(n) else workers(n)
    if total_workers:
        return processes, max(1, total_workers // processes)
    each = min(n, MAX_WORKERS * processes) // processes
    return processes, each - 1 if each > CORES_PER_PROCESS else each


SIZE_UNITS = "8GB and 8G are 8 x 10^9 bytes, 8GiB is 8 x 2^30 (likewise K, M, T; KiB, MiB, TiB)"
"""what a size string means: pydantic's ByteSize (as llama.cpp's --split-max-size), said in --help and errors"""


def parse_size(text: str | int) -> int:
    """'4GiB', '512MB', '8G', or a plain byte count, read as pydantic's ByteSize reads it (SIZE_UNITS).
    Raises ValueError naming the text."""
    if isinstance(text, int):
        return text
    from pydantic import ByteSize, TypeAdapter, ValidationError  # the recipe schema has loaded pydantic already

    try:
        size = int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise ValueError(f"cannot read {text!r} as a size; use e.g. 4GiB, 512MiB or a byte count "
                         f"({SIZE_UNITS})") from None
    if size >= 1 << 63:  # no file offset or memory size is that large (ByteSize takes any integer)
        raise ValueError(f"{text[:40]!r}{'...' if len(text) > 40 else ''} is larger than any size can be (2^63 bytes)")
    return size
