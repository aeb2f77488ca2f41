"""The Atari details (atari.py) against their definitions, on the real ALE.

A ``Recorder`` right above the raw emulator (frameskip 1) logs every raw action, reward, reset and screen, so each
wrapper's effect is checked against what the emulator actually did, not against the wrapper's own bookkeeping.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("ale_py", reason="needs pip install -e '.[atari]'")
cv2 = pytest.importorskip("cv2", reason="needs pip install -e '.[atari]'")

import gymnasium as gym  # noqa: E402

from ppokit.envs import atari  # noqa: E402

atari.register_ale()


class Recorder(gym.Wrapper):
    """Logs the raw env's actions, rewards, resets and grayscale screens (one entry per emulator frame)."""

    def __init__(self, env):
        super().__init__(env)
        self.actions, self.rewards, self.screens, self.resets = [], [], [], 0

    def reset(self, **kw):
        self.resets += 1
        self.actions.clear()
        obs, info = self.env.reset(**kw)
        return obs, info

    def step(self, action):
        out = self.env.step(action)
        self.actions.append(int(action))
        self.rewards.append(float(out[1]))
        self.screens.append(self.env.unwrapped.ale.getScreenGrayscale().copy())
        return out


def recorded(game: str, train: bool = True):
    raw = Recorder(gym.make(f"ALE/{game}-v5", frameskip=1, repeat_action_probability=0.0))
    return atari.wrap_atari(raw, train=train), raw


def test_atari_ids_are_recognised():
    assert atari.is_atari_id("ALE/Breakout-v5") and atari.is_atari_id("ALE/Pong-v5")
    assert not atari.is_atari_id("CartPole-v1") and not atari.is_atari_id("ALE/NoSuchGame-v5")


def test_noop_reset_draws_1_to_30_noops_then_fires():
    env, raw = recorded("Breakout")
    counts = set()
    for seed in range(40):
        env.reset(seed=seed)
        acts = raw.actions
        # After the raw reset: k no-ops, then FIRE and action 2, each repeated for the 4 skipped frames.
        assert acts[-8:] == [1] * 4 + [2] * 4, acts
        noops = acts[:-8]
        assert set(noops) <= {0}
        counts.add(len(noops))
    assert min(counts) >= 1 and max(counts) <= 30
    assert len(counts) > 15  # drawn uniformly, not a constant


def test_no_fire_reset_for_games_without_fire():
    env, raw = recorded("Freeway")
    env.reset(seed=0)
    assert set(raw.actions) == {0} and 1 <= len(raw.actions) <= 30


def test_skip_repeats_the_action_and_maxes_the_last_two_frames():
    env, raw = recorded("Breakout")
    obs, _ = env.reset(seed=3)
    assert obs.shape == (4, 84, 84) and obs.dtype == np.uint8
    for action in (2, 3, 3, 2, 1, 0):
        n = len(raw.actions)
        obs, *_ = env.step(action)
        assert raw.actions[n:] == [action] * 4  # one agent step = 4 emulator frames
        pooled = np.maximum(raw.screens[-2], raw.screens[-1])
        expected = cv2.resize(pooled, (84, 84), interpolation=cv2.INTER_AREA)
        np.testing.assert_array_equal(obs[-1], expected)  # the newest of the stacked frames


def test_frame_stack_holds_the_last_four_frames_channels_first():
    env, _ = recorded("Breakout")
    obs, _ = env.reset(seed=0)
    np.testing.assert_array_equal(obs[0], obs[3])  # a reset repeats its frame (CleanRL's FrameStack)
    frames = [obs[-1]]
    for _ in range(5):
        obs, *_ = env.step(3)
        frames.append(obs[-1])
    np.testing.assert_array_equal(obs, np.stack(frames[-4:]))


