"""One error family. Every message names the file, the tensor (where there is one) and the fix."""

from __future__ import annotations

import unicodedata

_BAD_NAME_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def printable(name: str) -> str:
    """A name safe to print: controls, format characters and lone surrogates backslash-escaped (a file
    name from disk or a hub listing can hold terminal escapes)."""
    return "".join(c if unicodedata.category(c) not in _BAD_NAME_CATEGORIES else _escape(c) for c in name)


def _escape(c: str) -> str:
    code = ord(c)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


class CkptError(Exception):
    """A failure the user can act on; the CLI prints it without a traceback and exits non-zero."""

    exit_code = 1

    def __init__(self, message: str, *, file: object = None, tensor: str | None = None, fix: str | None = None):
        self.file = None if file is None else printable(str(file))
        self.tensor = tensor
        self.fix = fix
        self.message = message
        super().__init__(self.render())

    def render(self) -> str:
        where = []
        if self.file:
            where.append(f"file {self.file}")
        if self.tensor:
            where.append(f"tensor {printable(self.tensor)!r}")
        text = f"{self.message}" + (f" ({', '.join(where)})" if where else "")
        if self.fix:
            text += f"\n  fix: {self.fix}"
        return text


class InputError(CkptError):
    """The checkpoint, index or config being read is malformed or inconsistent."""


class PlanError(CkptError):
    """The requested conversion cannot be planned for this checkpoint (divisibility, unknown keys)."""


class OutputError(CkptError):
    """The destination is unsafe to write (non-empty, inside SRC, too little space)."""


class RecipeError(CkptError):
    """A recipe or --set override is invalid."""

    exit_code = 2


class Stopped(BaseException):
    """A signal ended the run: Ctrl-C (SIGINT) or SIGTERM, in this process or, `who` says, in another of the
    run's processes. Not a failure of the input or the output: the finished work stays journalled. A
    BaseException, like KeyboardInterrupt, so no `except Exception` mistakes it for an error; the CLI exits
    128 + signum."""

    def __init__(self, signum: int, who: str = ""):
        super().__init__(signum, who)
        self.signum, self.who = signum, who


_stops: list[int] = []  # signals received by this process's handler (cli), in order


def stop(signum: int) -> None:
    """What the CLI's signal handler does: remember the signal, then raise Stopped. A handler runs between any
    two bytecodes of the main thread, a weakref callback's or a destructor's included, where an exception is
    swallowed; `check_stop` raises it again at the next safe point."""
    _stops.append(signum)
    raise Stopped(signum)


def check_stop() -> None:
    """Raise Stopped if a signal was received here and its exception was swallowed where it landed."""
    if _stops:
        raise Stopped(_stops[0])


def forget_stops() -> None:
    _stops.clear()
