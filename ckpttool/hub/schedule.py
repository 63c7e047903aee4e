"""The order a conversion reads its input files in, and what streaming them costs in disk and time.

The executor runs a stream's tasks in read order (execute.tasks.run_order); each input file is needed
from its first task to its last. Fetching files in first-use order with room for K on disk cannot deadlock
when K is at least the most files some task window needs at once (most_live).
"""

from __future__ import annotations

from ckpttool.execute.tasks import make_tasks, run_order
from ckpttool.hub.remote import RemoteCheckpoint, measure_rate
from ckpttool.plan.types import Plan

RATE_PROBE_BYTES = 16 << 20  # `plan REPO_ID` times one range request of this much (read, then dropped)


def schedule(plan: Plan, inputs: RemoteCheckpoint, done=frozenset(), published=frozenset(),
             files: set[str] | None = None) -> tuple[list, dict[str, int], dict[str, int]]:
    """The executor's tasks in its order (execute.tasks.run_order: read order for a stream), and each
    input file's first and last task."""
    tasks = run_order(make_tasks(plan, inputs, done, published, files), inputs)
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, task in enumerate(tasks):
        for f in reads(task):
            first.setdefault(f, i)
            last[f] = i
    return tasks, first, last


def reads(task) -> tuple[str, ...]:
    return task.files


def stream_plan(ckpt: RemoteCheckpoint, plan: Plan, disk_needed: int, max_files: int) -> dict:
    """What `plan REPO_ID` adds: the disk of streaming (the output and at most K input files) and of
    downloading first (the output and every file `download` would fetch), and the expected download time."""
    repo = ckpt.repo
    _, first, last = schedule(plan, ckpt)
    cached = {f for f in repo.files if repo.cached(f) is not None}
    streamed = [f for f in first if f not in cached]
    need = most_live(first, last, streamed)
    k = max(max_files, need)
    fetch = sum(repo.files[f].size or 0 for f in streamed)
    rate = measure_rate(repo, RATE_PROBE_BYTES)
    return {"repo_id": repo.repo_id, "commit": repo.commit, "input_files": len(first), "input_bytes": ckpt.input_bytes(),
            "files_in_hf_cache": sorted(cached & set(first)), "bytes_to_fetch": fetch,
            "max_input_files": k, "input_files_needed_at_once": need,
            "disk_needed_streaming": disk_needed + sum(sorted((repo.files[f].size or 0 for f in streamed),
                                                              reverse=True)[:k]),
            "disk_needed_download_first": disk_needed + sum(f.size or 0 for n, f in repo.files.items() if n not in cached),
            "download_rate": round(rate) if rate else None,
            "expected_download_seconds": round(fetch / rate, 1) if rate else None}


def most_live(first: dict[str, int], last: dict[str, int], streamed: list[str]) -> int:
    """The most streamed files some task window needs on disk at once (a scale kept in the last file
    keeps that file live from the first task on): the smallest K that cannot deadlock."""
    starts: dict[int, int] = {}
    ends: dict[int, int] = {}
    for f in streamed:
        starts[first[f]] = starts.get(first[f], 0) + 1
        ends[last[f]] = ends.get(last[f], 0) + 1
    live = best = 0
    for i in sorted(set(starts) | set(ends)):
        live += starts.get(i, 0)
        best = max(best, live)
        live -= ends.get(i, 0)
    return best
