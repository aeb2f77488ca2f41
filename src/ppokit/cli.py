"""The ``ppokit`` command line: a thin layer over the public Python API.

Each subcommand lives in the module that owns its job and registers itself through ``add_parser(subparsers)``;
this file only wires them together, so ``ppokit --help`` stays cheap (heavy imports happen inside handlers).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ppokit.interrupts import INTERRUPTED, enter_main

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
    parser = argparse.ArgumentParser(
        prog="ppokit",
        description="Proximal Policy Optimization: train, evaluate, plan and diagnose PPO runs.",
    )
    parser.add_argument("--version", action="version", version=f"ppokit {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ppokit`` console script; returns the process exit code (130 after a Ctrl-C that
    the command did not handle itself, e.g. one during the imports of start-up, with no traceback)."""
    try:
        enter_main()  # raises the KeyboardInterrupt of a Ctrl-C during start-up
        return _run(argv)
    except KeyboardInterrupt:
        return INTERRUPTED


def _run(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "handler"):
        parser.print_help()
        return 2
    _plain_warnings()
    return int(args.handler(args) or 0)


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
