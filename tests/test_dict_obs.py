"""Dict and Tuple observations: one encoder per key (images through a CNN, vectors and one-hot codes through an
MLP), stored one tensor per key; a Dict key "action_mask" is the action mask; Blackjack-v1 (a Tuple) trains and
evaluates from the API and the CLI; a Dict run resumes from its checkpoint."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces

import ppokit
from ppokit.cli import main
from ppokit.config.ppo_config import load_preset
from ppokit.envs import check_spaces
from ppokit.envs.encoders import DictEncoder, ImageEncoder, OneHotEncoder, encoder_from_spec, observation_encoder
from ppokit.envs.errors import EnvError, check_obs_batch
from ppokit.policies.encoder_networks import EncoderActorCritic
from ppokit.training.trainer import Trainer
from ppokit.update.epochs import Batch


class _PixelsAndCue(gym.Env):
    """Dict observation: noise pixels (3x36x36 uint8, no information) and a float ``cue`` in {-1, +1}; action 1
    pays when the cue is +1, action 0 when it is -1. 8-step episodes: random ~4, perfect 8."""

    observation_space = spaces.Dict({"pixels": spaces.Box(0, 255, (3, 36, 36), np.uint8),
                                     "cue": spaces.Box(-1.0, 1.0, (1,), np.float32)})
    action_space = spaces.Discrete(2)

    def _obs(self):
        self.sign = int(self.np_random.integers(2))
        pixels = self.np_random.integers(0, 256, size=(3, 36, 36), dtype=np.uint8)
        return {"pixels": pixels, "cue": np.array([1.0 if self.sign else -1.0], np.float32)}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        reward = float(int(action) == self.sign)
        self.t += 1
        return self._obs(), reward, False, self.t >= 8, {}


class _MaskedDict(gym.Env):
    """PettingZoo-style Dict: ``observation`` (Box(4)) and ``action_mask`` (int8, 1 = allowed; 1-3 of 4 actions
    allowed, drawn each step). Taking a masked action is counted in ``violations`` (class-wide) and costs -1."""

    observation_space = spaces.Dict({"observation": spaces.Box(-1.0, 1.0, (4,), np.float32),
                                     "action_mask": spaces.Box(0, 1, (4,), np.int8)})
    action_space = spaces.Discrete(4)
    violations = 0
    steps = 0

    def _obs(self):
        self.mask = np.zeros(4, np.int8)
        self.mask[self.np_random.permutation(4)[: int(self.np_random.integers(1, 4))]] = 1
        return {"observation": self.np_random.uniform(-1, 1, 4).astype(np.float32), "action_mask": self.mask.copy()}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        allowed = bool(self.mask[int(action)])
        type(self).violations += not allowed
        type(self).steps += 1
        self.t += 1
        return self._obs(), 1.0 if allowed else -1.0, False, self.t >= 10, {}


def _config(**overrides):
    cfg = load_preset("gridworld")
    cfg.num_envs, cfg.num_steps, cfg.seed, cfg.tensorboard = 4, 64, 0, False
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


# ------------------------------------------------------------------------------------------ the encoders
def test_a_dict_gets_one_encoder_per_key_and_its_mask_key_is_no_input():
    space = spaces.Dict({"img": spaces.Box(0, 255, (40, 40, 3), np.uint8), "pos": spaces.Box(-1, 1, (2, 2)),
                         "room": spaces.Discrete(3, start=1), "action_mask": spaces.MultiBinary(5)})
    enc = observation_encoder(space)
    assert isinstance(enc, DictEncoder) and enc.mask_key == "action_mask"
    assert list(enc.parts) == ["img", "pos", "room"]  # the mask is not an input
    assert isinstance(enc.parts["img"], ImageEncoder) and isinstance(enc.parts["room"], OneHotEncoder)
    assert enc.flat_dim == 3 * 40 * 40 + 4 + 3 and enc.normalizable  # "pos" is a float vector
    batch = {"img": np.full((2, 40, 40, 3), 7, np.uint8), "pos": np.arange(8.0).reshape(2, 2, 2),
             "room": np.array([3, 1]), "action_mask": np.ones((2, 5), np.int8)}
    out = enc.encode(batch, 2)
    assert set(out) == {"img", "pos", "room"}
    assert out["img"].shape == (2, 3, 40, 40) and out["img"].dtype == np.uint8
    np.testing.assert_array_equal(out["pos"], np.arange(8.0, dtype=np.float32).reshape(2, 4))
    np.testing.assert_array_equal(out["room"], np.eye(3, dtype=np.float32)[[2, 0]])
    assert encoder_from_spec(enc.spec()).spec() == enc.spec()
    assert enc.layout() == {"img": ((3, 40, 40), torch.uint8), "pos": ((4,), torch.float32),
                            "room": ((3,), torch.float32)}


def test_a_tuple_is_a_dict_with_index_keys():
    enc = observation_encoder(gym.make("Blackjack-v1").observation_space)
    assert isinstance(enc, DictEncoder) and enc.tuple_space and list(enc.parts) == ["0", "1", "2"]
    assert not enc.normalizable  # three one-hot codes: nothing to standardize
    out = enc.encode((np.array([14, 20]), np.array([10, 1]), np.array([0, 1])), 2)
    np.testing.assert_array_equal(out["0"].argmax(1), [14, 20])
    np.testing.assert_array_equal(out["2"], [[1, 0], [0, 1]])


def test_unsupported_entries_are_named():
    with pytest.raises(ValueError, match=r"MultiBinary.*at key 'bits'"):
        check_spaces(_Named())
    with pytest.raises(ValueError, match=r"key 'inner' is a nested Dict"):
        observation_encoder(spaces.Dict({"inner": spaces.Dict({"a": spaces.Discrete(2)})}))
    with pytest.raises(ValueError, match=r"shape \(3, 20, 20\).*too small for the Nature CNN.* \(at key 'img'\)"):
        observation_encoder(spaces.Dict({"img": spaces.Box(0, 255, (3, 20, 20), np.uint8)}))


class _Named(gym.Env):
    observation_space = spaces.Dict({"bits": spaces.MultiBinary(3)})
    action_space = spaces.Discrete(2)


def test_env_checks_name_the_bad_entry():
    space = _PixelsAndCue.observation_space
    good = {"pixels": np.zeros((2, 3, 36, 36), np.uint8), "cue": np.zeros((2, 1), np.float32)}
    out = check_obs_batch(good, 2, space, "E-v0", "step()", 5)
    assert out["pixels"].dtype == np.uint8 and out["cue"].dtype == np.float32
    with pytest.raises(EnvError, match=r"failed in step\(\) at global step 5: returned observations without the "
                                       r"Dict entry 'cue'"):
        check_obs_batch({"pixels": good["pixels"]}, 2, space, "E-v0", "step()", 5)
    with pytest.raises(EnvError, match=r"observation entry 'cue' of shape \(2, 3\), expected \(2, 1\)"):
        check_obs_batch({**good, "cue": np.zeros((2, 3))}, 2, space, "E-v0", "step()", 5)
    with pytest.raises(EnvError, match="expected a Dict of arrays"):
        check_obs_batch(np.zeros(2), 2, space, "E-v0", "step()", 5)


def test_a_batch_of_a_dict_observation_is_indexed_per_key():
    obs = {"a": torch.arange(10).reshape(5, 2), "b": torch.arange(5, dtype=torch.uint8)}
    batch = Batch(obs, torch.zeros(5), torch.arange(5.0), torch.zeros(5), torch.zeros(5), torch.zeros(5))
    assert len(batch) == 5
    mb = batch.index(torch.tensor([4, 1]))
    assert mb.obs["a"].tolist() == [[8, 9], [2, 3]] and mb.obs["b"].tolist() == [4, 1]
    assert mb.logp_old.tolist() == [4.0, 1.0]


# ------------------------------------------------------------------------------------------ end to end
def test_a_dict_image_and_vector_env_learns(tmp_path):
    cfg = _config(total_timesteps=1536, learning_rate=3e-3, num_minibatches=2)
    trainer = Trainer(cfg, run_dir=tmp_path / "r", console_enabled=False, env=_PixelsAndCue)
    assert isinstance(trainer.policy, EncoderActorCritic) and not trainer.fused
    buf = trainer.buffer.obs
    assert buf["pixels"].dtype == torch.uint8 and buf["pixels"].shape == (64, 4, 3, 36, 36)
    assert buf["cue"].dtype == torch.float32 and buf["cue"].shape == (64, 4, 1)
    run = trainer.run()
    assert bool(trainer.buffer.has_final.any())  # SAME_STEP truncations bootstrapped from the final Dict obs
    returns = [m["charts/episodic_return"] for m in run.metrics]
    assert returns[0] < 5.0 and np.mean(returns[-2:]) >= 6.5, returns
    agent = ppokit.load(run.run_dir, env=_PixelsAndCue)
    pixels = np.zeros((3, 36, 36), np.uint8)
    assert agent.act({"pixels": pixels, "cue": np.array([1.0], np.float32)}) == 1  # one observation
    batch = {"pixels": np.stack([pixels, pixels]), "cue": np.array([[-1.0], [1.0]], np.float32)}
    np.testing.assert_array_equal(agent.act(batch), [0, 1])
    with pytest.raises(ValueError, match=r"type ndarray, the policy expects a Dict with the entries \['cue', "
                                         r"'pixels'\]"):
        agent.act(np.zeros(3))
    with pytest.raises(ValueError, match="without the Dict entry 'pixels'"):
        agent.act({"cue": np.array([1.0], np.float32)})


def test_a_dict_action_mask_key_is_never_violated(tmp_path):
    _MaskedDict.violations = _MaskedDict.steps = 0
    # The evaluation gate (every 2nd update, never "solved") acts on the observation's mask too.
    cfg = _config(total_timesteps=1024, num_envs=2, ent_coef=0.05, eval_every=2, eval_threshold=1e9,
                  eval_episodes=2)
    trainer = Trainer(cfg, run_dir=tmp_path / "r", console_enabled=False, env=_MaskedDict)
    assert trainer.masked and not trainer.fused and list(trainer.buffer.obs) == ["observation"]
    run = trainer.run()
    assert _MaskedDict.steps >= 1024 and _MaskedDict.violations == 0
    gates = [m["charts/eval_return"] for m in run.metrics if not np.isnan(m["charts/eval_return"])]
    assert gates == [10.0] * 4
    assert trainer.buffer.masks is not None and not bool(trainer.buffer.masks.all())  # masks were stored
    agent = ppokit.load(run.run_dir, env=_MaskedDict)
    env = _MaskedDict()
    env.reset(seed=3)
    for _ in range(200):  # Agent.act reads the mask from the observation itself, greedy or sampled
        obs = env._obs()
        for deterministic in (True, False):
            assert obs["action_mask"][int(agent.act(obs, deterministic=deterministic))] == 1
    before = _MaskedDict.violations
    result = ppokit.evaluate(agent, episodes=3)
    assert _MaskedDict.violations == before and result["returns"] == [10.0, 10.0, 10.0]


def test_a_dict_run_resumes_from_its_checkpoint(tmp_path):
    cfg = _config(total_timesteps=256, num_envs=2, normalize_obs=True)
    first = ppokit.train(cfg, run_dir=tmp_path / "r", console_enabled=False, env=_PixelsAndCue)
    resumed = ppokit.resume(first.run_dir, total_timesteps=512, console_enabled=False, env=_PixelsAndCue)
    assert resumed.global_step == 512 and len(resumed.metrics) == 2


def test_blackjack_trains_and_evaluates_from_the_api(tmp_path):
    cfg = _config(env_id="Blackjack-v1", total_timesteps=1024)
    run = ppokit.train(cfg, run_dir=tmp_path / "r", console_enabled=False)
    assert isinstance(run.policy, EncoderActorCritic) and run.policy.obs_dim == 32 + 11 + 2
    agent = ppokit.load(run.run_dir)
    result = ppokit.evaluate(agent, episodes=5)
    assert len(result["returns"]) == 5 and all(r in (-1.0, 0.0, 1.0, 1.5) for r in result["returns"])
    assert np.ndim(agent.act((14, 10, 0))) == 0  # one Tuple observation as the env returns it
    batch = (np.array([14, 20, 5]), np.array([10, 1, 7]), np.array([0, 1, 0]))
    assert agent.act(batch).shape == (3,) and agent.act(batch)[0] == agent.act((14, 10, 0))


def test_blackjack_trains_and_evaluates_from_the_cli(tmp_path, capsys):
    run_dir = tmp_path / "bj"
    assert main(["train", "--env", "Blackjack-v1", "--total-timesteps", "512", "--num-envs", "2",
                 "--run-dir", str(run_dir), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["eval", str(run_dir), "--episodes", "3"]) == 0
    assert "Blackjack-v1: mean return" in capsys.readouterr().out


class _NaNCue(_PixelsAndCue):
    """Every 5th step's cue is NaN."""

    def _obs(self):
        obs = super()._obs()
        self.n = getattr(self, "n", 0) + 1
        if self.n % 5 == 0:
            obs["cue"] = np.array([np.nan], np.float32)
        return obs


def test_a_nan_in_a_dict_entry_is_counted_zeroed_and_not_trained_on(tmp_path):
    cfg = _config(total_timesteps=256, num_envs=2, normalize_obs=True)
    trainer = Trainer(cfg, run_dir=tmp_path / "r", console_enabled=False, env=_NaNCue)
    run = trainer.run()
    assert sum(m["diag/nonfinite_env"] for m in run.metrics) > 0
    buf = trainer.buffer
    assert bool(torch.isfinite(buf.obs["cue"]).all())  # zeroed before the policy saw it
    assert not bool(buf.valid.all())  # those steps are left out of the update
    assert bool(torch.isfinite(trainer.obs_norm.parts["cue"].rms.mean).all())  # and out of the statistics
