"""The optional envpool backend (installed by the `envpool` extra, which CI installs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ppokit.config.ppo_config import PPOConfig
from ppokit.envs import make_vec_env
from ppokit.envs.state import capture_env_state
from ppokit.training.trainer import resume, train

# The whole module needs the optional package; without it every test here skips with this reason.
pytest.importorskip("envpool", reason="the envpool backend needs pip install -e '.[envpool]'")

torch.set_num_threads(1)


def test_envpool_cartpole_uses_next_step_autoreset():
    env = make_vec_env("CartPole-v1", 4, 0, "envpool")
    try:
        import gymnasium as gym

        assert env.metadata["autoreset_mode"] == gym.vector.AutoresetMode.NEXT_STEP
        obs, _ = env.reset(seed=3)
        assert obs.shape == (4, 4) and env.single_action_space.n == 2
        done_prev = np.zeros(4, dtype=bool)
        saw_reset_step = False
        for _ in range(200):
            obs, reward, terminated, truncated, _ = env.step(np.ones(4, dtype=np.int64))  # always push right: falls
            # The step after an episode end is envpool's reset step: reward 0, no termination.
            if done_prev.any():
                assert np.all(reward[done_prev] == 0.0) and not terminated[done_prev].any()
                saw_reset_step = True
            done_prev = terminated | truncated
        assert saw_reset_step
    finally:
        env.close()


def test_envpool_atari_id_maps_and_unknown_task_names_close_ones():
    env = make_vec_env("ALE/Pong-v5", 2, 0, "envpool")
    try:
        obs, _ = env.reset(seed=1)
        assert obs.shape == (2, 4, 84, 84) and env.single_action_space.n == 6
    finally:
        env.close()
    with pytest.raises(ValueError, match="CartPole-v1"):
        make_vec_env("CartPol-v1", 2, 0, "envpool")


def test_envpool_state_is_not_captured_in_checkpoints():
    # The pool's state lives in C++; a resumed run restarts its episodes (the trainer's NEXT_STEP handling is
    # tested for envpool in tests/test_trainer.py).
    env = make_vec_env("CartPole-v1", 2, 0, "envpool")
    try:
        env.reset(seed=0)
        assert capture_env_state(env) is None
    finally:
        env.close()


@pytest.mark.slow
def test_ppo_learns_cartpole_on_envpool_and_resumes(tmp_path):
    cfg = PPOConfig(env_id="CartPole-v1", vector_mode="envpool", num_envs=8, num_steps=32, total_timesteps=40_000,
                    learning_rate=1e-3, update_epochs=10, num_minibatches=1, gamma=0.98, gae_lambda=0.8,
                    ent_coef=0.0, clip_vloss=False, run_dir=str(tmp_path / "cp"), tensorboard=False)
    run = train(cfg, console_enabled=False)
    returns = [m["charts/episodic_return"] for m in run.metrics if not np.isnan(m["charts/episodic_return"])]
    assert np.mean(returns[-5:]) > 150, returns[-5:]
    resumed = resume(run.run_dir, total_timesteps=41_000, console_enabled=False)
    assert resumed.global_step == 40_960
