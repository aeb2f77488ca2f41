"""``ppokit train``: train PPO from presets, TOML files and flags (later sources override earlier ones)."""

from __future__ import annotations

import argparse
import dataclasses
import os


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One kebab-case flag per ``PPOConfig`` field, its help from the field's docstring metadata."""
    from ppokit.config.ppo_config import PPOConfig

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
            if "(default:" not in help_text:  # run_dir's help spells out its computed default itself
                help_text = f"{help_text} (default: {shown})"
            group.add_argument(*flags, dest=f.name, default=None, metavar=f.name.upper(), help=help_text)


# Config flags a resumed run accepts: its length. Everything else is the checkpoint's (changing the network, the
# batch or the objective midway would not be a continuation), so any other flag is refused rather than ignored.
RESUME_FLAGS = ("total_timesteps",)


def resolve_config(args: argparse.Namespace):
    """``(config, source)``: defaults < preset < --config TOML < flags, and a sentence saying where the base
    values came from (None for a preset or a file, which the user named).

    No preset, no --config and no --env means the cartpole preset, so that a bare ``ppokit train`` solves
    CartPole. ``--env X`` alone means the planner's config for X (published settings where known, its rules
    otherwise; see ``ppokit plan``), not untuned library defaults; flags still override it.
    """
    from ppokit.config.planner import planned_config
    from ppokit.config.ppo_config import PPOConfig, load_preset

    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(PPOConfig)
                 if getattr(args, f.name, None) is not None}
    preset = getattr(args, "preset", None)
    config_file = getattr(args, "config", None)
    if preset is None and config_file is None and "env_id" not in overrides:
        preset = "cartpole"
    zoo = getattr(args, "zoo", False)
    if zoo and (preset is not None or config_file is not None or "env_id" not in overrides):
        from ppokit.config.ppo_config import ConfigError

        raise ConfigError("zoo", "--zoo takes RL-Zoo's settings for --env ENV_ID; it cannot be combined with "
                                 "--preset or --config")
    if preset is None and config_file is None:
        return planned_config(overrides, zoo=True if zoo else None)
    config = PPOConfig()
    if preset:
        config = load_preset(preset, config)
    if config_file:
        config = PPOConfig.from_toml(config_file, config)
    if overrides:
        config = PPOConfig.from_dict(overrides, config)
    return config, None


