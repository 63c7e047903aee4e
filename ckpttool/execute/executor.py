"""Execute a Plan with memory bounded by chunks in flight, never by tensor or model size.

Tasks (execute/tasks.py) run on a pool of worker threads under a byte budget; finished pieces are
made durable and journalled in batches by a committer thread, so --resume skips them. One executor
serves every command: convert, dequant, shard, quantize and merge.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from ckpttool import defaults, settings
from ckpttool.errors import check_stop
from ckpttool.execute.cuda import CudaTransforms
from ckpttool.execute.device import resolve_device
from ckpttool.execute.staging import Staging
from ckpttool.execute.gather import GatherTask
from ckpttool.execute.tasks import Task, make_tasks, run_order
from ckpttool.formats import BY_NAME, QUANTIZE_TRANSFORMS
from ckpttool.formats.outputs_stream import is_streamed
from ckpttool.io.checkpoint import ShardFiles
from ckpttool.plan.types import Plan

# Journal granularity: work done since the last commit is redone after a crash.


class MemoryBudget:
    """Bytes in flight. A task larger than the whole budget still runs, alone."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.cond = threading.Condition()

    def acquire(self, n: int) -> int:
        n = min(n, self.limit)
        with self.cond:
            self.cond.wait_for(lambda: self.used + n <= self.limit)
            self.used += n
        return n

    def release(self, n: int) -> None:
        with self.cond:
            self.used -= n
            self.cond.notify_all()


class Committer:
    """Journal commits (fdatasync of the written files, then the journal lines) on a thread of their
    own, in order, so a slow flush never stalls scheduling. The first error is re-raised to the caller."""

    def __init__(self, staging: Staging):
        self.staging = staging
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="ckpttool-commit", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (batch := self.queue.get()) is not None:
            if self.error is None:
                try:
                    self.staging.commit(batch)
                except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                    self.error = exc

    def submit(self, batch: list[tuple[str, str]]) -> None:
        if self.error is not None:
            raise self.error
        self.queue.put(list(batch))

    def close(self) -> None:
        """Wait for every queued commit; raise the first error."""
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error


