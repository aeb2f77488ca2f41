"""``ppokit compare``: the sweep machinery with ``algo`` as the swept parameter, at equal env steps."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    from ppokit.cli.sweep import add_common_flags

    p = sub.add_parser("compare", help="compare algorithms (ppo, a2c, ppo-kl) over seeds at equal env steps",
                       description="Train each algorithm for --seeds seeds with the same config and env-step "
                                   "budget. Writes returns.png, kl.png, clipfrac.png, stability.png, beta.png "
                                   "(ppo-kl) and summary.csv into --out.")
    p.add_argument("--algos", default="ppo,a2c,ppo-kl", help="comma-separated algorithms (default: ppo,a2c,ppo-kl)")
    add_common_flags(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ppokit.analysis.experiments import parse_set
    from ppokit.cli.sweep import run_experiment
    from ppokit.core.errors import ConfigError

    try:
        sets = [parse_set(f"algo={args.algos}")]
        if args.algo is not None:
            raise ConfigError("algo", "is the compared parameter; use --algos, not --algo")
    except ConfigError as exc:
        Console(stderr=True).print(f"[bold red]error:[/] {exc}")
        return 2
    return run_experiment(args, sets, compare=True, bare_labels=True)
