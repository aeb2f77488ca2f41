"""The optional ``envpool`` backend: C++-batched environments (classic control, Atari, MuJoCo) behind the
Gymnasium vector-env interface the trainer uses.

envpool resets an environment on the step *after* it finished (the reward of that step is 0 and its action is
ignored), which is Gymnasium's NEXT_STEP autoreset; the adapter declares it so the trainer drops those steps from
the batch and bootstraps truncations from the observation returned at the truncated step. envpool fixes its seed
when the pool is built, so the pool is (re)built by ``reset(seed=...)``.
"""

from __future__ import annotations

import warnings
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector.utils import batch_space

__all__ = ["EnvPoolVectorEnv", "envpool_task_id", "check_envpool_id", "make_envpool"]

_INSTALL_HINT = "install it with: pip install 'ppokit[envpool]'"


def _envpool():
    try:
        import envpool
    except ImportError as exc:
        raise ValueError(f"vector_mode='envpool' needs the envpool package; {_INSTALL_HINT}") from exc
    # envpool rebuilds its Gymnasium spaces from float64 bounds on every reset and step, and Gymnasium warns about
    # the float32 cast each time; only that notice is silenced.
    warnings.filterwarnings("ignore", message=r".*precision lowered by casting to float32.*", category=UserWarning)
    return envpool


def envpool_task_id(env_id: str) -> str:
    """envpool's name for a Gymnasium id: Atari's ``ALE/Pong-v5`` is ``Pong-v5`` there."""
    return env_id.split("/", 1)[1] if env_id.startswith("ALE/") else env_id


def check_envpool_id(env_id: str) -> None:
    """Raise ValueError naming the closest envpool tasks when envpool has no task ``env_id``."""
    import difflib

    tasks = _envpool().list_all_envs()
    task = envpool_task_id(env_id)
    if task not in tasks:
        close = difflib.get_close_matches(task, tasks, n=5)
        hint = f"; closest envpool tasks: {', '.join(close)}" if close else ""
        raise ValueError(f"envpool has no task {task!r}{hint}")


class EnvPoolVectorEnv(gym.vector.VectorEnv):
    """``num_envs`` envpool environments with Gymnasium's vector API and NEXT_STEP autoreset."""

    # The environments' state lives in C++: a checkpoint cannot hold it (resume restarts their episodes).
    state_capturable = False

    def __init__(self, env_id: str, num_envs: int, seed: int | None = None, **env_kwargs: Any):
        check_envpool_id(env_id)
        self.env_id, self.task_id = env_id, envpool_task_id(env_id)
        self.num_envs = int(num_envs)
        self._env_kwargs = env_kwargs
        self._pool = self._build(0 if seed is None else int(seed))
        self.single_observation_space = self._pool.observation_space
        self.single_action_space = self._pool.action_space
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.metadata = {"autoreset_mode": gym.vector.AutoresetMode.NEXT_STEP}

    def _build(self, seed: int):
        return _envpool().make(self.task_id, env_type="gymnasium", num_envs=self.num_envs, seed=seed,
                               **self._env_kwargs)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        """Reset every env; a seed rebuilds the pool with that seed (envpool seeds only at construction)."""
        if seed is not None:
            self._pool.close()
            self._pool = self._build(int(seed))
        obs, info = self._pool.reset()
        return np.asarray(obs), dict(info)

    def step(self, actions):
        """Step every env: ``(obs [N, ...], rewards [N], terminated [N], truncated [N], infos)``."""
        obs, reward, terminated, truncated, info = self._pool.step(np.asarray(actions))
        return (np.asarray(obs), np.asarray(reward, dtype=np.float64), np.asarray(terminated, dtype=bool),
                np.asarray(truncated, dtype=bool), dict(info))

    def close(self, **kwargs: Any) -> None:
        """Release the pool's threads."""
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            pool.close()


def make_envpool(env_id: str, num_envs: int, seed: int | None, env_kwargs: dict[str, Any]) -> EnvPoolVectorEnv:
    """The backend ``vector_mode = "envpool"`` (registered in factory.py): envpool has its own task list (Atari and
    MuJoCo need no Gymnasium registration there) and its Atari tasks do their own preprocessing; env_kwargs are its
    config keys (envpool.make refuses unknown ones with a TypeError, like Gymnasium)."""
    return EnvPoolVectorEnv(env_id, num_envs, seed, **env_kwargs)
