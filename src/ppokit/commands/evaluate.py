"""``ppokit eval RUN_DIR``: evaluate a trained agent and optionally record videos."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a trained run", description="Run full episodes with a trained agent "
                       "(saved observation normalization applied, frozen) and print mean +- std return.")
    p.add_argument("run_dir", help="run directory (or checkpoint file)")
    p.add_argument("--episodes", type=int, default=10, help="episodes to run (default: 10)")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                   help="greedy/mean actions (default) or sampled (--no-deterministic)")
    p.add_argument("--video", default=None, metavar="DIR", help="record every episode to DIR with RecordVideo")
    p.add_argument("--env", default=None, help="evaluate on another env id (default: the run's)")
    p.add_argument("--seed", type=int, default=10_000, help="seed of the first episode (default: 10000)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ppokit.agent import evaluate, load
    from ppokit.checkpoint import CheckpointError

    console = Console()
    if args.episodes < 1:
        console.print("[bold red]error:[/] --episodes must be >= 1")
        return 2
    try:
        agent = load(args.run_dir)
        result = evaluate(agent, args.env, episodes=args.episodes, deterministic=args.deterministic,
                          seed=args.seed, video_dir=args.video)
    except CheckpointError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        return 2
    except Exception as exc:
        import gymnasium as gym

        if isinstance(exc, gym.error.DependencyNotInstalled):
            console.print(f"[bold red]error:[/] recording video needs moviepy: pip install 'ppokit[video]' ({exc})")
            return 2
        raise
    env_id = args.env or agent.config.env_id
    console.print(f"{env_id}: mean return {result['mean']:.2f} +- {result['std']:.2f} over {args.episodes} episodes "
                  f"({'deterministic' if args.deterministic else 'stochastic'})")
    if args.video:
        console.print(f"videos: {args.video}")
    return 0
