"""The switch and the first-use compile shared by the numba kernels (kernels/fp8_gather.py,
kernels/scaled_numba.py). numba is optional (the `[fast]` extra): without it, or with
CKPTTOOL_NUMBA=0, each kernel's getter returns None and its caller runs numpy instead.
"""

from __future__ import annotations

import os
import threading
from typing import Callable, TypeVar

K = TypeVar("K")
_lock = threading.Lock()


def compiled_on_first_use(build: Callable[..., K]) -> Callable[[], K | None]:
    """A getter for build(numba)'s kernels: built once, by the first thread to ask (the others wait
    for it rather than compile again; njit(cache=True) makes later processes load from disk), or
    None where numba does not import or CKPTTOOL_NUMBA=0 (read on every call, so tests can flip it)."""
    built: list = []

    def get() -> K | None:
        if os.environ.get("CKPTTOOL_NUMBA", "1") == "0":
            return None
        with _lock:
            if not built:
                try:
                    import numba
                except ImportError:
                    built.append(None)
                else:
                    built.append(build(numba))
            return built[0]

    get.__doc__ = build.__doc__
    get.__name__ = build.__name__
    return get
