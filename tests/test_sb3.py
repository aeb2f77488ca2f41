"""ppokit.sb3.PPO: an SB3 script runs with its imports changed; the argument table translates and refuses by name;
the first update's losses are close to SB3's; save/load round trips through one safe file; callbacks run as SB3
counts them."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ppokit.sb3 import (
    PPO,
    BaseCallback,
    CheckpointCallback,
    EvalCallback,
    RecurrentPPO,
    SB3Error,
    StopTrainingOnRewardThreshold,
    make_vec_env,
)
from ppokit.sb3.translate import markdown_table

ROOT = Path(__file__).resolve().parents[1]

# RL-Zoo's CartPole-v1 PPO settings (rl_zoo3/hyperparams/ppo.yml), as SB3 keyword arguments.
ZOO = dict(n_steps=32, batch_size=256, gae_lambda=0.8, gamma=0.98, n_epochs=20, ent_coef=0.0)

# An SB3 user's script (SB3's README example, at RL-Zoo's CartPole settings): only the imports differ.
SCRIPT = """
import numpy as np
import torch
torch.set_num_threads(1)
{imports}

def lin(x):
    return lambda progress_remaining: progress_remaining * x

env = make_vec_env("CartPole-v1", n_envs=8)
model = PPO("MlpPolicy", env, n_steps=32, batch_size=256, gae_lambda=0.8, gamma=0.98, n_epochs=20, ent_coef=0.0,
            learning_rate=lin(0.001), clip_range=lin(0.2), seed=0)
model.learn(total_timesteps=100_000)
vec_env = model.get_env()
obs = vec_env.reset()
returns = []
while len(returns) < 16:
    action, _states = model.predict(obs, deterministic=True)
    obs, reward, done, info = vec_env.step(action)
    returns += [i["episode"]["r"] for i, d in zip(info, done) if d]
