"""Recurrent runs end to end: a memory task that only a recurrent policy learns, a checkpointed recurrent run that
loads and acts through ``Agent.predict`` and ``ppokit eval`` (state in, state out), the evaluation gate acting
with the state, a resume that continues bit for bit (the envs' live recurrent states are saved with the run), and
(slow) RL-Zoo's CartPoleNoVel-v1 settings reaching a return of ~500 in 100k steps on two seeds.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces

import ppokit
from ppokit.config.ppo_config import PPOConfig, load_preset
from ppokit.policies import RecurrentActorCritic
from ppokit.runtime.checkpoint import load_checkpoint

BLANKS = 3  # steps between the cue and the query


class MemoryCue(gym.Env):
    """A cue (+1 or -1, at random) in the first observation, ``BLANKS`` blank observations, then a query; the
    query's action is rewarded 1 when it names the cue (action 1 for +1, 0 for -1), and the episode ends. The
    query's observation is the same whatever the cue: a feed-forward policy gets 0.5 on average, a policy that
    remembers the cue gets 1."""

    observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)  # [cue, query flag]
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.cue = 0, int(self.np_random.integers(2))
        return np.array([2.0 * self.cue - 1.0, 0.0], np.float32), {}

    def step(self, action):
        self.t += 1
        if self.t <= BLANKS:
            return np.zeros(2, np.float32), 0.0, False, False, {}
        query = np.array([0.0, 1.0], np.float32)
        if self.t == BLANKS + 1:
            return query, 0.0, False, False, {}
        return query, float(int(action) == self.cue), True, False, {}  # the answer to the query


def _memory_config(tmp_path, recurrent: str) -> PPOConfig:
    # 8 envs x 25 steps: 5 episodes of 5 steps per env per rollout; 60 updates.
    return PPOConfig(env_id="custom", num_envs=8, num_steps=25, total_timesteps=60 * 200, num_minibatches=2,
                     update_epochs=4, learning_rate=3e-3, ent_coef=0.01, gamma=0.99, gae_lambda=0.95,
                     hidden_sizes=[32], recurrent=recurrent, recurrent_hidden=32, seed=0, tensorboard=False,
                     run_dir=str(tmp_path / recurrent))


def test_a_recurrent_policy_learns_the_memory_task_a_feedforward_one_cannot(tmp_path):
    scores = {}
    for recurrent in ("none", "lstm"):
        run = ppokit.train(_memory_config(tmp_path, recurrent), console_enabled=False, env=MemoryCue)
        agent = ppokit.load(run.run_dir, env=MemoryCue)
        scores[recurrent] = ppokit.evaluate(agent, env=MemoryCue, episodes=64, seed=0)["mean"]
    # Deterministic at the query, a feed-forward policy names one cue whatever was shown: chance, 0.5.
    assert scores["none"] <= 0.7, scores
    assert scores["lstm"] >= 0.95, scores


def _small_novel(tmp_path, name: str, **overrides) -> PPOConfig:
    cfg = load_preset("cartpole-novel")
    cfg.num_envs, cfg.num_steps, cfg.total_timesteps, cfg.update_epochs = 2, 16, 4 * 32, 2
    cfg.recurrent_hidden, cfg.hidden_sizes, cfg.seed, cfg.tensorboard = 16, [16], 3, False
    cfg.run_dir = str(tmp_path / name)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def test_a_recurrent_run_loads_and_acts_with_its_state_through_predict_and_ppokit_eval(tmp_path):
    cfg = _small_novel(tmp_path, "run", eval_every=1, eval_threshold=1e9, eval_episodes=2)
    run = ppokit.train(cfg, console_enabled=False)
    assert type(run.policy) is RecurrentActorCritic and len(run.metrics) == 4
    assert all(np.isfinite(m["charts/eval_return"]) for m in run.metrics)  # the gate acted with the state
    agent = ppokit.load(run.run_dir)
    assert agent.policy.spec() == run.policy.spec()
    obs = np.array([[0.01, -0.02], [0.1, 0.05], [-0.2, 0.0]], np.float32)
    with pytest.raises(ValueError, match=r"agent\.predict\(obs, state, episode_start\)"):
        agent.act(obs)
    actions, state = agent.predict(obs, deterministic=True)  # None: a fresh state for each of the 3 envs
    assert actions.shape == (3,) and state.shape == (3, 4, 16) and state.abs().sum() > 0
    again, state2 = agent.predict(obs, state, episode_start=np.zeros(3, bool), deterministic=True)
    assert not torch.equal(state2, state)  # the state moved on
    # An episode start resets that env's state: the same as starting afresh.
    restarted = agent.predict(obs, state, episode_start=np.ones(3, bool), deterministic=True)
    assert torch.equal(restarted[1], state) and np.array_equal(restarted[0], actions)
    # One observation, one action; the state is the one env's.
    one, one_state = agent.predict(obs[0], deterministic=True)
    assert np.ndim(one) == 0 and one_state.shape == (1, 4, 16)
    result = ppokit.evaluate(agent, episodes=2)
    assert len(result["returns"]) == 2 and all(r > 0 for r in result["returns"])

    # ppokit eval, with --video where the video extra is installed (the episodes recorded through predict).
    import importlib.util

    video = importlib.util.find_spec("moviepy") is not None and importlib.util.find_spec("pygame") is not None
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_RUNTIME_DIR", "SDL_VIDEODRIVER", "DISPLAY")}
    done = subprocess.run([sys.executable, "-m", "ppokit", "eval", str(run.run_dir), "--episodes", "2",
                           *(["--video", str(tmp_path / "videos")] if video else [])],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "ppokit/CartPoleNoVel-v1: mean return" in done.stdout, done.stdout
    if video:
        assert len(list((tmp_path / "videos").glob("*.mp4"))) == 2
    # The doctor and the report read a recurrent run as any other.
    from ppokit.cli import main

    assert main(["doctor", str(run.run_dir)]) == 0
    assert main(["report", str(run.run_dir)]) == 0 and (run.run_dir / "report.html").is_file()


def _rows(path):
    with open(path) as fh:
        return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in csv.DictReader(fh)]


def test_a_resumed_recurrent_run_continues_bit_for_bit(tmp_path):
    """Stopped after update 2 (by a callback) and resumed, a run ends exactly as the uninterrupted one: the
    checkpoint holds every env's live LSTM state (episodes run across the cut: 16 steps per rollout)."""
    full = ppokit.train(_small_novel(tmp_path, "full"), console_enabled=False)
    cut = ppokit.train(_small_novel(tmp_path, "cut"), console_enabled=False,
                       callbacks=[lambda info: info.update < 2])
    assert len(cut.metrics) == 2
    loop = load_checkpoint(cut.checkpoint)["loop"]
    assert loop["policy_state"].shape == (2, 4, 16) and loop["policy_state"].abs().sum() > 0
    resumed = ppokit.resume(cut.run_dir, console_enabled=False)
    assert resumed.global_step == full.global_step
    for (name, a), b in zip(full.policy.state_dict().items(), resumed.policy.state_dict().values()):
        assert torch.equal(a, b), name
    assert _rows(cut.run_dir / "metrics.csv") == _rows(full.run_dir / "metrics.csv")
