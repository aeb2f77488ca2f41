"""The ``ppokit`` command line: a thin layer over the public Python API.

Each subcommand lives in the module that owns its job and registers itself through ``add_parser(subparsers)``;
this file only wires them together, so ``ppokit --help`` stays cheap (heavy imports happen inside handlers).
"""

from __future__ import annotations

import importlib
import signal
import sys

# Modules that provide subcommands, in the order ``--help`` lists them.
_COMMAND_MODULES = [
    "ppokit.commands.train",
    "ppokit.commands.evaluate",
    "ppokit.commands.objective",
    "ppokit.commands.plan",
    "ppokit.commands.doctor",
    "ppokit.commands.report",
    "ppokit.commands.sweep",
    "ppokit.commands.compare",
    "ppokit.commands.lm",
]


def version() -> str:
    """The installed distribution's version (importlib.metadata), else the package's ``__version__``."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("ppokit")
    except PackageNotFoundError:  # running from a source tree that was never installed
        from ppokit import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    # Imported here: ``import ppokit`` imports this module before its handler for Ctrl-C is in place.
    import argparse

    parser = argparse.ArgumentParser(
        prog="ppokit",
        description="Proximal Policy Optimization: train, evaluate, plan and diagnose PPO runs.",
    )
    parser.add_argument("--version", action="version", version=f"ppokit {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


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
    if not started_as_command():
        return
    # Installed first and checked after: every statement before the install is a moment a Ctrl-C would still
    # raise (signal.getsignal alone builds an enum, measured long enough to be hit).
    try:
        previous = signal.signal(signal.SIGINT, _note_startup_interrupt)
    except ValueError:  # not the main thread: signals are not this thread's to handle
        return
    if previous is not signal.default_int_handler:  # someone chose their own handling: keep it
        signal.signal(signal.SIGINT, previous)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ppokit`` console script; returns the process exit code (130 after a Ctrl-C that
    the command did not handle itself, e.g. one during the imports of start-up, with no traceback)."""
    try:
        if signal.getsignal(signal.SIGINT) is _note_startup_interrupt:
            # From here a Ctrl-C is a KeyboardInterrupt again (caught below; the trainer installs its own handler).
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if _startup_interrupted:  # read after restoring: a Ctrl-C in between raised instead of setting it
            return INTERRUPTED
        argv = list(sys.argv[1:] if argv is None else argv)
        parser = build_parser()
        args = parser.parse_args(argv)
        if not hasattr(args, "handler"):
            parser.print_help()
            return 2
        _plain_warnings()
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return INTERRUPTED


def _plain_warnings() -> None:
    """ppokit's own warnings print as one ``warning: ...`` line on the command line, not with a source line."""
    import warnings

    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if getattr(category, "__module__", "").startswith("ppokit"):
            print(f"warning: {message}", file=file or sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    warnings.showwarning = show


if __name__ == "__main__":
    sys.exit(main())
