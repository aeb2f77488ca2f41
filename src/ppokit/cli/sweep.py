"""``ppokit sweep``: train the cartesian product of ``--set`` values x seeds, then plot and tabulate it."""

from __future__ import annotations

import argparse

# More runs than this in one sweep is a typo (each is a full training run), not an experiment.
MAX_RUNS = 10_000


def add_common_flags(p: argparse.ArgumentParser) -> None:
    """Flags shared by ``sweep`` and ``compare``: seeds, output, workers, threshold, preset/config and config flags."""
    from ppokit.cli.train import add_config_flags

    p.add_argument("--seeds", type=int, default=3, help="seeds per setting: seed, seed+1, ... (default: 3)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (runs in DIR/<setting>/seed<k>/)")
    p.add_argument("--workers", type=int, default=None,
                   help="parallel worker processes (default: number of CPU cores)")
    p.add_argument("--threshold", type=float, default=None,
                   help="return that counts as solved for 'steps to threshold' (default: the env spec's "
                        "reward_threshold; GridWorld: optimum - 0.02)")
    from ppokit.config.ppo_config import list_presets

    p.add_argument("--preset", default=None, help=f"a shipped preset: {', '.join(list_presets())}")
    p.add_argument("--config", default=None, metavar="FILE", help="TOML file of config fields")
    add_config_flags(p)


def add_parser(sub) -> None:
    p = sub.add_parser("sweep", help="sweep config values x seeds; plot return, KL and clip fraction",
                       description="Train every combination of the --set values for --seeds seeds (each a normal "
                                   "run dir), in parallel worker processes; finished runs are skipped on re-run. "
                                   "Writes returns.png, kl.png, clipfrac.png and summary.csv into --out.")
    p.add_argument("--set", dest="sets", action="append", required=True, metavar="FIELD=V1,V2",
                   help="a config field and its values (repeatable; ';' separates list values, e.g. "
                        "'hidden_sizes=64,64;32,32')")
    add_common_flags(p)
    p.set_defaults(handler=run)


def run_experiment(args: argparse.Namespace, sets, compare: bool, bare_labels: bool) -> int:
    """Shared body of sweep/compare: build and validate the grid, train it, write the outputs."""
    import math

    from rich.console import Console
    from rich.markup import escape

    from ppokit.analysis import experiments as ex
    from ppokit.cli.train import resolve_config
    from ppokit.core.errors import ConfigError

    console = Console()
    if not console.is_terminal:
        # Plain output (logs, pipes): a wide fixed width so the summary table is not wrapped to 80 columns.
        console = Console(width=160)
    err = Console(stderr=True)
    try:
        if args.workers is not None and args.workers < 1:
            raise ConfigError("workers", f"must be a positive integer, got {args.workers}")
        n_runs = math.prod(len(values) for _, values in sets) * max(args.seeds, 1)
        if n_runs > MAX_RUNS:  # checked before the grid is built: --seeds 1e9 would fill memory with specs
            raise ConfigError("seeds", f"{n_runs:,} runs (settings x --seeds) is more than {MAX_RUNS:,}; "
                                       "sweep fewer values or seeds")
        base, source = resolve_config(args)
        if source:
            err.print(escape(source), highlight=False)
        specs = ex.build_grid(base, sets, args.seeds, args.out, bare_labels=bare_labels)
        threshold = args.threshold if args.threshold is not None else ex.default_threshold(base.env_id)
        n_settings = len({s.setting for s in specs})
        console.print(f"{n_settings} setting(s) x {args.seeds} seed(s) = {len(specs)} runs of "
                      f"{base.total_timesteps:,} steps on {base.env_id} -> {args.out}", highlight=False)
        results = ex.run_grid(specs, workers=args.workers, console=console)
    except ConfigError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        return 2
    except ValueError as exc:  # environment problems (unknown id, unsupported spaces)
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        return 2
    except KeyboardInterrupt:
        err.print("interrupted: finished runs are kept; re-run the same command to continue")
        return 130
    failed = [r for r in results if r.error]
    ex.write_outputs(specs, args.out, threshold, compare=compare, console=console)
    if failed:
        err.print(f"[bold red]{len(failed)} run(s) failed[/]: " + "; ".join(
            f"{r.setting} seed {r.seed}: {r.error}" for r in failed[:5]))
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ppokit.analysis.experiments import parse_set
    from ppokit.core.errors import ConfigError

    try:
        sets = [parse_set(s) for s in args.sets]
    except ConfigError as exc:
        Console(stderr=True).print(f"[bold red]error:[/] {exc}")
        return 2
    return run_experiment(args, sets, compare=False, bare_labels=False)
