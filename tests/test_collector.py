"""The rollout collector on its own (``collector.Collector``: no trainer, optimizer, logger or run dir), and the
trainer's acting coming from its own ``ActingKernel`` rather than the fused optimizer.

The collector's behaviour inside training runs (autoreset modes, truncation bootstrap, NaN/Inf, env checks,
timers) is pinned through the trainer in test_trainer.py, test_trainer_wiring.py, test_hostile_envs.py and
test_perf.py; test_bit_identity.py pins that runs compute what they did before the rollout moved here.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from ppokit.config.ppo_config import PPOConfig
from ppokit.envs import make_vec_env
from ppokit.envs.errors import EnvError
from ppokit.kernels.acting import ActingKernel
from ppokit.policies import build_policy
from ppokit.rollout.collector import Collector
from ppokit.training.trainer import Trainer

torch.set_num_threads(1)


class FailsAtStep(gym.Env):
    """Observation [t]; ``step`` raises at step ``fail_at`` (counted per env instance)."""

    observation_space = gym.spaces.Box(-1e3, 1e3, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, fail_at: int = 3):
        self.fail_at, self.t = fail_at, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.t += 1
        if self.t == self.fail_at:
            raise RuntimeError("simulator lost")
        return np.array([self.t], np.float32), 1.0, False, False, {}


def collector_for(envs, num_steps=32, fail=None):
    torch.manual_seed(0)
    policy = build_policy(envs.single_observation_space, envs.single_action_space, [16], "tanh")
    perf = {"env": 0.0, "inference": 0.0}

    def default_fail(*args, **kw):
        raise AssertionError(f"unexpected env failure {args} {kw}")

    col = Collector(envs, policy, policy, num_steps=num_steps, device=torch.device("cpu"), env_id="test",
                    obs_norm=None, reward_scaler=None, perf=perf, fail=fail or default_fail)
    return col, perf


def test_a_standalone_collector_fills_the_buffer_and_books_its_time():
    envs = make_vec_env("CartPole-v1", 4, 0, "native")  # NEXT_STEP autoreset
    try:
        col, perf = collector_for(envs)
        assert not col.same_step
        col.reset(seed=0)
        episodes, nonfinite = col.collect(global_step=0)
        buf = col.buffer
        assert nonfinite == 0 and episodes
        done = buf.terminated | buf.truncated
        # The step after an episode end is a reset, not a transition; each finished episode is reported once.
        assert torch.equal(buf.valid[1:], ~done[:-1])
        assert len(episodes) == int((done & buf.valid).sum())
        assert all(ret == float(length) for ret, length in episodes)  # CartPole pays +1 per step
        assert perf["env"] > 0 and perf["inference"] > 0
        # The buffer holds what the policy acted on and pi_old's log-probs of what it did.
        with torch.no_grad():
            logp, _, values = col.policy.evaluate(buf.obs.reshape(-1, 4), buf.actions.reshape(-1))
        torch.testing.assert_close(logp, buf.logp.reshape(-1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(values, buf.values.reshape(-1), rtol=1e-5, atol=1e-5)
    finally:
        envs.close()


def test_loop_state_round_trips_and_is_copied():
    envs = make_vec_env("CartPole-v1", 3, 0, "native")
    try:
        col, _ = collector_for(envs, num_steps=40)
        col.reset(seed=1)
        col.collect(0)
        state = col.loop_state()
        assert list(state) == ["next_obs_raw", "ep_return", "ep_length", "prev_done"]  # the checkpoint's keys
        other, _ = collector_for(envs, num_steps=40)
        other.load_loop_state(state)
        for key, value in state.items():
            np.testing.assert_array_equal(getattr(other, key), value.numpy())
        other.ep_return += 1.0  # no aliasing between the two collectors or with the saved tensors
        assert not np.array_equal(other.ep_return, col.ep_return)
        assert np.array_equal(state["ep_return"].numpy(), col.ep_return)
    finally:
        envs.close()


def test_an_env_failure_is_handed_to_fail_with_the_step_it_happened_at():
    envs = gym.vector.SyncVectorEnv([lambda: FailsAtStep(3) for _ in range(2)])
    calls = []

    def fail(step, rollout_start, exc=None, detail=None):
        calls.append((step, rollout_start, exc))
        return EnvError("ended")

    try:
        col, _ = collector_for(envs, num_steps=8, fail=fail)
        col.reset(seed=0)
        with pytest.raises(EnvError, match="ended"):
            col.collect(global_step=100)
        (step, start, exc), = calls
        # Two steps of 2 envs went through before the third step() raised.
        assert (step, start) == (104, 100) and "simulator lost" in str(exc)
    finally:
        envs.close()


def test_the_fused_trainer_acts_through_its_acting_kernel(tmp_path):
    cfg = PPOConfig(env_id="CartPole-v1", num_envs=2, num_steps=16, total_timesteps=64, num_minibatches=2,
                    eval_every=1, eval_episodes=2, eval_threshold=1e9, run_dir=str(tmp_path / "r"),
                    tensorboard=False)
    trainer = Trainer(cfg, console_enabled=False)
    try:
        assert trainer.fused and isinstance(trainer.acting, ActingKernel)
        calls = []
        act = trainer.acting.act

        def counted(*args, **kw):
            calls.append(1)
            return act(*args, **kw)

        trainer.acting.act = counted
        trainer.collect_rollout()
        assert trainer.global_step == 32 and len(calls) == cfg.num_steps  # one batched call per step
    finally:
        trainer.logger.close()
        trainer._close_envs()
        trainer._claim.release()