def _play_until_life_loss(env, raw, rng):
    for _ in range(5000):
        obs, reward, terminated, truncated, info = env.step(int(rng.integers(4)))
        if terminated or truncated:
            return terminated, truncated
    raise AssertionError("no life lost in 5000 steps")


def test_life_loss_ends_the_training_episode_but_not_the_game():
    env, raw = recorded("Breakout")
    env.reset(seed=0)
    ale = raw.unwrapped.ale
    terminated, truncated = _play_until_life_loss(env, raw, np.random.default_rng(0))
    assert terminated and not truncated
    assert ale.lives() == 4 and not ale.game_over()
    resets = raw.resets
    env.reset()
    # The same game goes on: no emulator reset, one no-op (4 frames), then FIRE and 2 (4 frames each).
    assert raw.resets == resets and ale.lives() == 4
    assert raw.actions[-12:] == [0] * 4 + [1] * 4 + [2] * 4
    # Only a real game over resets the emulator.
    for _ in range(4):
        _play_until_life_loss(env, raw, np.random.default_rng(1))
        env.reset()
    assert raw.resets == resets + 1 and ale.lives() == 5


def test_evaluation_episode_is_the_whole_game_with_its_unclipped_score():
    env, raw = recorded("SpaceInvaders", train=False)
    env.reset(seed=0)
    rng = np.random.default_rng(0)
    score, lives_seen = 0.0, set()
    for _ in range(20_000):
        obs, reward, terminated, truncated, info = env.step(int(rng.integers(6)))
        score += reward
        lives_seen.add(raw.unwrapped.ale.lives())
        if terminated or truncated:
            break
    assert terminated and raw.unwrapped.ale.game_over()
    assert len(lives_seen) >= 3  # the episode went on across life losses
    assert raw.resets == 1  # one game
    # The return is the emulator's own total (SpaceInvaders scores 5-30 a hit: clipping would show).
    assert score == sum(raw.rewards) and score > 50
    assert score > np.count_nonzero(raw.rewards)


def test_training_reward_is_the_sign_of_the_raw_reward():
    env, raw = recorded("SpaceInvaders", train=True)
    env.reset(seed=1)
    rng = np.random.default_rng(1)
    raw_sums = []
    for _ in range(600):
        n = len(raw.rewards)
        _, reward, terminated, truncated, _ = env.step(int(rng.integers(6)))
        raw_sum = sum(raw.rewards[n:])
        raw_sums.append(raw_sum)
        assert reward == np.sign(raw_sum)
        if terminated or truncated:
            env.reset()
    assert max(raw_sums) > 1  # rewards above 1 were seen and clipped


def test_native_vector_mode_is_refused_for_atari_with_the_reason():
    from ppokit.config.ppo_config import ConfigError

    with pytest.raises(ConfigError, match="vector_mode.*life loss"):
        atari.make_atari_vec_env("ALE/Pong-v5", 2, "native")


def test_frameskip_in_env_kwargs_is_refused():
    from ppokit.config.ppo_config import ConfigError

    with pytest.raises(ConfigError, match="env_kwargs.*frameskip"):
        atari.make_atari_env("ALE/Pong-v5", {"frameskip": 2})


@pytest.mark.slow
def test_a_short_atari_run_trains_on_uint8_frames_and_evaluates_the_game_score(tmp_path):
    import torch

    import ppokit
    from ppokit.config.ppo_config import load_preset
    from ppokit.core import schema as S
    from ppokit.training.trainer import Trainer

    cfg = load_preset("atari")
    cfg.env_id, cfg.num_envs, cfg.num_steps, cfg.num_minibatches = "ALE/Breakout-v5", 2, 32, 2
    cfg.total_timesteps, cfg.tensorboard = 128, False
    cfg.eval_every, cfg.eval_threshold, cfg.eval_episodes = 2, 1e9, 2
    trainer = Trainer(cfg, run_dir=tmp_path / "run", console_enabled=False)
    # The frames are stored as they come: [T, N, 4, 84, 84] uint8 (28 KB a step, not 113 KB of floats).
    obs = trainer.buffer.obs
    assert obs.dtype == torch.uint8 and tuple(obs.shape) == (32, 2, 4, 84, 84)
    run = trainer.run()
    assert run.global_step == 128
    gate = run.metrics[-1][S.EVAL_RETURN]  # the gate's mean game score over 2 whole games
    assert gate >= 0 and gate == int(gate * 2) / 2
    result = ppokit.evaluate(ppokit.load(tmp_path / "run"), episodes=1)
    # One whole game (all 5 lives) and its unclipped score.
    assert result["returns"][0] == int(result["returns"][0]) >= 0 and result["lengths"][0] > 20


