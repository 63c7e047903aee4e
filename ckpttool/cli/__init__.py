"""CLI root: the entry point, which runs the app (cli/app.py: one module per command, registered
explicitly) and maps CkptError to a message and an exit code."""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import threading

import click
import typer

from ckpttool import settings
from ckpttool.cli.app import app
from ckpttool.errors import CkptError, Stopped, check_stop, forget_stops, printable, stop
from ckpttool.execute.staging import disk_error

JOURNALLED = ("a conversion's finished work stays journalled in DST/.ckpttool-partial\n"
              "  fix: rerun the same command with --resume to continue it (or delete that directory to discard it)")
INTERRUPTED = f"interrupted (Ctrl-C): {JOURNALLED}"
TERMINATED = f"terminated (SIGTERM): {JOURNALLED}"

# typer >= 0.23 vendors its own click: usage errors and aborts come from either package
USAGE_ERRORS = tuple({click.ClickException,
                      next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")})
ABORTS = tuple({click.Abort, typer.Abort})


def _on_signal(signum, frame) -> None:
    """Ctrl-C and SIGTERM end a run like an error (KeyboardInterrupt would become typer's silent exit 130)."""
    stop(signum)


def stopped_message(exc: BaseException) -> tuple[str, int]:
    """What the CLI prints for a run a signal ended, and its exit code (128 + the signal)."""
    signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
    text = TERMINATED if signum == signal.SIGTERM else INTERRUPTED
    if isinstance(exc, Stopped) and exc.who and signum == signal.SIGTERM:
        text = f"{exc.who} was {text}"
    return text, 128 + signum


def _owned(signum: int, default) -> bool:
    """Whether this process may take `signum`: its handler is still the default (or the start-up one of
    __main__), never where someone set it to be ignored or handled."""
    handler = signal.getsignal(signum)
    return handler is default or getattr(handler, "ckpttool_startup", False)


def as_ckpt_error(exc: BaseException) -> CkptError:
    """Any failure as an error with a fix: the one guard every command goes through, so no input the
    code does not check yet can end in a traceback (CKPTTOOL_DEBUG=1 shows it)."""
    if isinstance(exc, CkptError):
        return exc
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return disk_error(exc, exc.filename)  # a full disk: how to go on
    if isinstance(exc, OSError):
        return CkptError(f"{exc.strerror or type(exc).__name__}", file=exc.filename,
                         fix="check that the path exists, is the kind of file this command expects, and that you "
                             "may read (or, for an output, write) it; a read-only output needs another directory")
    if isinstance(exc, RecursionError):
        return CkptError("an input is nested too deeply to read", fix="check the recipe, config or JSON file "
                         "just given: nothing this deep is a valid checkpoint or recipe")
    if isinstance(exc, MemoryError):
        return CkptError("out of memory", fix="lower --max-memory and --workers, or check the input's config for "
                         "absurd sizes")
    return CkptError(f"unexpected {type(exc).__name__}: {str(exc)[:500]}",
                     fix="an input ckpttool does not check yet, or a bug: rerun with CKPTTOOL_DEBUG=1 and report "
                         "the traceback")


def _report(error: CkptError, argv: list[str]) -> None:
    text = "\n".join(printable(line) for line in str(error).split("\n"))  # names from disk stay inert
    print(f"error: {text}", file=sys.stderr)
    if "--json" in argv:
        print(json.dumps({"ok": False, "error": printable(error.message), "file": error.file,
                          "tensor": error.tensor, "fix": error.fix, "kind": type(error).__name__,
                          "exit_code": error.exit_code}))


def main(argv: list[str] | None = None) -> int:
    """Entry point. Every failure becomes `error:` / `fix:` lines and exit code 1 (2 for usage and
    recipe errors, 130 for Ctrl-C, 143 for SIGTERM), with no traceback unless CKPTTOOL_DEBUG=1 or
    `ckpttool -v ...` (then it re-raises).
    Returns the exit code when called with argv (tests); with --json the error is also JSON on stdout."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = settings.get("CKPTTOOL_DEBUG") or args[:1] in (["-v"], ["--verbose"])
    owned_defaults = ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL))
    owned = [(signum, signal.getsignal(signum)) for signum, default in owned_defaults
             if threading.current_thread() is threading.main_thread() and _owned(signum, default)]
    forget_stops()
    for signum, _ in owned:
        signal.signal(signum, _on_signal)
    unraisable = sys.unraisablehook
    if owned:  # a Stopped swallowed in a destructor is raised again (check_stop), not printed as a traceback
        sys.unraisablehook = lambda u: None if isinstance(u.exc_value, Stopped) else unraisable(u)
    try:
        code = app(args=argv, prog_name="ckpttool", standalone_mode=False)
        check_stop()  # a signal whose exception landed where it was swallowed (a destructor, a weakref callback)
    except USAGE_ERRORS as exc:
        ctx = getattr(exc, "ctx", None)
        where = ctx.command_path if ctx is not None else "ckpttool"
        bare = type(exc).__name__ == "NoArgsIsHelpError"  # bare `ckpttool`: the help, already printed, is the answer
        if not bare:
            print(f"error: {printable(exc.format_message())}\n  fix: see `{where} --help`", file=sys.stderr)
        code = 0 if bare else exc.exit_code
    except (*ABORTS, KeyboardInterrupt, Stopped) as exc:
        if debug:
            raise
        text, code = stopped_message(exc)
        print(text, file=sys.stderr)
    except Exception as exc:  # noqa: BLE001 - the one place every failure is turned into a message
        if debug:
            raise
        error = as_ckpt_error(exc)
        if not error.fix:  # every error says what to do next
            command = next((a for a in args if not a.startswith("-")), "")
            error = type(error)(error.message, file=error.file, tensor=error.tensor,
                                fix=f"see `ckpttool {command} --help`".replace("  ", " "))
        _report(error, args)
        code = error.exit_code
    finally:
        sys.unraisablehook = unraisable
        for signum, previous in owned:  # the start-up handler's "nothing was written" would be wrong now
            signal.signal(signum, dict(owned_defaults)[signum] if getattr(previous, "ckpttool_startup", False)
                          else previous)
    code = code if isinstance(code, int) else 0
    if argv is None:
        sys.exit(code)
    return code


def entry() -> None:
    """The `ckpttool` executable and `python -m ckpttool`: main(), then leave without the
    interpreter's teardown. Whatever a command wrote is durable and closed before main() returns,
    and unloading torch and destroying a CUDA context took 0.5-1.5 s of every run's wall time
    (bench/HISTORY.md). In-process callers (tests) use main() and get SystemExit as usual."""
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except (KeyboardInterrupt, Stopped) as exc:  # a signal between main()'s own handling and the exit
        text, code = stopped_message(exc)
        print(text, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
