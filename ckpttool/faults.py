"""Failpoints for crash-safety tests: CKPTTOOL_FAULT=point:n[:action][@rank] makes the n-th hit of a named
point kill the process (action `kill`, the default: SIGKILL, no cleanup) or raise ENOSPC (`enospc`), or
stop it (`stop`: SIGSTOP, to hold a run mid-write). Hits count per process; `@rank` arms it only in that
rank of a run split over forked processes (execute/forked.py; 0 is the parent), else in every process.
Unset, each point costs one dict lookup."""

from __future__ import annotations

import errno
import os
import signal
import threading

_spec = os.environ.get("CKPTTOOL_FAULT")
_target = None
_rank = None
if _spec:
    _spec, _, _only = _spec.partition("@")
    _name, _n, *_action = _spec.split(":")
    _target = (_name, int(_n), _action[0] if _action else "kill")
    _rank = int(_only) if _only else None
RANK = 0
"""this process's rank in a forked run (forked._child sets it)"""
_counts: dict[str, int] = {}
_lock = threading.Lock()


def point(name: str) -> None:
    if _target is None or _target[0] != name or _rank not in (None, RANK):
        return
    with _lock:
        _counts[name] = _counts.get(name, 0) + 1
        hit = _counts[name] == _target[1]
    if hit and _target[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if hit and _target[2] == "stop":  # SIGSTOP: a run paused mid-write, holding what it holds
        # to this thread: sent to the process, another thread may take it and this one write on meanwhile
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
    if hit and _target[2] == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