def execute(plan: Plan, inputs: ShardFiles, staging: Staging, *, max_memory: int, workers: int,
            device: str = defaults.DEVICE, progress=None, files: set[str] | None = None,
            chunk_bytes: int = defaults.CHUNK_BYTES, wait_for_cuda: bool = False, abort: Future | None = None) -> None:
    """Run every task not yet in the journal; commit (fdatasync + journal) in batches. On CUDA the
    first chunks run on the CPU while the GPU starts, unless `wait_for_cuda`. An exception set on `abort`
    (another process of the run failed, execute/forked.py) is raised here as soon as it is set."""
    tasks = make_tasks(plan, inputs, staging.done, staging.published, files)
    used = sorted({t.transform for t in tasks if t.transform in BY_NAME})
    dev = resolve_device(device, sum(t.nbytes_out for t in tasks) if used else 0)
    gpu = CudaTransforms(dev, [BY_NAME[n] for n in used], staging.timings) if dev != "cpu" and used else None
    if gpu is not None and wait_for_cuda:
        gpu.wait()
    run_order(tasks, inputs)
    budget = MemoryBudget(max_memory)
    # journal granularity: work done since the last commit is redone after a crash
    commit_bytes, commit_seconds = settings.get("CKPTTOOL_JOURNAL_BYTES"), settings.get("CKPTTOOL_JOURNAL_SECONDS")
    pending: list[tuple[str, str]] = []
    pending_bytes = 0
    last_commit = time.monotonic()
    in_flight: dict[Future, tuple[Task | GatherTask, int]] = {}
    # a task's runs of rows are work items of their own (Task.row_runs): several workers stream one large
    # tensor at once, so it neither runs alone at the end nor holds every file's hashed prefix back while
    # one worker streams it (the wait for the manifest's hash, bench/HISTORY.md). Its pieces are
    # journalled once every run is written.
    runs_left: dict[int, int] = {}
    # finished futures arrive here (add_done_callback): one get per task, where concurrent.futures.wait
    # locked every future in flight on each call (1.2 s of the main thread's GIL in a 16-worker run,
    # bench/HISTORY.md)
    done: queue.SimpleQueue = queue.SimpleQueue()
    watched: Future | None = None  # the commit request's future that puts itself in `done` when asked
    if abort is not None:
        abort.add_done_callback(done.put)
    committer = Committer(staging)

    def reap(block: bool) -> None:
        nonlocal pending_bytes, last_commit, watched
        if not in_flight:
            return
        # a blocking wait still wakes to commit on time, and at once when asked (staging.commit_request):
        # a task may be waiting for an input file (hub/stream.py) that only a commit of the tasks
        # before it frees room for. With nothing pending a request waits for the next task to finish.
        asked = staging.commit_request
        if watched is not asked.future:  # a commit replaces it
            watched = asked.future
            watched.add_done_callback(done.put)
        finished = []
        try:
            finished.append(done.get(timeout=commit_seconds) if block else done.get_nowait())
            while True:
                finished.append(done.get_nowait())
        except queue.Empty:
            pass
        if abort is not None and abort.done() and abort.exception() is not None:
            raise abort.exception()
        check_stop()  # Ctrl-C or SIGTERM whose exception was swallowed where the handler ran (errors.stop)
        for fut in finished:
            if fut not in in_flight:  # the commit request, or abort
                continue
            task, held = in_flight.pop(fut)
            budget.release(held)
            written = fut.result()  # re-raises a worker's error here, in the main thread
            if _last_run(runs_left, task):
                pending.extend((file, placed.tensor.name) for file, placed in written)
                pending_bytes += task.nbytes_out
                if progress is not None:
                    progress(task.nbytes_out)
        if pending and (pending_bytes >= commit_bytes or time.monotonic() - last_commit > commit_seconds
                        or asked.asked()):
            asked.clear()
            committer.submit(pending)
            pending.clear()
            pending_bytes, last_commit = 0, time.monotonic()

    torch_threads = (_share_torch_threads(workers)
                     if any(t.transform in QUANTIZE_TRANSFORMS or is_streamed(t.transform) for t in tasks) else None)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpttool") as pool:
        failed = False
        try:
            for task in tasks:
                need = task.memory(chunk_bytes)
                runs = task.row_runs(chunk_bytes)
                runs_left[id(task)] = len(runs)
                for rows in runs:
                    while in_flight and (len(in_flight) >= workers * 2
                                         or budget.used + min(need, budget.limit) > budget.limit):
                        reap(block=True)
                    held = budget.acquire(need)
                    fut = pool.submit(task.run, inputs, staging, gpu, chunk_bytes, rows)
                    in_flight[fut] = (task, held)
                    fut.add_done_callback(done.put)
                    reap(block=False)
            while in_flight:
                reap(block=True)
        except BaseException:
            failed = True
            for fut in in_flight:
                fut.cancel()
            raise
        finally:
            if torch_threads is not None:
                torch_threads()
            # whatever finished cleanly is durable and journalled, so --resume skips it
            for fut, (task, _) in list(in_flight.items()):
                if fut.done() and not fut.cancelled() and fut.exception() is None and _last_run(runs_left, task):
                    pending.extend((file, placed.tensor.name) for file, placed in fut.result())
            if pending:
                committer.queue.put(list(pending))
            try:
                committer.close()
            except BaseException:
                if not failed:
                    raise
                # else the error already propagating is the one to report; this work is redone on --resume


def _last_run(runs_left: dict[int, int], task) -> bool:
    """Count one of `task`'s runs of rows as written; True when it was the last."""
    runs_left[id(task)] -= 1
    return runs_left[id(task)] == 0


def _share_torch_threads(workers: int) -> Callable[[], None]:
    """Quantize transforms run in torch (whole tensors, or the streamed rows of formats/outputs_stream.py): share
    the cores between workers instead of oversubscribing them. Returns the undo. (numpy transforms are one thread
    per worker anyway.)"""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, defaults.cores() // workers))
    return lambda: torch.set_num_threads(threads)
