"""``ppokit doctor`` on REAL short trainings: each run is built to have one known defect, and the doctor's first
finding must name it; a healthy CartPole run must be reported healthy (exit 0)."""

from __future__ import annotations

import json

import gymnasium as gym
import pytest

from ppokit.cli import main
from ppokit.config import PPOConfig, load_preset
from ppokit.doctor import diagnose
from ppokit.trainer import train

ZERO_ID = "ppokit_test/ZeroRewardCartPole-v0"


class _ZeroReward(gym.Wrapper):
    """CartPole with every reward replaced by 0: episodes still end, but nothing can be learned."""

    def step(self, action):
        obs, _, terminated, truncated, info = self.env.step(action)
        return obs, 0.0, terminated, truncated, info


def _make_zero(**kwargs):
    return _ZeroReward(gym.make("CartPole-v1", **kwargs))


if ZERO_ID not in gym.registry:
    gym.register(ZERO_ID, entry_point=_make_zero)


def _run(tmp_path, name: str, **over):
    config = PPOConfig.from_dict({"tensorboard": False, **over}, load_preset("cartpole"))
    config.run_dir = str(tmp_path / name)
    run = train(config, console_enabled=False)
    return run.run_dir


def _first(run_dir):
    d = diagnose(run_dir)
    return d, d.findings[0].cause


def test_zero_reward_env_is_a_signal_problem(tmp_path):
    run_dir = _run(tmp_path, "zero", env_id=ZERO_ID, total_timesteps=6000)
    d, cause = _first(run_dir)
    assert cause == "rewards_all_zero", d.to_text()
    assert not d.healthy
    assert main(["doctor", str(run_dir)]) == 1


def test_learning_rate_zero_is_an_optimization_link_problem(tmp_path, capsys):
    run_dir = _run(tmp_path, "lr0", learning_rate=0.0, total_timesteps=6000)
    d, cause = _first(run_dir)
    assert cause == "lr_zero", d.to_text()
    # The lesson's Q3 order was followed: the signal passed, the optimization link failed.
    assert d.checks[0].startswith("1 signal validity") and "ok" in d.checks[0]
    assert "PROBLEM" in d.checks[1]
    assert main(["doctor", str(run_dir), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["healthy"] is False and out["findings"][0]["cause"] == "lr_zero"


def test_absurd_learning_rate_blows_up_kl(tmp_path):
    # lr 1.0 with the preset's 20 epochs: inside the guard rails (K <= 30, eps 0.2), so no --unsafe.
    run_dir = _run(tmp_path, "lr1", learning_rate=1.0, update_epochs=20, total_timesteps=6000)
    d, cause = _first(run_dir)
    assert cause == "kl_blowup", d.to_text()
    assert "update 1" in d.findings[0].evidence[0]  # evidence names where it happened


def test_huge_entropy_bonus_pins_entropy_not_collapse(tmp_path):
    # ent_coef is a BONUS: a huge one keeps the policy at maximum entropy (uniform), it does not collapse it.
    run_dir = _run(tmp_path, "ent5", ent_coef=5.0, total_timesteps=8000)
    d, cause = _first(run_dir)
    assert cause == "entropy_pinned", d.to_text()
    assert "lower ent_coef" in d.findings[0].fix
    assert all(f.cause != "entropy_collapse" for f in d.findings)


def test_entropy_collapse(tmp_path):
    # A true collapse: no entropy bonus and one huge Adam step (lr 1.0) per rollout saturate the logits within
    # 2-3 updates (entropy -> 0, always the same action, return ~9). With one epoch of one minibatch the measured
    # KL/clip fraction (taken before that single step) stay 0, so only the entropy shows it. (A smaller LR such as
    # 0.05-0.2 also collapses the entropy but the return can still rise: the doctor then only notes it.)
    run_dir = _run(tmp_path, "collapse", learning_rate=1.0, update_epochs=1, anneal_lr=False, ent_coef=0.0,
                   total_timesteps=8000)
    d, cause = _first(run_dir)
    assert cause == "entropy_collapse", d.to_text()
    assert "PROBLEM" in d.checks[2] and "ok" in d.checks[0] and "ok" in d.checks[1]


@pytest.mark.slow
def test_healthy_cartpole_run(tmp_path, capsys):
    run_dir = _run(tmp_path, "healthy", total_timesteps=40000)
    d, cause = _first(run_dir)
    assert d.healthy and cause == "healthy", d.to_text()
    assert main(["doctor", str(run_dir)]) == 0
    assert "HEALTHY" in capsys.readouterr().out


def test_doctor_rejects_a_non_run_directory(tmp_path):
    assert main(["doctor", str(tmp_path)]) == 2
