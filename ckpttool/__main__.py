"""`python -m ckpttool` (also what `torchrun -m ckpttool` runs) and the `ckpttool` executable.

Importing the CLI (typer, click, numpy) takes a few tenths of a second; a Ctrl-C or SIGTERM in that time
would end in a KeyboardInterrupt traceback, or silently. So before that import a signal ends the process
at once with a line that says nothing was written yet; cli.main() then takes the signals over."""

import os
import signal


def _starting(signum, frame) -> None:
    name = "interrupted (Ctrl-C)" if signum == signal.SIGINT else "terminated (SIGTERM)"
    os.write(2, f"{name} while starting: nothing was written\n".encode())
    os._exit(128 + signum)


_starting.ckpttool_startup = True  # cli.main() may take a signal this handler holds


def main() -> None:
    for signum, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
        if signal.getsignal(signum) is default:  # never where the caller ignores or handles it
            signal.signal(signum, _starting)
    from ckpttool.cli import entry

    entry()


if __name__ == "__main__":
    main()
