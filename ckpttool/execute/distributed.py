"""Conversion across processes (`torchrun ... -m ckpttool convert ...`, one node or several with a
shared filesystem; or the same command on N machines with CKPTTOOL_NODES=HOST:PORT,N,R, no torch): every rank plans
the same thing from headers, takes its share of the output files, and rank 0 sets up the staging directory before
and publishes after. torch.distributed (gloo) under torchrun, or execute/rendezvous.py's sockets, carry only rank 0's
set-up outcome and each rank's flag and timeline at the end; tensors never cross processes."""

from __future__ import annotations

import os
from datetime import timedelta

from ckpttool import errors, settings
from ckpttool.errors import CkptError
from ckpttool.execute import rendezvous
from ckpttool.plan.types import Plan
from ckpttool.timing import Timings, rank_timeline

TORCHRUN_VARS = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""what torchrun sets in every process it launches: all of them, or this is not a torchrun launch"""
RUN_TIMEOUT = timedelta(seconds=rendezvous.RUN_TIMEOUT_S)
"""barriers after joining: a fast rank waits for the slowest rank's share of the files"""


def launched_by_torchrun() -> bool:
    """Only a full torchrun environment counts: a RANK or WORLD_SIZE left over in a shell does not."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def nodes_setting() -> tuple[str, int, int, int] | None:
    """CKPTTOOL_NODES as (host, port, nodes, rank), or None where unset; refused beside a torchrun launch."""
    text = settings.get(rendezvous.SETTING).strip()
    if not text:
        return None
    if launched_by_torchrun():
        raise CkptError(f"both torchrun and {rendezvous.SETTING} say how many processes run",
                        fix=f"unset {rendezvous.SETTING} under torchrun, or start without torchrun")
    return rendezvous.parse_nodes(text)


def world() -> tuple[int, int]:
    """(rank, world size) under torchrun or CKPTTOOL_NODES; (0, 1) otherwise, whatever stray variables say."""
    if not launched_by_torchrun():
        nodes = nodes_setting()
        return (0, 1) if nodes is None else (nodes[3], nodes[2])
    try:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError:
        rank, size = -1, -1
    if not 0 <= rank < size:
        raise CkptError(f"torchrun environment has RANK={os.environ['RANK']!r}, WORLD_SIZE={os.environ['WORLD_SIZE']!r}",
                        fix="launch with torchrun, or unset " + ", ".join(TORCHRUN_VARS) + " for a single process")
    return rank, size


def _join_error(exc: Exception) -> CkptError:
    seen = ", ".join(f"{v}={os.environ.get(v)}" for v in TORCHRUN_VARS)
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    return CkptError(f"rank {os.environ.get('RANK')} could not join the other torchrun ranks within "
                     f"{settings.get('CKPTTOOL_JOIN_TIMEOUT_S'):.0f} s ({first})",
                     fix=f"check that every rank was started and can reach MASTER_ADDR:MASTER_PORT ({seen}); for a "
                         f"single-process run, unset those variables")


def local_world_size() -> int:
    """The torchrun ranks on this node (LOCAL_WORLD_SIZE): they share its cores. 1 outside torchrun."""
    if not launched_by_torchrun():
        return 1
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def assign_files(plan: Plan, world_size: int, among: set[str] | None = None) -> list[set[str]]:
    """Largest file first to the least-loaded rank: deterministic, so every rank computes the same. `among`:
    only these files (a torchrun rank's share, dealt again to its forked processes)."""
    loads = [0] * world_size
    shares: list[set[str]] = [set() for _ in range(world_size)]
    for f in sorted((f for f in plan.files if among is None or f.name in among), key=lambda f: (-f.size, f.name)):
        r = min(range(world_size), key=lambda i: (loads[i], i))
        shares[r].add(f.name)
        loads[r] += f.size
    return shares


class Group:
    """The ranks of one run when world size > 1: torch.distributed's gloo under torchrun, execute/rendezvous.py's
    sockets under CKPTTOOL_NODES; a no-op otherwise (and torch is not imported)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self._owned = False
        self.dist = self.sockets = None
        if world_size == 1:
            return
        if not launched_by_torchrun():
            host, port, nodes, _ = nodes_setting()
            self.sockets = rendezvous.SocketGroup(host, port, nodes, rank, identity=rendezvous.run_identity(),
                                                  join_timeout=settings.get("CKPTTOOL_JOIN_TIMEOUT_S"))
            return
        import torch.distributed as dist

        self.dist = dist
        if not dist.is_initialized():
            try:
                dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                        timeout=timedelta(seconds=settings.get("CKPTTOOL_JOIN_TIMEOUT_S")))
            except Exception as exc:  # torch raises DistStoreError, RuntimeError or ValueError here
                raise _join_error(exc) from None
            self._owned = True
            dist.distributed_c10d._set_pg_timeout(RUN_TIMEOUT)

    def _broadcast(self, obj: object) -> object:
        if self.sockets is not None:
            return self.sockets.broadcast(obj)
        box = [obj]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def _all_gather(self, obj: object) -> list:
        if self.sockets is not None:
            return self.sockets.all_gather(obj)
        everyone = [None] * self.world_size
        self.dist.all_gather_object(everyone, obj)
        return everyone

    def share_outcome(self, error: CkptError | None, value: object = None) -> object:
        """Rank 0's set-up result reaches every rank: all raise the same error, or all get rank 0's
        `value` (what it decided, so no rank re-derives it from the disk)."""
        if self.world_size == 1:
            if error is not None:
                raise error
            return value
        err = None if error is None else (type(error).__name__, error.message,
                                          None if error.file is None else str(error.file), error.tensor, error.fix)
        err, value = self._broadcast([err, value])
        if err is not None:
            if self.rank == 0 and error is not None:
                raise error
            name, message, file, tensor, fix = err
            cls = next((c for c in _subclasses(errors.CkptError) if c.__name__ == name), CkptError)
            raise cls(message, file=file, tensor=tensor, fix=fix)
        return value

    def all_ok(self, ok: bool, clock: Timings | None = None) -> bool:
        """True only if every rank finished its share. With the run's `clock`, rank 0's also gets every rank's
        timeline (`Timings.ranks`)."""
        if self.world_size == 1:
            return ok
        flags = self._all_gather([ok, None if clock is None else clock.rank_note(self.rank)])
        if clock is not None and self.rank == 0:
            clock.ranks = rank_timeline([f[1] for f in flags])
        return all(f[0] for f in flags)

    def close(self) -> None:
        if self.sockets is not None:
            self.sockets.close()
        if self._owned:
            self.dist.destroy_process_group()


def _subclasses(cls: type) -> list[type]:
    """ckpttool's error classes, as imported now: rank 0's error is rebuilt by its class's name on every rank."""
    return [cls] + [s for c in cls.__subclasses__() for s in _subclasses(c)]