print("MEAN", np.mean(returns))
"""
SB3_IMPORTS = "from stable_baselines3 import PPO\nfrom stable_baselines3.common.env_util import make_vec_env"
PPOKIT_IMPORTS = "from ppokit.sb3 import PPO, make_vec_env"


def lin(x):
    return lambda progress_remaining: progress_remaining * x


@pytest.mark.slow
def test_sb3_script_solves_cartpole_with_the_import_changed(tmp_path):
    script = tmp_path / "train_cartpole.py"
    script.write_text(SCRIPT.format(imports=PPOKIT_IMPORTS))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    mean = float(proc.stdout.split("MEAN")[-1])
    assert mean >= 475, proc.stdout[-2000:]  # CartPole-v1 counts as solved at 475


def test_sb3_vec_env_is_translated_and_kept(tmp_path):
    sb3_env_util = pytest.importorskip("stable_baselines3.common.env_util",
                                       reason="SB3's VecEnv needs pip install -e '.[bench]'")
    venv = sb3_env_util.make_vec_env("CartPole-v1", n_envs=8)
    model = PPO("MlpPolicy", venv, learning_rate=lin(0.001), clip_range=lin(0.2), seed=0, **ZOO)
    assert (model.config.num_envs, model.config.num_minibatches, model.config.vf_coef) == (8, 1, 1.0)
    assert model.config.anneal_lr and model.config.anneal_clip and model.config.clip_coef == pytest.approx(0.2)
    model.learn(512)
    assert model.num_timesteps == 512 and model.get_env() is venv
    obs = venv.reset()
    action, state = model.predict(obs)
    assert action.shape == (8,) and state is None


def test_first_update_losses_close_to_sb3():
    sb3 = pytest.importorskip("stable_baselines3", reason="the comparison needs pip install -e '.[bench]'")
    from stable_baselines3.common.callbacks import BaseCallback as SB3Callback
    from stable_baselines3.common.env_util import make_vec_env as sb3_make_vec_env
    from stable_baselines3.common.logger import KVWriter, Logger

    class Rows(KVWriter):
        def __init__(self):
            self.rows = []

        def write(self, key_values, key_excluded, step=0):
            self.rows.append(dict(key_values))

    class StopAfterTwoRollouts(SB3Callback):  # SB3 logs update k's losses at the dump after rollout k + 1
        def _on_step(self):
            return self.num_timesteps <= 512

    class StopAfterOneUpdate(BaseCallback):
        def _on_step(self):
            return False

    writer = Rows()
    reference = sb3.PPO("MlpPolicy", sb3_make_vec_env("CartPole-v1", n_envs=8, seed=0), seed=0,
                        learning_rate=lin(0.001), clip_range=lin(0.2), **ZOO)
    reference.set_logger(Logger(None, [writer]))
    reference.learn(100_000, callback=StopAfterTwoRollouts())
    theirs = next(r for r in writer.rows if "train/value_loss" in r)

    model = PPO("MlpPolicy", make_vec_env("CartPole-v1", n_envs=8), seed=0, learning_rate=lin(0.001),
                clip_range=lin(0.2), **ZOO)
    model.learn(100_000, callback=StopAfterOneUpdate())
    assert model.num_timesteps == 256
    with open(model._run_dir / "metrics.csv") as f:
        ours = {k: float(v) for k, v in next(csv.DictReader(f)).items() if v not in ("", None)}
    # Different random streams (weights, env seeds, sampling, shuffles): close, not equal. ppokit's value loss is
    # 0.5 * mean((R - V)^2), SB3's mean((R - V)^2) (translate.py doubles vf_coef for it).
    assert 2 * ours["losses/value_loss"] == pytest.approx(theirs["train/value_loss"], rel=0.35)
    assert ours["losses/entropy_loss"] == pytest.approx(theirs["train/entropy_loss"], abs=0.02)
    assert ours["losses/policy_loss"] == pytest.approx(theirs["train/policy_gradient_loss"], abs=0.02)


def test_translation_of_schedules_batch_size_and_policy_kwargs():
    import torch.nn as nn

    model = PPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=16, learning_rate=lambda p: 3e-4,
                clip_range=0.1, clip_range_vf=0.1, vf_coef=0.25, target_kl=0.02,
                policy_kwargs=dict(net_arch=dict(pi=[32], vf=[32]), activation_fn=nn.ReLU), seed=3)
    cfg = model.config
    assert (cfg.num_envs, cfg.num_steps, cfg.num_minibatches) == (1, 64, 4)
    assert (cfg.learning_rate, cfg.anneal_lr, cfg.clip_coef, cfg.anneal_clip) == (3e-4, False, 0.1, False)
    assert (cfg.clip_vloss, cfg.vf_coef, cfg.target_kl, cfg.seed) == (True, 0.5, 0.02, 3)
    assert (cfg.hidden_sizes, cfg.activation, cfg.ent_coef) == ([32], "relu", 0.0)


@pytest.mark.parametrize("kwargs, named", [
    (dict(use_sde=True), "use_sde=True: ppokit has no state-dependent exploration"),
    (dict(batch_size=100), "batch_size=100 does not divide n_steps * n_envs = 2048 * 1 = 2048"),
    (dict(learning_rate=lambda p: 1e-3 * p * p), "learning_rate: the schedule"),
    (dict(clip_range=lambda p: 0.1 + 0.1 * p), "clip_range: the schedule"),
    (dict(clip_range_vf=0.5), "clip_range_vf=0.5"),
    (dict(policy_kwargs=dict(squash_output=True)), "policy_kwargs['squash_output']"),
    (dict(policy_kwargs=dict(net_arch=dict(pi=[64], vf=[128]))), "policy_kwargs['net_arch']"),
    (dict(policy_kwargs=dict(log_std_init=-1.0)), "policy_kwargs['log_std_init']"),
    (dict(n_epochs=50), "n_epochs (ppokit update_epochs)"),
    (dict(gamma=1.5), "gamma"),
    (dict(stats_window_size=10), "stats_window_size=10"),
])
def test_what_has_no_counterpart_is_refused_by_name(kwargs, named):
    with pytest.raises(SB3Error) as info:
        PPO("MlpPolicy", "CartPole-v1", **kwargs)
    assert named in str(info.value) and "\n" not in str(info.value)


def test_policy_name_must_fit_the_observation_space():
    with pytest.raises(SB3Error, match="policy='CnnPolicy': the observation space .* needs MlpPolicy"):
        PPO("CnnPolicy", "CartPole-v1")
    with pytest.raises(SB3Error, match="policy='MlpLstmPolicy'"):
        PPO("MlpLstmPolicy", "CartPole-v1")


def test_save_load_round_trip_in_one_safe_file(tmp_path):
    import gymnasium as gym

    import ppokit

    model = PPO("MlpPolicy", make_vec_env("Pendulum-v1", n_envs=2), n_steps=64, batch_size=32, seed=1)
    model.learn(256)
    model.save(tmp_path / "ppo_pendulum")  # SB3 adds .zip
    path = tmp_path / "ppo_pendulum.zip"
    assert path.is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["ppo_pendulum.zip"]
    obs = np.stack([gym.make("Pendulum-v1").observation_space.sample() for _ in range(50)])
    before, _ = model.predict(obs, deterministic=True)

    loaded = PPO.load(tmp_path / "ppo_pendulum")
    after, _ = loaded.predict(obs, deterministic=True)
    np.testing.assert_allclose(after, before, rtol=0, atol=1e-6)
    assert loaded.num_timesteps == 256 and loaded.get_env() is None
    # ppokit's own loader and CLI read the same file.
    np.testing.assert_allclose(ppokit.load(path).act(obs), before, atol=1e-6)
    proc = subprocess.run([sys.executable, "-m", "ppokit", "eval", str(path), "--episodes", "1"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "mean return" in proc.stdout, proc.stderr
    # Learning continues from the file: counters too when reset_num_timesteps is False.
    loaded.learn(128, reset_num_timesteps=False)
    assert loaded.num_timesteps == 384


def test_load_refuses_a_file_that_would_run_code(tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    torch.save({"config": {}, "policy": Payload()}, tmp_path / "evil.zip")
    with pytest.raises(Exception) as info:
        PPO.load(tmp_path / "evil.zip")
    assert not (tmp_path / "pwned").exists()
    assert "evil.zip" in str(info.value)


class Counting(BaseCallback):
    def __init__(self, stop_at: int | None = None):
        super().__init__()
        self.stop_at = stop_at
        self.counts = dict(start=0, rollout_start=0, step=0, rollout_end=0, end=0)
        self.steps_seen: list[int] = []

    def _on_training_start(self):
        self.counts["start"] += 1

    def _on_rollout_start(self):
        self.counts["rollout_start"] += 1

    def _on_step(self):
        self.counts["step"] += 1
        self.steps_seen.append(self.num_timesteps)
        return self.stop_at is None or self.n_calls < self.stop_at

    def _on_rollout_end(self):
        self.counts["rollout_end"] += 1

    def _on_training_end(self):
        self.counts["end"] += 1


def test_callbacks_are_called_as_sb3_counts_them(tmp_path):
    counting = Counting()
    checkpoints = CheckpointCallback(save_freq=64, save_path=str(tmp_path / "ckpt"))
    evaluation = EvalCallback(make_vec_env("CartPole-v1", n_envs=2), eval_freq=64, n_eval_episodes=3,
                              best_model_save_path=str(tmp_path / "best"), log_path=str(tmp_path / "eval"), verbose=0)
    model = PPO("MlpPolicy", make_vec_env("CartPole-v1", n_envs=8), n_steps=32, batch_size=64, seed=0)
    model.learn(1024, callback=[counting, checkpoints, evaluation])
    # 1024 steps = 4 rollouts of 32 steps of 8 envs: 128 calls of on_step, num_timesteps +8 each.
    assert counting.counts == dict(start=1, rollout_start=4, step=128, rollout_end=4, end=1)
    assert counting.steps_seen == list(range(8, 1025, 8))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["rl_model_1024_steps.zip", "rl_model_512_steps.zip"]
    assert (tmp_path / "best" / "best_model.zip").is_file()
    assert len(np.load(tmp_path / "eval" / "evaluations.npz")["timesteps"]) == 2
    best = PPO.load(tmp_path / "best" / "best_model.zip")
    assert best.num_timesteps in (512, 1024)


def test_a_callback_returning_false_stops_learn_after_that_update():
    counting = Counting(stop_at=40)  # during the second rollout's calls
    model = PPO("MlpPolicy", make_vec_env("CartPole-v1", n_envs=8), n_steps=32, batch_size=64, seed=0)
    model.learn(10_240, callback=counting)
    assert model.num_timesteps == 512 and counting.counts["step"] == 40 and counting.counts["rollout_end"] == 1


def test_stop_training_on_reward_threshold_through_eval_callback():
    stop = StopTrainingOnRewardThreshold(reward_threshold=-1e9)  # any evaluation is a new best above it
    evaluation = EvalCallback(make_vec_env("CartPole-v1"), callback_on_new_best=stop, eval_freq=32,
                              n_eval_episodes=1, verbose=0)
    model = PPO("MlpPolicy", make_vec_env("CartPole-v1", n_envs=8), n_steps=32, batch_size=64, seed=0)
    model.learn(10_240, callback=evaluation)
    assert model.num_timesteps == 256


def test_docs_table_is_the_translation_table():
    assert markdown_table() in (ROOT / "docs" / "sb3.md").read_text()


def test_import_ppokit_does_not_import_sb3():
    code = "import sys, ppokit; ppokit.train; ppokit.load; print(any(m.startswith('ppokit.sb3') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_untrained_model_predicts_and_saves(tmp_path):
    model = PPO("MlpPolicy", "CartPole-v1", seed=0)
    action, _ = model.predict(np.zeros(4, dtype=np.float32))
    assert action.shape == () and int(action) in (0, 1)
    model.save(tmp_path / "fresh.zip")
    loaded = PPO.load(tmp_path / "fresh.zip", env="CartPole-v1")
    loaded.learn(256)
    assert loaded.num_timesteps == 2048  # one whole rollout of n_steps=2048, as SB3 collects


def test_tensorboard_log_dirs_follow_sb3_numbering(tmp_path):
    model = PPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=64, tensorboard_log=str(tmp_path), seed=0)
    model.learn(64).learn(64, reset_num_timesteps=False).learn(64)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["PPO_1", "PPO_2"]
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "PPO_1").rglob("*"))
    with open(tmp_path / "PPO_1" / "metrics.csv") as f:
        assert len(list(csv.DictReader(f))) == 2


def test_sb3_vec_normalize_becomes_ppokit_normalization_and_other_wrappers_are_refused():
    pytest.importorskip("stable_baselines3", reason="SB3's VecEnv needs pip install -e '.[bench]'")
    import gymnasium as gym
    from stable_baselines3.common.env_util import make_vec_env as sb3_make_vec_env
    from stable_baselines3.common.vec_env import VecFrameStack, VecNormalize

    venv = VecNormalize(sb3_make_vec_env("Pendulum-v1", n_envs=2), norm_reward=False)
    cfg = PPO("MlpPolicy", venv, n_steps=64, batch_size=64).config
    assert (cfg.env_id, cfg.num_envs, cfg.normalize_obs, cfg.normalize_reward) == ("Pendulum-v1", 2, True, False)
    with pytest.raises(SB3Error, match="VecFrameStack has no ppokit counterpart"):
        PPO("MlpPolicy", VecFrameStack(sb3_make_vec_env("Pendulum-v1", n_envs=2), 4))
    with pytest.raises(SB3Error, match="wrapped in ClipAction, which ppokit would drop"):
        PPO("MlpPolicy", sb3_make_vec_env("Pendulum-v1", n_envs=2, wrapper_class=gym.wrappers.ClipAction))


def test_gymnasium_vector_env_is_rebuilt_from_its_id():
    import gymnasium as gym

    from ppokit.sb3 import VecEnv

    venv = gym.make_vec("CartPole-v1", num_envs=4, vectorization_mode="sync")
    model = PPO("MlpPolicy", venv, n_steps=32, batch_size=64)
    assert (model.config.env_id, model.config.num_envs, model.config.vector_mode) == ("CartPole-v1", 4, "sync")
    assert isinstance(model.get_env(), VecEnv) and model.get_env().num_envs == 4  # SB3's interface for its loops
    venv.close()


def test_recurrent_ppo_trains_an_lstm_and_predicts_with_its_state(tmp_path):
    model = RecurrentPPO("MlpLstmPolicy", "CartPole-v1", n_steps=64, batch_size=32, seed=0,
                         policy_kwargs=dict(lstm_hidden_size=16, shared_lstm=True))
    assert (model.config.recurrent, model.config.recurrent_hidden, model.config.recurrent_critic,
            model.config.num_minibatches) == ("lstm", 16, "shared", 2)
    model.learn(256)
    obs = np.zeros((1, 4), np.float32)
    _, state = model.predict(obs, state=None, episode_start=np.array([True]), deterministic=True)
    _, state2 = model.predict(obs, state=state, episode_start=np.array([False]), deterministic=True)
    assert state is not None and not torch.equal(state, state2)  # the LSTM state moves with each step
    model.save(tmp_path / "rppo")
    loaded = RecurrentPPO.load(tmp_path / "rppo.zip")
    _, again = loaded.predict(obs, state=None, episode_start=np.array([True]), deterministic=True)
    assert torch.equal(again, state)


@pytest.mark.parametrize("make, needle", [
    (lambda: PPO("MlpPolicy", "CartPole-v1", policy_kwargs=dict(lstm_hidden_size=8)), "an LSTM policy's option"),
    (lambda: RecurrentPPO("MlpPolicy", "CartPole-v1"),
     "RecurrentPPO has MlpLstmPolicy"),
    (lambda: RecurrentPPO(
        "MlpLstmPolicy", "CartPole-v1", policy_kwargs=dict(n_lstm_layers=2)), "n_lstm_layers"),
])
def test_recurrent_names_and_options_are_refused_where_they_do_not_apply(make, needle):
    with pytest.raises(SB3Error, match=needle):
        make()
