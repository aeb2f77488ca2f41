"""Helpers shared by the benchmark scripts: one-thread setup, ppokit runs with episode capture, tables, machine info.

Each benchmark imports this file from its own folder, so ``python benchmarks/<name>.py`` works from anywhere.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# One torch thread everywhere, set before torch is imported (both libraries then run under the same budget).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

SOLVED_RETURN = 475.0
RETURN_WINDOW = 100  # episodes in the training-return window (SB3's ep_info_buffer default)


def load() -> str:
    """The 1/5/15-minute load averages as text (other jobs share the machine)."""
    try:
        return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:  # pragma: no cover
        return "n/a"


def versions() -> str:
    """Python, torch, gymnasium, numpy and (if present) SB3 versions, plus CPU count."""
    import gymnasium

    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}", f"gymnasium {gymnasium.__version__}",
             f"numpy {np.__version__}"]
    sb3 = sb3_module()
    parts.append(f"stable-baselines3 {sb3.__version__}" if sb3 else "stable-baselines3 not installed")
    parts.append(f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}")
    return ", ".join(parts)


def sb3_module():
    """The ``stable_baselines3`` module, or None when it is not installed (or hidden for a test by setting
    ``PPOKIT_BENCH_HIDE_SB3=1``, which exercises the ppokit-only path)."""
    if os.environ.get("PPOKIT_BENCH_HIDE_SB3") == "1":
        return None
    try:
        import stable_baselines3
    except ImportError:
        return None
    return stable_baselines3


SB3_MISSING = ("stable-baselines3 is not installed, so only the ppokit side runs. Install the benchmark extra "
               "with:  pip install 'ppokit[bench]'  (or: pip install stable-baselines3)")


def first_solved_step(rollouts: list[tuple[int, list[float]]], threshold: float = SOLVED_RETURN,
                      window: int = RETURN_WINDOW) -> int | None:
    """First env step (at a rollout's end) where the mean of the last ``window`` finished episodes is >= threshold.

    ``rollouts`` is ``[(global_step_at_rollout_end, [returns of episodes finished in that rollout]), ...]``; the
    same definition is applied to both libraries.
    """
    recent: list[float] = []
    for step, returns in rollouts:
        recent.extend(returns)
        recent = recent[-window:]
        if recent and sum(recent) / len(recent) >= threshold:
            return step
    return None


def run_ppokit(config, device: str = "cpu") -> dict:
    """Train ppokit with ``config`` in a temp run dir; wall times, steps and the per-rollout episode returns."""
    from ppokit.training.trainer import Trainer

    class RecordingTrainer(Trainer):
        """Records the returns finished in each rollout, and when the loop ends (before plots and summary)."""

        def collect_rollout(self):
            episodes, nonfinite = super().collect_rollout()
            self.bench_rollouts.append((self.global_step, [r for r, _ in episodes]))
            return episodes, nonfinite

        def _finish(self, wall, start_step):
            self.bench_loop_end = time.perf_counter()
            super()._finish(wall, start_step)

    config.device = device
    config.torch_threads = 1
    with tempfile.TemporaryDirectory(prefix="ppokit-bench-") as tmp:
        t0 = time.perf_counter()
        trainer = RecordingTrainer(config, run_dir=Path(tmp) / "run", console_enabled=False)
        trainer.bench_rollouts = []
        t1 = time.perf_counter()
        run = trainer.run()
        t2 = time.perf_counter()
    return {"steps": run.global_step, "wall": t2 - t0, "loop": trainer.bench_loop_end - t1,
            "rollouts": trainer.bench_rollouts, "fused": trainer.fused, "perf": dict(trainer.perf)}


def run_sb3(env_id: str, n_envs: int, seed: int, total: int, device: str = "cpu", normalize: bool = False,
            algo: Any = None, policy: str = "MlpPolicy", **ppo_kwargs) -> dict:
    """Train SB3 PPO on ``n_envs`` copies of ``env_id``; same measurements as ``run_ppokit``. ``normalize``
    wraps the envs in SB3's ``VecNormalize`` (observations and rewards, both clipped at 10, the return's
    discount the PPO gamma): the same normalization as ppokit's ``normalize_obs`` + ``normalize_reward``.
    ``algo``/``policy``: another SB3-style class and policy name (sb3-contrib's RecurrentPPO, "MlpLstmPolicy")."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    class Episodes(BaseCallback):
        """Collects finished-episode returns (from the Monitor wrapper's info) per rollout."""

        def __init__(self):
            super().__init__()
            self.rollouts: list[tuple[int, list[float]]] = []
            self.pending: list[float] = []

        def _on_step(self) -> bool:
            for info in self.locals["infos"]:
                if "episode" in info:
                    self.pending.append(float(info["episode"]["r"]))
            return True

        def _on_rollout_end(self) -> None:
            self.rollouts.append((self.num_timesteps, self.pending))
            self.pending = []

    t0 = time.perf_counter()
    env = make_vec_env(env_id, n_envs=n_envs, seed=seed)
    if normalize:
        from stable_baselines3.common.vec_env import VecNormalize

        env = VecNormalize(env, norm_obs=True, norm_reward=True, clip_obs=10.0, clip_reward=10.0,
                           gamma=ppo_kwargs.get("gamma", 0.99))
    model = (algo or PPO)(policy, env, seed=seed, device=device, verbose=0, **ppo_kwargs)
    cb = Episodes()
    t1 = time.perf_counter()
    model.learn(total_timesteps=total, callback=cb)
    t2 = time.perf_counter()
    env.close()
    return {"steps": model.num_timesteps, "wall": t2 - t0, "loop": t2 - t1, "rollouts": cb.rollouts}


def median(xs: list[float]) -> float:
    """Median, NaN for an empty list."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def table(headers: list[str], rows: list[list]) -> str:
    """A plain-text table (markdown pipe syntax so it pastes into RESULTS.md as is)."""
    def fmt(v):
        if isinstance(v, float):
            return "n/a" if v != v else (f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}")
        return "n/a" if v is None else str(v)

    cells = [[fmt(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    out = [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    return "\n".join(out)


def header(title: str) -> None:
    """Print the benchmark title, versions, command line and load."""
    print(f"# {title}")
    print(f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    print(f"versions: {versions()}")
    print(f"command: python {' '.join(sys.argv)}")
    print(f"load average before: {load()}")
    sys.stdout.flush()
