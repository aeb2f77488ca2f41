"""Ctrl-C on the command line: exit 130 quietly at any moment, never a KeyboardInterrupt traceback.

``import ppokit`` imports this module first. When the interpreter was started to run ppokit's command line
(``python -m ppokit``, the ``ppokit`` console script), a SIGINT during start-up (the imports of numpy, gymnasium,
torch) is held until ``cli.main`` starts, and one during any later import until that import is done; then it is
Python's usual KeyboardInterrupt, which ``cli.main`` turns into exit code 130 (the trainer installs its own
handler while it trains). A program that imports ppokit keeps its own SIGINT handling. Before this module runs
only the interpreter has (``site``, ``runpy``), and CPython reports an interrupt there itself.
"""

from __future__ import annotations

import _thread
import signal
import sys
import threading
from typing import Any

__all__ = ["INTERRUPTED", "started_as_command", "defer_startup_interrupt", "enter_main", "install_sigint"]

# Ctrl-C exits with 128 + SIGINT, as a shell reports a command the signal ended.
INTERRUPTED = 130
# How soon a Ctrl-C held during an import is tried again (the import is then usually done).
_RETRY_S = 0.02
_pending = False
_main_started = False


def _in_import(frame: Any) -> bool:
    """Whether the interrupted code is inside an ``import`` (importlib's frames are on the stack)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def _on_sigint(signum: int, frame: Any) -> None:
    # A KeyboardInterrupt raised inside an import is printed as a traceback from deep inside it, and inside a
    # C++ callback of torch's initialisation aborts the process (measured: "terminate called after throwing
    # an instance of 'pybind11::error_already_set'", exit -6). So: held until main() starts (which exits 130),
    # and after that until the import is done, tried again every _RETRY_S; elsewhere Python's usual
    # KeyboardInterrupt, which main() turns into exit code 130.
    global _pending
    if not _main_started:
        _pending = True
        return
    if _in_import(frame):
        _pending = True
        timer = threading.Timer(_RETRY_S, _thread.interrupt_main, args=(signal.SIGINT,))
        timer.daemon = True
        timer.start()
        return
    _pending = False
    raise KeyboardInterrupt


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
    """When this process is ppokit's command line, install the Ctrl-C handler that holds an interrupt during
    start-up and during imports (``_on_sigint``). ``import ppokit`` calls this first thing; a program that imports
    ppokit keeps its own SIGINT handling."""
    # Installed first and checked after: every statement before the install is a moment a Ctrl-C would still
    # raise (measured: an interrupt landed inside the command-line check, and signal.getsignal builds an enum).
    try:
        previous = signal.signal(signal.SIGINT, _on_sigint)
    except ValueError:  # not the main thread: signals are not this thread's to handle
        return
    if previous is not signal.default_int_handler or not started_as_command():
        signal.signal(signal.SIGINT, previous)  # a program importing ppokit, or its own handler: left as it was
        if _pending:
            _reset()
            signal.raise_signal(signal.SIGINT)  # one that arrived in between belongs to the restored handler


def _reset() -> None:
    global _pending
    _pending = False


def enter_main() -> None:
    """Called first by ``cli.main`` (inside its ``try``): a Ctrl-C held since start-up raises KeyboardInterrupt
    now, and later ones do at once (outside imports)."""
    global _main_started
    _main_started = True
    if _pending:
        _reset()
        raise KeyboardInterrupt


defer_startup_interrupt()


def install_sigint(trainer: Any, sigterm: bool = False):
    """First Ctrl-C: finish the current update, save, exit cleanly. Second Ctrl-C: default behaviour.

    ``sigterm``: SIGTERM stops the run the same way (always under torchrun); ``trainer._stop_signal`` holds the
    number of the signal that asked, for the exit code (128 + it)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        # Only a flag: the loop logs the alert and saves. Anything more (I/O, a lock) could deadlock on what the
        # interrupted code holds. The second Ctrl-C aborts; a checkpoint write it lands in leaves the old file.
        if trainer._stop_requested:
            raise KeyboardInterrupt
        trainer._stop_requested = True
        trainer._stop_signal = signum

    if sigterm or getattr(getattr(trainer, "dist", None), "active", False):
        # A data-parallel rank is stopped by SIGTERM (torchrun passes its own on, as Slurm and Kubernetes send it,
        # and kills ~30 s later): finish the update and save, as for Ctrl-C; every rank agrees to stop.
        trainer._old_sigterm = signal.signal(signal.SIGTERM, handler)
    return signal.signal(signal.SIGINT, handler)