class GameRecorder(gym.Wrapper):
    """Placed right above ``AtariPreprocessing`` (one agent step per step): each whole game's summed raw reward
    and step count, closed where the game itself ends (the emulator's termination or truncation)."""

    def __init__(self, env):
        super().__init__(env)
        self.games, self.score, self.length = [], 0.0, 0

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.score += float(reward)
        self.length += 1
        if terminated or truncated:
            self.games.append((self.score, self.length))
            self.score, self.length = 0.0, 0
        return obs, reward, terminated, truncated, info


def test_a_training_rollout_logs_whole_game_scores_and_the_clipped_life_return(tmp_path):
    from ppokit.config.ppo_config import load_preset
    from ppokit.core import schema as S
    from ppokit.training.trainer import Trainer

    cfg = load_preset("atari")
    cfg.env_id, cfg.num_envs, cfg.num_steps, cfg.num_minibatches, cfg.update_epochs = "ALE/SpaceInvaders-v5", 2, 1024, 2, 1
    cfg.total_timesteps, cfg.tensorboard, cfg.eval_every = 2048, False, 0
    trainer = Trainer(cfg, run_dir=tmp_path / "run", console_enabled=False)
    recorders = []
    for env in trainer.envs.envs:  # observe each env right above AtariPreprocessing: beneath every ppokit wrapper
        while not isinstance(env.env, gym.wrappers.AtariPreprocessing):
            env = env.env
        env.env = GameRecorder(env.env)
        recorders.append(env.env)
    trainer.collector.reset(cfg.seed)  # the trainer's own first reset again, now seen by the recorders
    rollouts = []
    collect = trainer.collect_rollout

    def recorded_rollout():
        episodes, nonfinite = collect()
        rollouts.append((list(episodes), list(trainer.collector.life_episodes)))
        return episodes, nonfinite

    trainer.collect_rollout = recorded_rollout
    run = trainer.run()
    (games, lives), = rollouts
    metrics = run.metrics[-1]
    truth = [g for r in recorders for g in r.games]
    assert len(truth) >= 2  # random SpaceInvaders: a game of 3 lives is ~500-900 steps
    # Every logged episode is a whole game, its unclipped score and its length; order across envs aside, the same.
    assert sorted(games) == sorted(truth)
    assert metrics[S.EPISODES] == len(truth)
    assert metrics[S.EPISODIC_RETURN] == pytest.approx(np.mean([s for s, _ in truth]))
    assert metrics[S.EPISODIC_LENGTH] == pytest.approx(np.mean([n for _, n in games]))
    # Each game spans several training episodes (3 lives); their clipped returns are logged under their own name.
    assert len(lives) >= 3 * len(truth) and max(n for _, n in games) > max(n for _, n in lives)
    assert metrics[S.LIFE_RETURN] == pytest.approx(np.mean([r for r, _ in lives]))
    assert set(S.ATARI_METRICS) <= set(metrics)
    assert all(r == int(r) >= 0 for r, _ in lives)  # sums of reward signs
    # SpaceInvaders scores 5-30 a hit: a game's score is well above the signs of its lives' rewards.
    assert sum(s for s, _ in games) > 2 * sum(r for r, _ in lives)
