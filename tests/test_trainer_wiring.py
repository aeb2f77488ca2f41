"""The training loop's wiring: what reaches the update, the normalizers and the logs.

Each test pins one line of ``Trainer`` whose removal leaves every number plausible, so that no learning test
would notice it: the clip-coefficient schedule, the rollout's observation-normalizer update, raw episodic
returns under reward scaling, the normalized final observation of a SAME_STEP truncation and the normalized
observations of the evaluation gate. All are quick (a few rollouts of toy envs).
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from ppokit.config.ppo_config import PPOConfig, load_preset
from ppokit.training.trainer import Trainer, train
from ppokit.update.epochs import ppo_epochs

torch.set_num_threads(1)

LIMIT = 5


class OffsetCounterEnv(gym.Env):
    """Reward ``reward`` every step, never terminates; a time limit of ``LIMIT`` steps ends each episode.
    Observation ``[offset + t]``: far from mean 0 / std 1, so a normalized observation never equals a raw one."""

    def __init__(self, offset: float = 10.0, reward: float = 1.0):
        self.offset, self.reward = float(offset), float(reward)
        self.observation_space = gym.spaces.Box(-100.0, 100.0, (1,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.array([self.offset], np.float32), {}

    def step(self, action):
        self.t += 1
        return np.array([self.offset + self.t], np.float32), self.reward, False, False, {}


ENV_ID = "ppokit_test/WiringOffsetCounter-v0"
if ENV_ID not in gym.registry:
    gym.register(ENV_ID, entry_point=OffsetCounterEnv, max_episode_steps=LIMIT)


def counter_config(tmp_path, **kw) -> PPOConfig:
    base = dict(env_id=ENV_ID, num_envs=2, num_steps=16, total_timesteps=64, num_minibatches=2, update_epochs=2,
                run_dir=str(tmp_path / "run"), tensorboard=False)
    base.update(kw)
    return PPOConfig(**base)


def close(trainer: Trainer) -> None:
    trainer.logger.close()
    trainer.envs.close()
    if trainer._eval_envs is not None:
        trainer._eval_envs.close()


def record_steps(trainer: Trainer) -> list[tuple]:
    """Wrap ``trainer.envs.step`` to keep every (next_obs, truncated, info) it returns."""
    seen: list[tuple] = []
    real_step = trainer.envs.step

    def step(actions):
        out = real_step(actions)
        seen.append((np.array(out[0], dtype=np.float32), np.array(out[3], dtype=bool), out[4]))
        return out

    trainer.envs.step = step
    return seen


# ------------------------------------------------------------------ clip_coef schedule
@pytest.mark.parametrize("fused", [True, False])
def test_annealed_clip_coef_reaches_the_update_and_the_log(tmp_path, fused):
    """anneal_clip: update u (0-based) of n uses clip_coef * (1 - u/n), in the update itself and in the log."""
    cfg = load_preset("gridworld")
    cfg.total_timesteps = 4 * cfg.batch_size
    cfg.run_dir, cfg.tensorboard, cfg.anneal_clip, cfg.fused_update = str(tmp_path / "r"), False, True, fused
    trainer = Trainer(cfg, console_enabled=False)
    used: list[float] = []

    def loop(batch, s, *a, **k):
        used.append(s.clip_coef)
        return ppo_epochs(batch, s, *a, **k)

    trainer.epoch_loop = loop
    run = trainer.run()
    expected = [cfg.clip_coef * (1 - u / 4) for u in range(4)]
    assert used == pytest.approx(expected)
    assert [m["charts/clip_coef"] for m in run.metrics] == pytest.approx(expected)


# ------------------------------------------------------------------ observation normalization in the rollout
def test_rollout_feeds_every_observation_to_the_normalizer_and_acts_on_normalized_ones(tmp_path):
    trainer = Trainer(counter_config(tmp_path, normalize_obs=True), console_enabled=False)
    try:
        first = trainer.next_obs_raw.copy()
        seen = record_steps(trainer)
        trainer.collect_rollout()
        raw = np.concatenate([obs for obs, _, _ in seen]).astype(np.float64)  # [T*N, 1]
        rms = trainer.obs_norm.rms
        assert float(rms.count) == raw.shape[0] == 16 * 2
        np.testing.assert_allclose(rms.mean.numpy(), raw.mean(0), rtol=1e-12)
        np.testing.assert_allclose(rms.var.numpy(), raw.var(0), rtol=1e-10)
        # The buffer holds what the policy acted on: step 0's reset obs and then each step's next_obs, all
        # normalized with the statistics of their time (the first with the identity statistics, as at reset).
        buf_obs = trainer.buffer.obs
        assert torch.equal(buf_obs[0], torch.as_tensor(first))
        assert float(buf_obs[1:].abs().max()) < 5.0  # raw observations are 10..15
    finally:
        close(trainer)


# ------------------------------------------------------------------ raw returns under reward scaling
def test_episodic_return_is_logged_raw_when_rewards_are_scaled(tmp_path):
    """Reward 2.5 for 5 steps per episode: the logged return is 12.5 although the learner sees scaled rewards."""
    gym.register("ppokit_test/WiringReward-v0", entry_point=OffsetCounterEnv, max_episode_steps=LIMIT,
                 kwargs={"reward": 2.5})
    try:
        run = train(counter_config(tmp_path, env_id="ppokit_test/WiringReward-v0", normalize_reward=True,
                                   total_timesteps=96), console_enabled=False)
    finally:
        del gym.registry["ppokit_test/WiringReward-v0"]
    logged = [m["charts/episodic_return"] for m in run.metrics]
    assert len(logged) == 3 and all(r == 12.5 for r in logged), logged
    assert all(m["charts/episodic_length"] == LIMIT for m in run.metrics)


# ------------------------------------------------------------------ SAME_STEP truncation bootstrap
def test_same_step_truncation_bootstraps_from_the_normalized_final_observation(tmp_path):
    trainer = Trainer(counter_config(tmp_path, normalize_obs=True), console_enabled=False)
    try:
        assert trainer.same_step
        seen = record_steps(trainer)
        checked: list[torch.Tensor] = []
        real_value = trainer.policy.value

        def value(obs):
            # Called for the truncated envs' final observations right after the step that truncated them
            # (acting may call value() too; those calls come with no truncation pending).
            if seen and seen[-1][1].any() and not seen[-1][2].get("_checked"):
                final_raw = np.stack([seen[-1][2]["final_obs"][i] for i in np.flatnonzero(seen[-1][1])])
                expected = trainer.obs_norm.normalize(torch.as_tensor(final_raw, dtype=torch.float32))
                torch.testing.assert_close(obs, expected.reshape(obs.shape))
                assert float(obs.abs().max()) < 5.0  # a raw final observation is offset + 5 = 15
                seen[-1][2]["_checked"] = True
                checked.append(obs)
            return real_value(obs)

        trainer.policy.value = value
        trainer.collect_rollout()
        n_trunc = sum(int(tr.sum()) for _, tr, _ in seen)
        assert n_trunc > 0 and sum(len(c) for c in checked) == n_trunc
        assert trainer.buffer.has_final.sum() == n_trunc
    finally:
        close(trainer)


# ------------------------------------------------------------------ the evaluation gate
@pytest.mark.parametrize("fused", [True, False])
def test_evaluation_gate_acts_on_normalized_observations(tmp_path, fused):
    trainer = Trainer(counter_config(tmp_path, normalize_obs=True, fused_update=fused, eval_every=1,
                                     eval_threshold=1e9, eval_episodes=3), console_enabled=False)
    try:
        assert trainer.fused == fused
        # Statistics of mean 12, std 2: every observation 10..15 normalizes into [-1, 1.5].
        rms = trainer.obs_norm.rms
        rms.mean, rms.var, rms.count = torch.full((1,), 12.0, dtype=torch.float64), \
            torch.full((1,), 4.0, dtype=torch.float64), torch.tensor(100.0, dtype=torch.float64)
        inputs: list[torch.Tensor] = []
        if fused:
            real_head = trainer.acting.actor_head
            trainer.acting.actor_head = lambda obs: (inputs.append(obs.clone()), real_head(obs))[1]
        else:
            trainer.policy.actor.register_forward_pre_hook(lambda mod, args: inputs.append(args[0].clone()))
        ret = trainer.evaluate_gate()
        assert ret == pytest.approx(LIMIT * 1.0)
        seen = torch.cat(inputs)
        assert seen.numel() == 3 * LIMIT
        expected = (torch.arange(LIMIT, dtype=torch.float32) + 10.0 - 12.0) / 2.0
        assert torch.allclose(seen.reshape(LIMIT, 3), expected.unsqueeze(1).expand(LIMIT, 3), atol=1e-6)
    finally:
        close(trainer)
