"""The ``ppokit`` command line: a thin layer over the public Python API.

Each subcommand lives in the module that owns its job and registers itself through ``add_parser(subparsers)``;
this file only wires them together, so ``ppokit --help`` stays cheap (heavy imports happen inside handlers).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ppokit.runtime.interrupts import INTERRUPTED, enter_main

# Modules that provide subcommands, in the order ``--help`` lists them.
_COMMAND_MODULES = [
    "ppokit.cli.train",
    "ppokit.cli.evaluate",
    "ppokit.cli.objective",
    "ppokit.cli.plan",
    "ppokit.cli.doctor",
    "ppokit.cli.report",
    "ppokit.cli.sweep",
    "ppokit.cli.tune",
    "ppokit.cli.compare",
    "ppokit.cli.export",
    "ppokit.cli.lm",
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
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = getattr(args, "command", None)
        if command is None:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        print(f"error: {unknown_argument(_subparser(parser, command), command, unknown)}", file=sys.stderr)
        return 2
    if not hasattr(args, "handler"):
        parser.print_help()
        return 2
    _plain_warnings()
    return int(args.handler(args) or 0)


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


def unknown_argument(sub: argparse.ArgumentParser, command: str, unknown: list[str]) -> str:
    """One line for the arguments ``ppokit COMMAND`` did not take: the first unknown flag and the closest flag
    the command has (``--learning_rate`` -> ``--learning-rate``), in place of argparse's usage of all of them."""
    import difflib

    flag = next((u for u in unknown if u.startswith("-")), None)
    if flag is None:
        return f"unexpected argument {unknown[0]!r} for ppokit {command} (ppokit {command} --help lists its arguments)"
    name = flag.split("=", 1)[0]
    flags = sorted({o for a in sub._actions for o in a.option_strings if o.startswith("--")})
    spelled = "--" + name.lstrip("-").replace("_", "-")  # every ppokit flag is kebab-case
    close = [spelled] if spelled in flags else difflib.get_close_matches(spelled, flags, n=1)
    hint = f"did you mean {close[0]}?" if close else f"ppokit {command} --help lists the flags"
    return f"unknown flag {name} for ppokit {command}; {hint}"


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
