"""``ppokit train``: train PPO from presets, TOML files and flags (later sources override earlier ones)."""

from __future__ import annotations

import argparse
import dataclasses


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One kebab-case flag per ``PPOConfig`` field, its help from the field's docstring metadata."""
    from ppokit.config import PPOConfig

    group = parser.add_argument_group("config fields (override preset and --config)")
    for f in dataclasses.fields(PPOConfig):
        flags = ["--" + f.name.replace("_", "-")]
        if f.name == "env_id":
            flags.append("--env")
        help_text = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if str(f.type) == "bool":
            group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                               help=f"{help_text} (default: {default})")
        else:
            shown = ",".join(map(str, default)) if isinstance(default, list) else default
            group.add_argument(*flags, dest=f.name, default=None, metavar=f.name.upper(),
                               help=f"{help_text} (default: {shown})")


def config_from_args(args: argparse.Namespace):
    """Resolve the config: defaults < preset < --config TOML < flags. No preset and no --config and no --env
    means the cartpole preset, so that a bare ``ppokit train`` solves CartPole."""
    from ppokit.config import PPOConfig, load_preset

    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(PPOConfig)
                 if getattr(args, f.name, None) is not None}
    preset = getattr(args, "preset", None)
    if preset is None and getattr(args, "config", None) is None and "env_id" not in overrides:
        preset = "cartpole"
    config = PPOConfig()
    if preset:
        config = load_preset(preset, config)
    if getattr(args, "config", None):
        config = PPOConfig.from_toml(args.config, config)
    if overrides:
        config = PPOConfig.from_dict(overrides, config)
    return config


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train PPO on a Gymnasium environment",
                       description="Train PPO. Config precedence: defaults < --preset < --config FILE < flags. "
                                   "With no preset, file or --env, trains the cartpole preset.")
    from ppokit.config import list_presets

    p.add_argument("--preset", default=None, help=f"a shipped preset: {', '.join(list_presets())}")
    p.add_argument("--config", default=None, metavar="FILE", help="TOML file of config fields")
    p.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue the run in RUN_DIR from its checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="train in a run dir that holds a finished or abandoned run, deleting that run's files first "
                        "(without it such a run dir is refused)")
    p.add_argument("--quiet", action="store_true", help="no live console output (files are still written)")
    add_config_flags(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ppokit.checkpoint import CheckpointError
    from ppokit.config import ConfigError

    err = Console(stderr=True)
    try:
        if args.resume:
            from ppokit.trainer import resume

            if args.overwrite:
                raise ConfigError("overwrite", "--overwrite cannot be given with --resume: it would delete the run "
                                               "that --resume continues")
            total = int(args.total_timesteps) if args.total_timesteps is not None else None
            result = resume(args.resume, total_timesteps=total, console_enabled=not args.quiet)
        else:
            from ppokit.trainer import train

            config = config_from_args(args)
            result = train(config, console_enabled=not args.quiet, overwrite=args.overwrite)
    except (ConfigError, CheckpointError) as exc:
        err.print(f"[bold red]error:[/] {exc}")
        return 2
    except ValueError as exc:
        # Environment problems (unknown id, unsupported spaces) surface as ValueError before training starts.
        err.print(f"[bold red]error:[/] {exc}")
        return 2
    except KeyboardInterrupt:
        # The second Ctrl-C (the first one finishes the update and saves): the last checkpoint is intact.
        err.print("aborted by a second Ctrl-C; the run dir keeps its last checkpoint", highlight=False)
        return 130
    print(f"run dir: {result.run_dir}")
    return 130 if result.interrupted else 0

