"""Conversion across processes (`torchrun ... -m ckpttool convert ...`, one node or several with a
shared filesystem): every rank plans the same thing from headers, takes its share of the output
files, and rank 0 sets up the staging directory before and publishes after. torch.distributed
(gloo) carries only barriers and rank 0's set-up outcome; tensors never cross processes."""

from __future__ import annotations

import os
from datetime import timedelta

from ckpttool.errors import CkptError
from ckpttool.plan.types import Plan


def world() -> tuple[int, int]:
    """(rank, world size) from the torchrun environment; (0, 1) outside it."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ and "WORLD_SIZE" in os.environ


def assign_files(plan: Plan, world_size: int) -> list[set[str]]:
    """Largest file first to the least-loaded rank: deterministic, so every rank computes the same."""
    loads = [0] * world_size
    shares: list[set[str]] = [set() for _ in range(world_size)]
    for f in sorted(plan.files, key=lambda f: (-f.size, f.name)):
        r = min(range(world_size), key=lambda i: (loads[i], i))
        shares[r].add(f.name)
        loads[r] += f.size
    return shares


class Group:
    """A gloo group for barriers when world size > 1; a no-op otherwise (and torch is not imported)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self._owned = False
        self.dist = None
        if world_size == 1:
            return
        import torch.distributed as dist

        self.dist = dist
        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(hours=12))
            self._owned = True

    def share_outcome(self, error: CkptError | None, value: object = None) -> object:
        """Rank 0's set-up result reaches every rank: all raise the same error, or all get rank 0's
        `value` (what it decided, so no rank re-derives it from the disk)."""
        if self.world_size == 1:
            if error is not None:
                raise error
            return value
        err = None if error is None else (type(error), error.message, error.file, error.tensor, error.fix)
        box = [(err, value)]
        self.dist.broadcast_object_list(box, src=0)
        err, value = box[0]
        if err is not None:
            if self.rank == 0 and error is not None:
                raise error
            cls, message, file, tensor, fix = err
            raise cls(message, file=file, tensor=tensor, fix=fix)
        return value

    def all_ok(self, ok: bool) -> bool:
        """True only if every rank finished its share."""
        if self.world_size == 1:
            return ok
        flags = [None] * self.world_size
        self.dist.all_gather_object(flags, ok)
        return all(flags)

    def close(self) -> None:
        if self._owned:
            self.dist.destroy_process_group()
