"""The switch and the first-use compile shared by the numba kernels (kernels/fp8_gather.py,
kernels/scaled_numba.py). numba is optional (the `[fast]` extra): without it, or with
CKPTTOOL_NUMBA=0, each kernel's getter returns None and its caller runs numpy instead (the same bits).

Loading numba and its cached kernels takes 0.6-2 s (and compiling them, on a machine's first run,
longer). A conversion calls warm_up() first: the kernels are then built on a thread of their own and,
until each is ready, its getter returns None, so the workers dequantize with numpy meanwhile instead of
waiting on the build (on the H100 machine 16 workers spent 12% of their samples waiting there,
bench/RESULTS.md). CKPTTOOL_NUMBA=1 waits for the build instead.
"""

from __future__ import annotations

import os
import threading
from typing import Callable, TypeVar

K = TypeVar("K")
_lock = threading.Lock()
_warming: set = set()  # getters being built by warm_up's thread


def _mode() -> str:
    """'0' off, '1' on and waited for, '' (unset) on, numpy meanwhile after warm_up(); read on every call,
    so tests can flip it."""
    return os.environ.get("CKPTTOOL_NUMBA", "")


def compiled_on_first_use(build: Callable[..., K]) -> Callable[[], K | None]:
    """A getter for build(numba)'s kernels: built once, by the first thread to ask (the others wait
    for it rather than compile again; njit(cache=True) makes later processes load from disk), or
    None where numba does not import or CKPTTOOL_NUMBA=0; None too while warm_up's thread builds it."""
    built: list = []

    def build_now() -> K | None:
        with _lock:
            if not built:
                try:
                    import numba
                except ImportError:
                    built.append(None)
                else:
                    built.append(build(numba))
            return built[0]

    def get() -> K | None:
        mode = _mode()
        if mode == "0":
            return None
        if mode != "1" and get in _warming:
            return None
        if built:
            return built[0]
        return build_now()

    get.__doc__ = build.__doc__
    get.__name__ = build.__name__
    get.build_now, get.built, get.exercise = build_now, built, None
    return get


def warm_up(getters: list) -> threading.Thread | None:
    """Build these kernels (those not built yet) on a thread of their own, and call each getter's
    `exercise` with the kernel (tiny calls with the argument types of the real ones), their getters
    returning None until each is ready (unless CKPTTOOL_NUMBA=1). The thread (not a daemon: a compile writing numba's
    on-disk cache is not cut off at exit), or None when there is nothing to build."""
    if _mode() == "0":
        return None
    with _lock:
        todo = [g for g in dict.fromkeys(getters) if not g.built and g not in _warming]
        _warming.update(todo)
    if not todo:
        return None

    def run() -> None:
        for g in todo:
            try:
                kernel = g.build_now()
                if kernel is not None and g.exercise is not None:  # compiled, or loaded from numba's cache,
                    g.exercise(kernel)  # per signature: else the first worker's call loads it and the others wait
            except Exception:  # noqa: BLE001 - built again, and raised, where a worker asks for it
                pass
            finally:
                _warming.discard(g)

    thread = threading.Thread(target=run, name="ckpttool-numba")
    thread.start()
    return thread
