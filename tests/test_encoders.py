"""Observation encoders: Box observations flatten exactly as before, Discrete ones are one-hot encoded wherever
observations enter (rollouts, the evaluation gate, a loaded Agent), and FrozenLake trains to a solved policy."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces

import ppokit
from ppokit.cli import main
from ppokit.config.ppo_config import ConfigError, load_preset
from ppokit.envs import check_spaces
from ppokit.envs.encoders import BoxEncoder, OneHotEncoder, encoder_from_spec, observation_encoder
from ppokit.envs.errors import EnvError, check_obs_batch
from ppokit.policies import build_policy
from ppokit.training.trainer import Trainer, train


class _ShiftedDiscreteEnv(gym.Env):
    """A Discrete(4, start=10) observation; the reward pays for action 1 in state 12 only; 8-step episodes.
    ``bad_at`` (a step index) makes the env return an observation outside the space there."""

    def __init__(self, bad_at: int | None = None):
        self.observation_space = spaces.Discrete(4, start=10)
        self.action_space = spaces.Discrete(2)
        self.bad_at, self.t, self.steps = bad_at, 0, 0
        self.finals: list[int] = []  # the last observation of each truncated episode

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return 10 + int(self.np_random.integers(4)), {}

    def step(self, action):
        self.t += 1
        self.steps += 1
        obs = 10 + int(self.np_random.integers(4))
        if self.bad_at is not None and self.steps >= self.bad_at:
            obs = 14  # one past the last value
        if self.t >= 8:
            self.finals.append(obs)
        return obs, float(action == 1), False, self.t >= 8, {}


def _frozenlake_config(**overrides):
    cfg = load_preset("gridworld")
    cfg.env_id, cfg.env_kwargs, cfg.seed = "FrozenLake-v1", {"is_slippery": False}, 0
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


# ------------------------------------------------------------------------------------------ the encoders
def test_one_hot_is_exact_and_honours_start():
    enc = observation_encoder(spaces.Discrete(5, start=3))
    assert isinstance(enc, OneHotEncoder) and enc.flat_dim == 5
    out = enc.encode(np.array([3, 4, 7, 5]), 4)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, np.eye(5, dtype=np.float32)[[0, 1, 4, 2]])
    for bad in (2, 8):  # just below start, just past start + n - 1
        with pytest.raises(ValueError, match=f"observation {bad} outside Discrete\\(5, start=3\\)"):
            enc.encode(np.array([3, bad]), 2)
    with pytest.raises(ValueError, match="non-integer"):
        enc.encode(np.array([3.5]), 1)
    assert encoder_from_spec(enc.spec(), 5).spec() == {"type": "one_hot", "n": 5, "start": 3}


def test_box_encoder_is_the_plain_float32_flatten():
    enc = observation_encoder(spaces.Box(-1, 1, (2, 3), np.float64))
    assert isinstance(enc, BoxEncoder) and enc.flat_dim == 6 and enc.spec() is None
    x = np.random.default_rng(0).normal(size=(4, 2, 3))
    np.testing.assert_array_equal(enc.encode(x, 4), np.asarray(x, dtype=np.float32).reshape(4, -1))
    with pytest.raises(ValueError, match="Unsupported observation space.*MultiBinary"):
        observation_encoder(spaces.MultiBinary(3))  # Dict and Tuple have encoders now (tests/test_dict_obs.py)


def test_build_policy_takes_discrete_observations():
    policy = build_policy(spaces.Discrete(16), spaces.Discrete(4), [8], "tanh")
    assert policy.obs_dim == 16
    assert policy.spec()["obs_encoding"] == {"type": "one_hot", "n": 16, "start": 0}
    box = build_policy(spaces.Box(-1, 1, (4,), np.float32), spaces.Discrete(2), [8], "tanh")
    assert "obs_encoding" not in box.spec()  # a Box policy's checkpoint is unchanged
    assert check_spaces(gym.make("FrozenLake-v1")) == "discrete"


def test_env_checks_accept_discrete_ints_in_range_only():
    space = spaces.Discrete(4, start=10)
    out = check_obs_batch([10, 13, 11], 3, space, "E-v0", "step()", 7)
    np.testing.assert_array_equal(out, np.eye(4, dtype=np.float32)[[0, 3, 1]])
    with pytest.raises(EnvError, match=r"env 'E-v0' failed in step\(\) at global step 7: returned observation 14 "
                                       r"outside Discrete\(4, start=10\)"):
        check_obs_batch(np.array([10, 14, 11]), 3, space, "E-v0", "step()", 7)
    with pytest.raises(EnvError, match="shape"):
        check_obs_batch(np.array([[10], [11]]), 2, space, "E-v0", "step()", 7)


def test_an_out_of_range_discrete_observation_ends_the_run_with_one_line(tmp_path):
    cfg = load_preset("gridworld")
    cfg.total_timesteps, cfg.num_envs, cfg.num_steps = 512, 2, 32
    with pytest.raises(EnvError, match=r"failed in step\(\).*observation 14 outside Discrete\(4, start=10\)"):
        train(cfg, run_dir=tmp_path / "r", console_enabled=False, env=lambda: _ShiftedDiscreteEnv(bad_at=20))


def test_normalize_obs_is_refused_for_a_one_hot_observation(tmp_path):
    with pytest.raises(ConfigError, match="normalize_obs.*one-hot"):
        train(_frozenlake_config(normalize_obs=True, total_timesteps=256), run_dir=tmp_path / "r",
              console_enabled=False)


# -------------------------------------------------------------------------------------------- end to end
def test_frozenlake_trains_solves_and_round_trips(tmp_path):
    run = train(_frozenlake_config(total_timesteps=20_000), run_dir=tmp_path / "r", console_enabled=False)
    agent = ppokit.load(run.run_dir)
    assert agent.policy.obs_dim == 16
    result = ppokit.evaluate(agent, episodes=3)
    assert result["returns"] == [1.0, 1.0, 1.0]  # the non-slippery 4x4 map is solved: 6 steps to the goal
    assert result["lengths"] == [6, 6, 6]
    # One int is one observation, a 1-D array a batch; both match the trained policy's greedy actions.
    first = agent.act(0)
    assert np.ndim(first) == 0
    batch = agent.act(np.array([0, 1, 4]))
    assert batch.shape == (3,) and batch[0] == first
    with torch.inference_mode():
        expected = run.policy.actor(torch.eye(16)[[0, 1, 4]]).argmax(-1).numpy()
    np.testing.assert_array_equal(batch, expected)
    with pytest.raises(ValueError, match="outside Discrete"):
        agent.act(16)


def test_start_is_honoured_through_training_and_loading(tmp_path):
    cfg = load_preset("gridworld")
    cfg.total_timesteps, cfg.num_envs, cfg.num_steps = 512, 2, 32
    run = train(cfg, run_dir=tmp_path / "r", console_enabled=False, env=_ShiftedDiscreteEnv)
    agent = ppokit.load(run.run_dir)
    assert agent.policy.spec()["obs_encoding"] == {"type": "one_hot", "n": 4, "start": 10}
    with torch.inference_mode():
        expected = run.policy.actor(torch.eye(4)).argmax(-1).numpy()
    np.testing.assert_array_equal(agent.act(np.arange(10, 14)), expected)
    with pytest.raises(ValueError, match="outside Discrete"):
        agent.act(0)  # index 0 is not a value of Discrete(4, start=10)


def test_rollout_stores_one_hot_rows_and_bootstraps_from_the_encoded_final_obs(tmp_path):
    cfg = load_preset("gridworld")
    cfg.num_envs, cfg.num_steps = 2, 32
    trainer = Trainer(cfg, run_dir=tmp_path / "r", console_enabled=False, env=_ShiftedDiscreteEnv)
    try:
        trainer.collect_rollout()
        buf = trainer.buffer
        assert buf.obs.shape == (32, 2, 4)
        assert torch.equal(buf.obs.sum(-1), torch.ones(32, 2)) and set(buf.obs.unique().tolist()) == {0.0, 1.0}
        # SAME_STEP autoreset: each truncated episode's value comes from V(one-hot(its final observation)).
        for i, sub in enumerate(trainer.envs.envs):
            finals = sub.unwrapped.finals
            steps = torch.nonzero(buf.has_final[:, i]).flatten()
            assert len(steps) == len(finals) == 4
            with torch.inference_mode():
                expected = trainer.policy.value(torch.eye(4)[[f - 10 for f in finals]])
            # atol: the batch size changes the last bit of a matmul
            torch.testing.assert_close(buf.final_values[steps, i], expected, rtol=0, atol=1e-6)
    finally:
        trainer.envs.close()


def test_cli_trains_frozenlake(tmp_path):
    rc = main(["train", "--env", "FrozenLake-v1", "--env-kwargs", '{"is_slippery": false}', "--run-dir",
               str(tmp_path / "r"), "--quiet", "--total-timesteps", "512"])
    assert rc == 0
    assert (tmp_path / "r" / "metrics.csv").exists()
