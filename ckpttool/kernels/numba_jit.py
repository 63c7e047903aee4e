"""The switch and the first-use compile shared by the numba kernels (kernels/fp8_gather.py,
kernels/scaled_numba.py). numba is optional (the `[fast]` extra): without it, or with
CKPTTOOL_NUMBA=0, each kernel's getter returns None and its caller runs numpy instead.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Callable, TypeVar

from ckpttool import settings

K = TypeVar("K")
_lock = threading.Lock()


def in_use() -> bool:
    """Whether numba's loops run in this process: it imports, and CKPTTOOL_NUMBA=0 (read on every call,
    so tests can flip it) does not turn it off. Imports numba but builds no kernel."""
    return settings.get("CKPTTOOL_NUMBA") and _numba() is not None


@functools.lru_cache(maxsize=None)
def _numba():
    try:
        import numba
    except ImportError:
        return None
    return numba


def compiled_on_first_use(build: Callable[..., K]) -> Callable[[], K | None]:
    """A getter for build(numba)'s kernels: built once, by the first thread to ask (the others wait
    for it rather than compile again; njit(cache=True) makes later processes load from disk), or
    None where numba is not in use (`in_use`)."""
    built: list = []

    def get() -> K | None:
        if not in_use():
            return None
        with _lock:
            if not built:
                _registries_without_scipy_blas()
                built.append(build(_numba()))
            return built[0]

    get.__doc__ = build.__doc__
    get.__name__ = build.__name__
    return get


def _registries_without_scipy_blas() -> None:
    """Import numba's array implementations with scipy.linalg's BLAS hidden. Loading the first cached
    kernel imports them (numba.np.arraymath), and they import scipy.linalg only to learn whether BLAS is
    there for np.dot and its kin, which no kernel of ours uses: on the H100 machine that import was
    0.6 s of every conversion's start, while every worker waited for the kernel. Without it numba uses
    its own loops for those functions in this process; scipy itself imports as before once we are done.
    bench/HISTORY.md: 0.87x and 0.95x the wall time of the same tree with it, 16 cores."""
    if "scipy.linalg.cython_blas" in sys.modules:
        return
    sys.modules["scipy.linalg.cython_blas"] = None
    try:
        import numba.np.arraymath  # noqa: F401
    except ImportError:  # a numba that insists on it: imported with scipy when the first kernel loads
        pass
    finally:
        if sys.modules.get("scipy.linalg.cython_blas", 0) is None:
            del sys.modules["scipy.linalg.cython_blas"]
