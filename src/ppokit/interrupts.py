"""Ctrl-C during the command line's start-up: exit 130 quietly, never a KeyboardInterrupt traceback.

``import ppokit`` imports this module first. When the interpreter was started to run ppokit's command line
(``python -m ppokit``, the ``ppokit`` console script), a SIGINT that arrives during the imports that follow (numpy,
gymnasium, torch) only sets a flag; ``cli.main`` restores Python's handler, reads the flag and exits 130, and turns
any later KeyboardInterrupt a command does not handle into 130 too. A program that imports ppokit keeps its own
SIGINT handling. Before this module runs only the interpreter has (``site``, ``runpy``), and CPython reports an
interrupt there itself.
"""

from __future__ import annotations

import signal
import sys

__all__ = ["INTERRUPTED", "started_as_command", "defer_startup_interrupt", "startup_interrupted"]

# Ctrl-C exits with 128 + SIGINT, as a shell reports a command the signal ended.
INTERRUPTED = 130
_startup_interrupted = False


def _note_startup_interrupt(signum, frame) -> None:
    # Only a flag: raising here would surface as a KeyboardInterrupt traceback from inside whatever import the
    # signal landed in (torch, gymnasium); main() reads the flag and exits 130.
    global _startup_interrupted
    _startup_interrupted = True


def _is_ppokit_module(name: str) -> bool:
    return name == "ppokit" or name.startswith("ppokit.")


def started_as_command(orig_argv: list[str] | None = None) -> bool:
    """Whether this interpreter was started to run ppokit's command line: ``python -m ppokit`` (or a ppokit
    submodule, e.g. ``-m ppokit.cli``) or the ``ppokit`` console script, read from the interpreter's own command
    line (``sys.orig_argv``), never from what a program that imports ppokit put in ``sys.argv``."""
    args = list(sys.orig_argv if orig_argv is None else orig_argv)[1:]
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "-m":
            return i + 1 < len(args) and _is_ppokit_module(args[i + 1])
        if arg.startswith("-m"):
            return _is_ppokit_module(arg[2:])
        if arg.startswith("-c"):
            return False
        if arg in ("-X", "-W", "--check-hash-based-pycs"):  # interpreter options that take a separate value
            i += 2
            continue
        if arg.startswith("-") and arg != "-":
            i += 1
            continue
        return arg.replace("\\", "/").rsplit("/", 1)[-1] in ("ppokit", "ppokit.exe")  # the console script
    return False


def defer_startup_interrupt() -> None:
    """When this process is ppokit's command line, hold a Ctrl-C that arrives during start-up (the package's
    imports, before ``main`` runs) until ``main``, which exits 130 without a traceback. ``import ppokit`` calls
    this first thing; a program that imports ppokit keeps its own SIGINT handling."""
    global _startup_interrupted
    # Installed first and checked after: every statement before the install is a moment a Ctrl-C would still
    # raise (measured: an interrupt landed inside the command-line check, and signal.getsignal builds an enum).
    try:
        previous = signal.signal(signal.SIGINT, _note_startup_interrupt)
    except ValueError:  # not the main thread: signals are not this thread's to handle
        return
    if previous is not signal.default_int_handler or not started_as_command():
        signal.signal(signal.SIGINT, previous)  # a program importing ppokit, or its own handler: left as it was
    if _startup_interrupted and signal.getsignal(signal.SIGINT) is not _note_startup_interrupt:
        _startup_interrupted = False
        signal.raise_signal(signal.SIGINT)  # one that arrived in between belongs to the restored handler


def startup_interrupted() -> bool:
    """Whether a Ctrl-C arrived during start-up; from this call on a Ctrl-C is a KeyboardInterrupt again (the
    trainer installs its own handler)."""
    if signal.getsignal(signal.SIGINT) is _note_startup_interrupt:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return _startup_interrupted  # read after restoring: a Ctrl-C in between raised instead of setting it


defer_startup_interrupt()
