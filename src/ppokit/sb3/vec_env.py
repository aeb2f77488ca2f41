"""SB3's vector-env interface over Gymnasium envs, and what ppokit trains on for each ``env`` SB3 accepts.

``PPO(policy, env)`` takes an id, a ``gymnasium.Env``, a Gymnasium vector env or an SB3 ``VecEnv``. ppokit builds
its own training envs, so a vector env is read for what rebuilds it (its sub-envs' registered id and kwargs, their
number, sync or subprocess; SB3's ``VecNormalize`` becomes ppokit's normalization) and kept as ``get_env()``.
``VecEnv`` here is SB3's interface (``reset() -> obs``, ``step(a) -> (obs, rewards, dones, infos)`` with
autoreset and ``infos[i]["terminal_observation"]``) for the evaluation loops SB3 scripts contain.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np

from ppokit.sb3.translate import SB3Error

__all__ = ["VecEnv", "make_vec_env", "TrainEnv", "train_env"]

# Wrappers gym.make adds itself, and SB3's Monitor (ppokit records episode statistics itself): a sub-env wrapped in
# nothing else is rebuilt exactly from its id.
_REBUILT_WRAPPERS = {"TimeLimit", "OrderEnforcing", "PassiveEnvChecker", "Monitor", "EnvCompatibility"}


class VecEnv:
    """``num_envs`` Gymnasium envs stepped in turn, with SB3's VecEnv interface."""

    def __init__(self, envs: list[gym.Env], env_id: str | None = None, env_kwargs: dict | None = None):
        self.envs = envs
        self.num_envs = len(envs)
        self.observation_space = envs[0].observation_space
        self.action_space = envs[0].action_space
        self.env_id, self.env_kwargs = env_id, dict(env_kwargs or {})
        self._seeds: list[int | None] = [None] * self.num_envs
        self._returns = np.zeros(self.num_envs)
        self._lengths = np.zeros(self.num_envs, dtype=np.int64)
        self.reset_infos: list[dict] = [{} for _ in envs]

    def seed(self, seed: int | None = None) -> list[int | None]:
        """Seeds of the next reset, ``seed + i`` for env i (SB3's rule)."""
        self._seeds = [None if seed is None else seed + i for i in range(self.num_envs)]
        return list(self._seeds)

    def reset(self) -> Any:
        obs = []
        for i, env in enumerate(self.envs):
            o, self.reset_infos[i] = env.reset(seed=self._seeds[i])
            obs.append(o)
        self._seeds = [None] * self.num_envs
        self._returns[:], self._lengths[:] = 0.0, 0
        return _stack(obs)

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, list[dict]]:
        obs, rewards, dones, infos = [], np.zeros(self.num_envs, dtype=np.float32), np.zeros(self.num_envs, bool), []
        for i, env in enumerate(self.envs):
            o, r, terminated, truncated, info = env.step(actions[i])
            info = dict(info)
            rewards[i], dones[i] = r, terminated or truncated
            self._returns[i] += r
            self._lengths[i] += 1
            if dones[i]:
                info["terminal_observation"] = o
                info["TimeLimit.truncated"] = bool(truncated and not terminated)
                info["episode"] = {"r": float(self._returns[i]), "l": int(self._lengths[i])}
                self._returns[i], self._lengths[i] = 0.0, 0
                o, self.reset_infos[i] = env.reset()
            obs.append(o)
            infos.append(info)
        return _stack(obs), rewards, dones, infos

    def render(self, mode: str | None = None) -> Any:
        return self.envs[0].render()

    def close(self) -> None:
        for env in self.envs:
            env.close()

    def get_attr(self, name: str, indices: Any = None) -> list:
        return [getattr(self.envs[i], name) for i in _indices(indices, self.num_envs)]

    def env_method(self, name: str, *args: Any, indices: Any = None, **kwargs: Any) -> list:
        return [getattr(self.envs[i], name)(*args, **kwargs) for i in _indices(indices, self.num_envs)]


def _indices(indices: Any, n: int) -> list[int]:
    if indices is None:
        return list(range(n))
    return [indices] if isinstance(indices, int) else list(indices)


def _stack(obs: list) -> Any:
    if isinstance(obs[0], dict):
        return {k: np.stack([o[k] for o in obs]) for k in obs[0]}
    return np.stack(obs)


