"""``ppokit tune``: an Optuna study of PPO settings for an env (``ppokit.analysis.tune``; docs/tune.md)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="tune PPO settings for an env with Optuna (TPE, median pruning, a database)",
                       description="Run Optuna trials over RL-Zoo's PPO search space (docs/tune.md), the planner's "
                                   "config first; the study lives in --storage and resumes when run again with the "
                                   "same --study-name. Writes TUNE_DIR/best.toml (ppokit train --config) and "
                                   "TUNE_DIR/importance.png. Needs pip install 'ppokit[tune]'.")
    p.add_argument("--env", dest="env_id", required=True, metavar="ENV_ID", help="Gymnasium environment id")
    p.add_argument("--trials", type=int, default=20, help="trials to run now (added to the study's; default 20)")
    p.add_argument("--total-timesteps", type=_steps, default=100_000, metavar="STEPS",
                   help="environment steps per trial (default 100000)")
    p.add_argument("--storage", default=None, metavar="URL",
                   help="Optuna database URL, e.g. sqlite:///study.db (default: sqlite:///TUNE_DIR/study.db)")
    p.add_argument("--study-name", default=None, metavar="NAME", help="study to create or resume (default: ENV-ppo)")
    p.add_argument("--jobs", type=int, default=1, metavar="K",
                   help="trials in parallel, in K processes (each trains with one torch thread; default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the TPE sampler and of every trial's run (default 0)")
    p.add_argument("--evaluations", type=int, default=5, metavar="E",
                   help="evaluations per trial, reported to the median pruner; the last is the trial's value "
                        "(default 5)")
    p.add_argument("--eval-episodes", type=int, default=8, metavar="N",
                   help="deterministic episodes per evaluation (default 8)")
    p.add_argument("--out", dest="out_dir", default=None, metavar="TUNE_DIR",
                   help="where trial run dirs, best.toml and importance.png go (default: tunes/STUDY_NAME)")
    p.set_defaults(handler=run)


def _steps(text: str) -> int:
    """``--total-timesteps`` parsed like ``ppokit train``'s: 1e5 works."""
    from ppokit.config.ppo_config import ConfigError, _coerce

    try:
        return _coerce("total_timesteps", text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def run(args: argparse.Namespace) -> int:
    import importlib.util

    from rich.console import Console
    from rich.markup import escape

    err = Console(stderr=True)
    if importlib.util.find_spec("optuna") is None:
        err.print("[bold red]error:[/] ppokit tune needs Optuna: pip install 'ppokit[tune]'", highlight=False)
        return 2
    from ppokit.analysis.tune import TuneError, TuneSettings, run_tune

    settings = TuneSettings(env_id=args.env_id, trials=args.trials, total_timesteps=args.total_timesteps,
                            storage=args.storage, study_name=args.study_name, jobs=args.jobs, seed=args.seed,
                            evaluations=args.evaluations, eval_episodes=args.eval_episodes, out_dir=args.out_dir)
    try:
        result = run_tune(settings)
    except TuneError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        err.print("aborted by Ctrl-C; the trials finished so far are in the study", highlight=False)
        return 130
    counts = ", ".join(f"{n} {state.lower()}" for state, n in sorted(result.counts.items()))
    print(f"study {result.study_name} ({result.storage}): {sum(result.counts.values())} trials ({counts})")
    if result.best_toml is not None:
        print(f"best: trial {result.best_number}, evaluation return {result.best_value:g}; "
              f"train it with: ppokit train --config {result.best_toml}")
    if result.importance_plot is not None:
        print(f"parameter importances: {result.importance_plot}")
    for note in result.notes:
        print(f"note: {note}")
    return 0 if result.best_toml is not None else 1
