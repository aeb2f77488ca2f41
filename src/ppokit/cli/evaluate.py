"""``ppokit eval RUN_DIR``: evaluate a trained agent and optionally record videos."""

from __future__ import annotations

import argparse
import re


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a trained run", description="Run full episodes with a trained agent "
                       "(saved observation normalization applied, frozen) and print mean +- std return. A run whose "
                       "env id names a module ('module:Env-v0') is refused unless --import-module names that module: "
                       "a run dir never decides on its own what code is imported.")
    p.add_argument("run_dir", help="run directory (or checkpoint file)")
    p.add_argument("--episodes", type=int, default=10, help="episodes to run (default: 10)")
    p.add_argument("--eval-deterministic", "--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   dest="deterministic", help="the most likely / mean action, or a sample (--no-eval-deterministic, "
                   "as CleanRL's published Atari scores); default: the run's eval_deterministic (true unless set)")
    p.add_argument("--video", default=None, metavar="DIR", help="record every episode to DIR with RecordVideo")
    p.add_argument("--env", default=None, help="evaluate on another env id with the run's spaces (default: the "
                   "run's); a 'module:Env-v0' id given here imports module")
    p.add_argument("--env-kwargs", default=None, metavar="JSON", dest="env_kwargs",
                   help="keyword arguments for the env's constructor as a JSON object, e.g. '{\"map_name\": \"8x8\"}' "
                   "(default: the run's env_kwargs when evaluating on the run's own env id, none for another id)")
    p.add_argument("--import-module", action="append", default=[], metavar="MODULE", dest="import_module",
                   help="allow importing MODULE for the run's stored 'MODULE:Env-v0' env id (repeatable)")
    p.add_argument("--seed", type=int, default=10_000, help="seed of the first episode (default: 10000)")
    p.add_argument("--best", action="store_true", help="evaluate the run's best.pt (the best evaluation of the "
                   "gate, --eval-every) instead of its latest checkpoint")
    p.set_defaults(handler=run)


# Gymnasium's DependencyNotInstalled texts name the missing package first ("pygame is not installed, run ...",
# "MoviePy is not installed, run ..."); the pip package that provides each, and the ppokit extra that brings it.
_PACKAGES = {"moviepy": ("moviepy", "video"), "pygame": ("pygame", "video"), "box2d": ("box2d", "box2d"),
             "opencv": ("opencv-python", None), "cv2": ("opencv-python", None)}


def _missing_dependency(exc: BaseException) -> str:
    """The line to print for a missing optional dependency, naming the one the exception names."""
    text = str(exc)
    lowered = text.lower()
    for key, (package, extra) in _PACKAGES.items():
        if re.search(rf"\b{key}\b", lowered):
            how = f"pip install 'ppokit[{extra}]'" if extra else f"pip install {package}"
            return f"{package} is not installed ({how}): {text}"
    return f"a dependency is missing: {text}"


class EvalProgress:
    """One stderr line per episode once an evaluation has run ``AFTER_S`` seconds, at most one every ``EVERY_S``
    (a short evaluation prints only its result): episodes done, the mean return so far, the time left."""

    AFTER_S = 3.0
    EVERY_S = 2.0

    def __init__(self, episodes: int, console):
        import time

        self.episodes, self.console, self.clock = episodes, console, time.perf_counter
        self.start = self.last = self.clock()
        self.total = 0.0

    def __call__(self, done: int, episode_return: float) -> None:
        self.total += episode_return
        now = self.clock()
        if done == self.episodes or now - self.start < self.AFTER_S or now - self.last < self.EVERY_S:
            return
        self.last = now
        left = (now - self.start) / done * (self.episodes - done)
        self.console.print(f"eval: {done}/{self.episodes} episodes, mean return so far {self.total / done:.2f}, "
                           f"eta {left:.0f}s", highlight=False, markup=False, soft_wrap=True)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from ppokit.envs.errors import EnvError
    from ppokit.runtime.checkpoint import CheckpointError
    from ppokit.runtime.rundir import best_checkpoint
    from ppokit.training.agent import evaluate, load

    console = Console()
    err = Console(stderr=True)

    def fail(message: str) -> int:
        # Messages hold paths, env ids and "pip install 'ppokit[video]'": escape them, or rich eats [brackets].
        err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)  # one line
        return 2

    if args.episodes < 1:
        return fail("--episodes must be >= 1")
    import gymnasium as gym

    from ppokit.config.ppo_config import ConfigError, _coerce

    try:
        env_kwargs = None if args.env_kwargs is None else _coerce("env_kwargs", args.env_kwargs)
    except ConfigError as exc:
        return fail(str(exc))
    try:
        source = best_checkpoint(args.run_dir) if args.best else args.run_dir
        agent = load(source, env_id=args.env, allow_import=tuple(args.import_module))
        if args.video:
            from ppokit.envs.video import prepare_offscreen

            prepare_offscreen(args.env or agent.env_id)  # before the env (and MuJoCo's renderer) is built
        if args.deterministic is None:
            args.deterministic = agent.config.eval_deterministic
        result = evaluate(agent, args.env, episodes=args.episodes, deterministic=args.deterministic,
                          seed=args.seed, video_dir=args.video, env_kwargs=env_kwargs,
                          progress=EvalProgress(args.episodes, err))
    except CheckpointError as exc:
        return fail(str(exc))
    except EnvError as exc:  # the env raised or returned what its spaces do not allow: exit 1, as in train
        fail(str(exc))
        return 1
    except gym.error.DependencyNotInstalled as exc:
        return fail(_missing_dependency(exc))
    except (ValueError, gym.error.Error) as exc:
        # An unknown or malformed env id, or an env whose spaces are not the run's.
        return fail(str(exc))
    except Exception as exc:  # noqa: BLE001 - only MuJoCo's own rendering errors; anything else is re-raised
        if args.video and type(exc).__module__.split(".")[0] == "mujoco":
            from ppokit.envs.video import MUJOCO_GL_HINT

            return fail(f"{MUJOCO_GL_HINT} ({type(exc).__name__}: {' '.join(str(exc).split())})")
        raise
    console.print(f"{escape(agent.env_id)}: mean return {result['mean']:.2f} +- {result['std']:.2f} over "
                  f"{args.episodes} episodes ({'deterministic' if args.deterministic else 'stochastic'})")
    if args.video:
        console.print(f"videos: {escape(str(args.video))}")
    return 0