def make_vec_env(env_id: str, n_envs: int = 1, seed: int | None = None, env_kwargs: dict | None = None,
                 **refused: Any) -> VecEnv:
    """SB3's ``make_vec_env`` for a registered id: ``n_envs`` envs of ``gym.make(env_id, **env_kwargs)``."""
    if refused:
        raise SB3Error(f"make_vec_env: {', '.join(sorted(refused))} not supported by ppokit.sb3 (it takes env_id, "
                       "n_envs, seed, env_kwargs)")
    if not isinstance(env_id, str):
        raise SB3Error(f"make_vec_env: env_id must be a registered id, got {type(env_id).__name__}")
    envs = [gym.make(env_id, **(env_kwargs or {})) for _ in range(n_envs)]
    venv = VecEnv(envs, env_id, env_kwargs)
    if seed is not None:
        venv.seed(seed)
    return venv


@dataclass
class TrainEnv:
    """What ppokit trains on for SB3's ``env``: ``env`` for ``Trainer(env=...)`` (an id or an instance) and the
    config fields it sets."""

    env: Any
    fields: dict = field(default_factory=dict)
    vec: Any = None  # the vector env get_env() returns (built on first use when None)

    @property
    def n_envs(self) -> int:
        return self.fields["num_envs"]


def train_env(env: Any) -> TrainEnv:
    """The ``TrainEnv`` for SB3's ``env`` argument; ``SB3Error`` naming what cannot be rebuilt."""
    if isinstance(env, str):
        return TrainEnv(env, {"env_id": env, "num_envs": 1})
    if isinstance(env, gym.Env):
        # SB3 wraps one env in a DummyVecEnv of one; ppokit trains on the instance itself.
        return TrainEnv(env, {"num_envs": 1}, VecEnv([env], getattr(env.spec, "id", None)))
    fields: dict = {}
    outer = env
    names = [c.__name__ for c in type(env).__mro__]
    if "VecNormalize" in names:
        if (env.clip_obs, env.clip_reward) != (10.0, 10.0):
            raise SB3Error(f"env: VecNormalize(clip_obs={env.clip_obs}, clip_reward={env.clip_reward}): ppokit's "
                           "normalizers clip at 10")
        fields.update(normalize_obs=bool(env.norm_obs), normalize_reward=bool(env.norm_reward))
        env = env.venv
        names = [c.__name__ for c in type(env).__mro__]
    if hasattr(env, "venv"):
        raise SB3Error(f"env: the VecEnv wrapper {type(env).__name__} has no ppokit counterpart (VecNormalize has: "
                       "normalize_obs, normalize_reward)")
    if isinstance(env, VecEnv) and env.env_id is not None:
        return TrainEnv(env.env_id, {**fields, "env_id": env.env_id, "num_envs": env.num_envs,
                                     "env_kwargs": env.env_kwargs}, outer)
    if not hasattr(env, "num_envs") or not hasattr(env, "get_attr"):
        raise SB3Error(f"env: expected an env id, a gymnasium.Env, a Gymnasium vector env or an SB3 VecEnv, got "
                       f"{type(env).__name__}")
    specs = list(env.get_attr("spec"))
    ids = {getattr(s, "id", None) for s in specs}
    if None in ids or len(ids) != 1:
        raise SB3Error(f"env: ppokit rebuilds a vector env from its sub-envs' registered id, but {type(env).__name__} "
                       f"holds envs with ids {sorted(map(str, ids))}; pass an env id or one gymnasium.Env")
    for sub in getattr(env, "envs", []):  # in-process vector envs: their wrappers are visible
        _check_wrappers(sub)
    spec = specs[0]
    kwargs = {k: v for k, v in (spec.kwargs or {}).items() if k != "render_mode"}
    async_ = any(n in names for n in ("SubprocVecEnv", "AsyncVectorEnv"))
    fields.update(env_id=spec.id, num_envs=int(env.num_envs), env_kwargs=kwargs,
                  vector_mode="async" if async_ else "sync")
    if isinstance(outer, gym.vector.VectorEnv):
        outer = make_vec_env(spec.id, int(env.num_envs), env_kwargs=kwargs)  # SB3's interface for get_env()
    return TrainEnv(spec.id, fields, outer)


def _check_wrappers(env: Any) -> None:
    while isinstance(env, gym.Wrapper):
        name = type(env).__name__
        if name not in _REBUILT_WRAPPERS:
            raise SB3Error(f"env: its sub-envs are wrapped in {name}, which ppokit would drop when it rebuilds them "
                           "from their id; pass one gymnasium.Env (ppokit trains on it as it is) or register the "
                           "wrapped env")
        env = env.env
