"""``training.build``: a config becomes the run's parts, and a part that fails closes the envs already built
(no env left open behind a refused run), its own error going on unchanged."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

import ppokit
from ppokit.config.ppo_config import PPOConfig
from ppokit.kernels.acting import ActingKernel
from ppokit.kernels.flat_adam import FlatAdam
from ppokit.rollout.collector import Collector
from ppokit.runtime.rundir import RunDirError
from ppokit.training.build import build
from ppokit.training.trainer import Trainer


class _Tracked(gym.Env):
    """A 3-float observation, 2 actions, 8-step episodes; ``closed`` counts close() calls of every instance."""

    closed: list[int] = []
    observation_space = spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(3, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.zeros(3, np.float32), 1.0, False, self.t >= 8, {}

    def close(self):
        _Tracked.closed.append(1)


@pytest.fixture
def tracked():
    _Tracked.closed = []
    return _Tracked


def _config(tmp_path, **fields) -> PPOConfig:
    return PPOConfig(**{**dict(env_id="CartPole-v1", num_envs=2, num_steps=16, total_timesteps=64, seed=1,
                               tensorboard=False, run_dir=str(tmp_path / "run")), **fields})


def test_build_returns_the_parts_the_trainer_takes(tmp_path):
    parts = build(_config(tmp_path))
    try:
        assert parts.fused and isinstance(parts.optimizer, FlatAdam) and isinstance(parts.acting, ActingKernel)
        assert isinstance(parts.collector, Collector) and parts.collector.watchdog is parts.watchdog
        assert parts.envs.num_envs == 2 and parts.obs_dim == 4 and not parts.masked
        assert not (tmp_path / "run").exists()  # building the parts writes nothing: the run dir is claimed later
    finally:
        parts.envs.close()
    unfused = build(_config(tmp_path, fused_update=False))
    unfused.envs.close()
    assert not unfused.fused and unfused.acting is None and not isinstance(unfused.optimizer, FlatAdam)


def _refused_rollout(*args, **kwargs):
    raise RuntimeError("this rollout source refuses to start")


def _refused_policy(obs_space, act_space, cfg):
    raise RuntimeError("this policy refuses to build")


@pytest.mark.parametrize("part,words", [(dict(rollout=_refused_rollout), "rollout source refuses"),
                                        (dict(policy=_refused_policy), "policy refuses")])
def test_a_part_that_fails_closes_the_envs_and_its_error_goes_on(part, words, tracked, tmp_path):
    with pytest.raises(RuntimeError, match=words):
        Trainer(_config(tmp_path), env=tracked, console_enabled=False, **part)
    assert len(tracked.closed) == 2  # both sub-envs of the vector env
    assert not (tmp_path / "run").exists()


def test_a_refused_run_dir_closes_the_envs(tracked, tmp_path):
    ppokit.train(_config(tmp_path), env=tracked, console_enabled=False)
    tracked.closed.clear()
    with pytest.raises(RunDirError):
        Trainer(_config(tmp_path), env=tracked, console_enabled=False)  # the run dir holds a run
    assert len(tracked.closed) == 2