def config_from_args(args: argparse.Namespace):
    """The resolved config of ``resolve_config`` (without its source line)."""
    return resolve_config(args)[0]


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train PPO on a Gymnasium environment",
                       description="Train PPO. Config precedence: defaults < --preset < --config FILE < flags. "
                                   "With no preset, file or --env, trains the cartpole preset; --env X alone "
                                   "trains the planner's config for X (see ppokit plan).")
    from ppokit.config.ppo_config import list_presets

    p.add_argument("--preset", default=None, help=f"a shipped preset: {', '.join(list_presets())}")
    p.add_argument("--config", default=None, metavar="FILE", help="TOML file of config fields")
    p.add_argument("--zoo", action="store_true",
                   help="with --env: RL-Zoo's published PPO settings for the env (rl_zoo3's ppo.yml / ppo_lstm.yml, "
                        "pip install 'ppokit[zoo]'), flags still override them")
    p.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue the run in RUN_DIR from its checkpoint with its saved config; only "
                        "--total-timesteps (a new length), --quiet and --import-module may be given with it")
    p.add_argument("--overwrite", action="store_true",
                   help="train in a run dir that holds a finished or abandoned run, deleting that run's files first "
                        "(without it such a run dir is refused)")
    p.add_argument("--import-module", action="append", default=[], metavar="MODULE", dest="import_module",
                   help="allow importing MODULE for a 'MODULE:Env-v0' env id that comes from a file (--config, or "
                        "the checkpoint of --resume); an id typed with --env needs no permission (repeatable)")
    p.add_argument("--quiet", action="store_true", help="no live console output (files are still written)")
    p.add_argument("--progress", action="store_true", help="a progress bar with an ETA on a terminal of any width "
                   "(a compact one below 100 columns) and an ETA on every plain line when piped")
    p.add_argument("--nproc", type=int, default=None, metavar="K",
                   help="data-parallel training in K processes on this machine: re-launches this command under "
                        "torchrun --standalone --nproc_per_node=K (num_envs is per process, total_timesteps for "
                        "all of them; see the README's Data-parallel training)")
    add_config_flags(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from ppokit.core.errors import ConfigError

    err = Console(stderr=True)
    # The config is resolved and validated before torch is imported (1-2 s): a bad value is refused at once.
    config = source = total = None
    try:
        if args.nproc is not None and args.nproc < 1:
            raise ValueError(f"--nproc must be a positive number of processes, got {args.nproc}")
        if args.resume:
            total = _resume_total(args)
        else:
            config, source = resolve_config(args)
            config.validate()
    except (ConfigError, ValueError) as exc:  # ValueError: an unknown env id met by the planner's probe
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    except RuntimeError as exc:  # EnvError: the env raised while the planner probed it
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 1

    if args.progress:
        from ppokit.runtime.logger import ConsoleSink

        ConsoleSink.PROGRESS = True
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1) > 1  # one of torchrun's ranks
    if args.nproc is not None and args.nproc > 1 and not launched:
        return _launch(args)  # before torch is imported: this process only waits for torchrun

    from ppokit.envs.errors import EnvError
    from ppokit.runtime import distributed, launcher
    from ppokit.runtime.checkpoint import CheckpointError
    from ppokit.runtime.logger import SinkError

    # Under torchrun every rank runs this: rank 0 alone says what it trains (and writes the run dir); an error is
    # printed by the rank that met it, tagged with its rank (another rank's env failure is the news).
    main_rank = os.environ.get("RANK", "0") == "0"
    say = err if main_rank else Console(stderr=True, quiet=True)
    tag = "" if main_rank else f"rank {os.environ['RANK']}: "
    if launched:
        launcher.watch_launcher()  # under --nproc: stop when the launcher is gone, even by kill -9
    try:
        if args.resume:
            from ppokit.training.trainer import resume

            if args.overwrite:
                raise ConfigError("overwrite", "--overwrite cannot be given with --resume: it would delete the run "
                                               "that --resume continues")
            result = resume(args.resume, total_timesteps=total, console_enabled=not args.quiet,
                            allow_import=tuple(args.import_module))
        else:
            from ppokit.runtime.checkpoint import check_stored_env_id
            from ppokit.training.trainer import train

            if args.env_id is None and args.config:
                # An env id from a file is the file's choice, not the user's: importing its module runs its code.
                check_stored_env_id(config.env_id, args.import_module, args.config)
            if source and not args.quiet:
                say.print(escape(source), highlight=False, soft_wrap=True)
            world = int(os.environ.get("WORLD_SIZE", "1") or 1)
            warnings = config.warnings(world)
            if args.total_timesteps is not None or args.config:  # a length the user chose, not a preset's
                warnings += [n for n in (config.rounding_note(world),) if n]
            for warning in warnings:
                say.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False, soft_wrap=True)
            result = train(config, console_enabled=not args.quiet, overwrite=args.overwrite)
    except (ConfigError, CheckpointError) as exc:
        err.print(f"[bold red]error:[/] {tag}{escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    except (EnvError, SinkError) as exc:
        # The env raised, returned what its spaces do not allow, or hung (on Ctrl-C: 130), or TensorBoard could
        # not write (a full disk); the trainer saved what it could.
        err.print(f"[bold red]error:[/] {tag}{escape(str(exc))}", highlight=False, soft_wrap=True)
        return 130 if getattr(exc, "interrupted", False) else 1  # SinkError: never interrupted
    except ValueError as exc:
        # Environment problems (unknown id, unsupported spaces) surface as ValueError before training starts.
        err.print(f"[bold red]error:[/] {tag}{escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    except distributed.DistributedError as exc:
        # A rank was lost or timed out; the checkpoints rank 0 wrote are whole (atomic writes). Every rank says it,
        # except under --nproc when a peer exited: the launcher's one line names that rank and how it ended.
        if exc.peer_exited and launcher.supervised():
            return 1
        err.print(f"[bold red]error:[/] {escape(str(exc))}; rank 0's last checkpoint is whole: "
                  "continue with ppokit train --resume RUN_DIR", highlight=False, soft_wrap=True)
        return 1
    except KeyboardInterrupt:
        # A second Ctrl-C (the first one finishes the update and saves), or one before training started: any
        # checkpoint already written is intact (writes are atomic).
        say.print("aborted by Ctrl-C; any checkpoint already in the run dir is intact", highlight=False)
        return 130
    finally:
        if launched:
            distributed.shutdown()
    if main_rank:
        print(f"run dir: {result.run_dir}")
    return 130 if result.interrupted else 0


def _launch(args: argparse.Namespace) -> int:
    """``--nproc K``: run this same command as K ranks under torchrun on this machine; its exit code.

    ``ppokit.runtime.launcher`` starts torchrun (--standalone: a free port) in its own session, passes SIGINT/SIGTERM on
    and waits for the ranks (130/143), stops them when it is killed itself, and names a lost rank in one line.
    For several machines run torchrun directly (README: Data-parallel training)."""
    from ppokit.runtime.launcher import launch

    return launch(args.nproc, ["train", *_child_argv(args)])


def _child_argv(args: argparse.Namespace) -> list[str]:
    """The ``ppokit train`` arguments that reproduce ``args`` (without --nproc), for every rank."""
    from ppokit.config.ppo_config import PPOConfig

    argv: list[str] = []
    for name in ("preset", "config", "resume"):
        if getattr(args, name) is not None:
            argv.append(f"--{name}={getattr(args, name)}")
    argv += ["--overwrite"] * bool(args.overwrite) + ["--quiet"] * bool(args.quiet) + ["--zoo"] * bool(args.zoo)
    argv += ["--progress"] * bool(args.progress)
    argv += [f"--import-module={m}" for m in args.import_module]
    for f in dataclasses.fields(PPOConfig):
        value, flag = getattr(args, f.name, None), f.name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            argv.append(f"--{flag}={value}")
    return argv


def _resume_total(args: argparse.Namespace) -> int | None:
    """The new total_timesteps of a resume (parsed like a fresh run's, so 1e5 works); other flags are refused."""
    from ppokit.config.ppo_config import ConfigError, PPOConfig, _coerce

    given = [f"--{name.replace('_', '-')}" for name in PPOConfig.field_names()
             if name not in RESUME_FLAGS and getattr(args, name, None) is not None]
    given += [f"--{name}" for name in ("preset", "config") if getattr(args, name, None) is not None]
    given += ["--zoo"] * bool(getattr(args, "zoo", False))
    if given:
        name = given[0].lstrip("-").replace("-", "_")
        raise ConfigError(name, f"{', '.join(given)} cannot be given with --resume: a resumed run keeps the config "
                                "in its checkpoint; --resume accepts only --total-timesteps (and --quiet, "
                                "--import-module)")
    if args.total_timesteps is None:
        return None
    total = _coerce("total_timesteps", args.total_timesteps)
    if total < 1:
        raise ConfigError("total_timesteps", f"must be a positive integer, got {args.total_timesteps!r}")
    return total
