"""``ppokit plan``: a PPO config plus diagnostics plan for an environment and a step budget."""

from __future__ import annotations

import argparse
import dataclasses


def add_parser(sub) -> None:
    from ppokit.cli.train import add_config_flags

    p = sub.add_parser("plan", help="plan a PPO run (config with reasons + diagnostics plan) for an env and budget",
                       description="Probe the environment and print N x T, K, minibatch, LR schedule, eps, c_v, c_e, "
                                   "advantage normalization, gamma/lambda and a diagnostics plan, each value with "
                                   "its reason. Config flags override the planned values (guard rails apply).")
    p.add_argument("--budget", default=None, metavar="STEPS",
                   help="total environment steps (total_timesteps); required unless --zoo (RL-Zoo's n_timesteps)")
    p.add_argument("--zoo", action="store_true",
                   help="take RL-Zoo's published PPO settings for the env from rl_zoo3's ppo.yml / ppo_lstm.yml "
                        "(pip install 'ppokit[zoo]'); without it they are used for an env with no preset")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the plan as TOML (ppokit train --config FILE)")
    p.add_argument("--format", choices=("md", "toml", "json"), default="md", help="what to print (default: md)")
    p.add_argument("--no-probe", action="store_true", help="do not run the environment (known ids only)")
    add_config_flags(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from ppokit.config.planner import make_plan
    from ppokit.config.ppo_config import ConfigError, PPOConfig, _coerce

    err = Console(stderr=True)
    if args.env_id is None:
        err.print("[bold red]error:[/] config field 'env_id': --env ENV_ID is required")
        return 2
    try:
        budget = None
        if args.budget is None and not args.zoo:
            raise ConfigError("total_timesteps", "--budget STEPS is required (or --zoo, for RL-Zoo's n_timesteps)")
        if args.budget is not None:
            budget_text = str(args.budget)
            try:
                budget = _coerce("total_timesteps", budget_text)  # parsed like --total-timesteps: 1e5 works
            except ConfigError:
                budget = 0
            if budget < 1:
                raise ConfigError("total_timesteps", f"--budget must be a positive integer, got {budget_text!r}")
        overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(PPOConfig)
                     if f.name not in ("env_id", "total_timesteps") and getattr(args, f.name, None) is not None}
        plan = make_plan(args.env_id, budget, overrides, probe=not args.no_probe, zoo=True if args.zoo else None)
    except ValueError as exc:  # ConfigError, or an unknown env id
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    except RuntimeError as exc:  # EnvError: the env raised while the planner probed it
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 1
    text = {"md": plan.to_markdown, "toml": plan.to_toml, "json": plan.to_json}[args.format]()
    print(text, end="" if text.endswith("\n") else "\n")
    if args.out:
        from pathlib import Path

        Path(args.out).write_text(plan.to_toml())
        err.print(f"wrote {args.out}; train with: ppokit train --config {args.out}")
    return 0
