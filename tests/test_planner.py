"""``ppokit plan``: known environments get their published values, others the documented rules; every value has
a reason; the TOML output is the validated config and trains as-is."""

from __future__ import annotations

import importlib.util
import json
import sys

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

from ppokit.cli import main
from ppokit.config.planner import MIN_UPDATES, make_plan, probe_env
from ppokit.config.ppo_config import PPOConfig, load_preset

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

IMAGE_ID = "ppokit_test/TinyImage-v0"


class _TinyImage(gym.Env):
    """8x8x3 image observations, 2 actions, episodes of 10 steps."""

    observation_space = spaces.Box(0, 255, (8, 8, 3), np.uint8)
    action_space = spaces.Discrete(2)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.observation_space.sample(), {}

    def step(self, action):
        self.t += 1
        return self.observation_space.sample(), float(action), self.t >= 10, False, {}


if IMAGE_ID not in gym.registry:
    gym.register(IMAGE_ID, entry_point=_TinyImage)

SKILL_ITEMS = ("1. rollout N envs", "1. rollout T steps", "2. K epochs", "2. minibatch size", "2. learning rate",
               "3. eps (clip_coef)", "3. c_v (vf_coef)", "3. c_e (ent_coef)", "3. advantage normalization",
               "4. gamma", "4. GAE lambda")


def _check_every_item_has_a_reason(plan):
    rows = {item: reason for item, _, reason in plan.summary_rows()}
    for item in SKILL_ITEMS:
        assert rows.get(item), f"{item} has no reason"


def test_cartpole_uses_the_preset_and_the_budget():
    plan = make_plan("CartPole-v1", 30000)
    preset = load_preset("cartpole")
    expected = dict(preset.to_dict(), total_timesteps=30000)
    assert plan.config.to_dict() == expected
    assert "RL-Zoo" in plan.reasons["num_steps"]
    _check_every_item_has_a_reason(plan)
    # The probe ran: discrete actions, 4-dim observation, random CartPole episodes are short (~10-60 steps).
    assert plan.probe.action_kind == "discrete" and plan.probe.obs_shape == (4,)
    assert 8 <= plan.probe.typical_episode_length <= 60


@pytest.mark.parametrize("env_id,values,cite", [
    ("LunarLander-v3", {"num_envs": 16, "num_steps": 1024, "gamma": 0.999, "gae_lambda": 0.98, "update_epochs": 4,
                        "ent_coef": 0.01}, "RL-Zoo"),
    ("HalfCheetah-v5", {"num_envs": 1, "num_steps": 2048, "num_minibatches": 32, "update_epochs": 10,
                        "learning_rate": 3e-4, "ent_coef": 0.0}, "CleanRL"),
    ("Hopper-v5", {"num_steps": 2048, "update_epochs": 10}, "CleanRL"),
    ("ALE/Pong-v5", {"num_envs": 8, "num_steps": 128, "clip_coef": 0.1, "update_epochs": 4, "ent_coef": 0.01},
     "CleanRL"),
    ("BreakoutNoFrameskip-v4", {"num_envs": 8, "num_steps": 128, "clip_coef": 0.1}, "CleanRL"),
])
def test_known_environments_get_published_values(env_id, values, cite):
    plan = make_plan(env_id, 1_000_000)
    for k, v in values.items():
        assert getattr(plan.config, k) == v, k
    assert cite in plan.reasons["num_steps"]
    assert plan.config.total_timesteps == 1_000_000 and plan.config.env_id == env_id
    _check_every_item_has_a_reason(plan)


def test_atari_without_ale_py_still_plans_with_a_note():
    plan = make_plan("ALE/Pong-v5", 1_000_000)
    text = plan.to_markdown()
    assert "Atari wrappers" in text and "Nature CNN" in text  # said whether or not ale-py is installed
    if importlib.util.find_spec("ale_py") is None:
        assert not plan.probe.probed and "ale-py" in text


def test_probe_measures_episode_length_against_the_time_limit():
    # Pendulum never terminates: every random episode is exactly its 200-step time limit.
    probe = probe_env("Pendulum-v1")
    assert probe.action_kind == "continuous" and probe.episode_lengths == [200] * len(probe.episode_lengths)
    assert probe.typical_episode_length == 200 and len(probe.episode_lengths) >= 3


def test_probe_is_bounded_in_steps():
    probe = probe_env("Pendulum-v1", episodes=100, max_steps=450)
    assert probe.probe_steps == 450 and probe.episode_lengths == [200, 200]


def test_unknown_discrete_env_follows_the_rules():
    plan = make_plan("MountainCar-v0", 500_000, zoo=False)  # the rules, even where RL-Zoo has an entry
    c = plan.config
    assert plan.source.startswith("ppokit's rules")
    assert plan.probe.typical_episode_length == 200  # random MountainCar never reaches the flag
    assert c.batch_size >= 4 * 200  # several episodes per rollout
    assert c.num_updates >= MIN_UPDATES
    assert (c.update_epochs, c.ent_coef, c.clip_coef, c.norm_adv, c.anneal_lr) == (4, 0.01, 0.2, True, True)
    _check_every_item_has_a_reason(plan)


def test_small_budget_shrinks_the_batch_to_keep_50_updates():
    plan = make_plan("MountainCar-v0", 20_000, zoo=False)
    assert plan.config.num_updates >= MIN_UPDATES
    assert plan.config.batch_size <= 20_000 // MIN_UPDATES
    assert "budget" in plan.reasons["num_steps"]


def test_unknown_continuous_env_follows_the_rules():
    plan = make_plan("MountainCarContinuous-v0", 1_000_000, zoo=False)
    c = plan.config
    assert (c.ent_coef, c.update_epochs, c.normalize_obs, c.normalize_reward) == (0.0, 10, True, True)
    assert c.minibatch_size <= 128 and c.num_updates >= MIN_UPDATES
    _check_every_item_has_a_reason(plan)


def test_image_env_is_planned_with_a_note():
    plan = make_plan(IMAGE_ID, 100_000)
    assert plan.probe.image and plan.probe.obs_shape == (8, 8, 3)
    assert any("(8, 8, 3) are too small for the Nature CNN" in n for n in plan.notes)


def test_outputs_and_toml_roundtrip(tmp_path, capsys):
    out = tmp_path / "plan.toml"
    assert main(["plan", "--env", "Acrobot-v1", "--budget", "200000", "--out", str(out), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["config"]["env_id"] == "Acrobot-v1" and data["reasons"]["num_envs"]
    assert {d["metric"] for d in data["diagnostics"]} >= {"diag/approx_kl", "diag/clipfrac",
                                                          "diag/explained_variance", "diag/entropy"}
    text = out.read_text()
    tomllib.loads(text)  # valid TOML
    assert "# parallel envs" in text  # reasons are comments
    loaded = PPOConfig.from_toml(out)
    assert loaded.to_dict() == make_plan("Acrobot-v1", 200000).config.to_dict()
    assert main(["plan", "--env", "Acrobot-v1", "--budget", "200000"]) == 0
    md = capsys.readouterr().out
    for section in ("rollout N envs", "K epochs", "eps (clip_coef)", "GAE lambda", "Diagnostics plan", "0.02", "0.1",
                    "0.1 - 0.3", "explained_variance", "entropy"):
        assert section in md


@pytest.mark.slow
def test_planned_toml_trains_as_is(tmp_path, capsys):
    out = tmp_path / "plan.toml"
    assert main(["plan", "--env", "ppokit/GridWorld-v0", "--budget", "3000", "--out", str(out), "--no-probe"]) == 2
    capsys.readouterr()  # unknown env without probe cannot be planned: refused
    assert main(["plan", "--env", "ppokit/GridWorld-v0", "--budget", "3000", "--out", str(out)]) == 0
    run_dir = tmp_path / "run"
    assert main(["train", "--config", str(out), "--run-dir", str(run_dir), "--quiet", "--no-tensorboard"]) == 0
    assert PPOConfig.from_toml(run_dir / "config.toml").to_dict() == dict(
        PPOConfig.from_toml(out).to_dict(), run_dir=str(run_dir), tensorboard=False)


@pytest.mark.parametrize("budget", ["0", "-5", "abc"])
def test_bad_budget_is_refused(budget, capsys):
    assert main(["plan", "--env", "CartPole-v1", "--budget", budget]) == 2
    assert "total_timesteps" in capsys.readouterr().err


def test_unknown_env_is_refused(capsys):
    assert main(["plan", "--env", "CartPool-v1", "--budget", "1000"]) == 2
    assert "CartPole-v1" in capsys.readouterr().err


@pytest.mark.parametrize("budget", ["1e999", "0", "-5", "abc", "1.5", "inf"])
def test_plan_refuses_a_bad_budget_in_one_line(capsys, budget):
    from ppokit.cli import main

    assert main(["plan", "--env", "CartPole-v1", "--budget", budget]) == 2
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    assert "config field 'total_timesteps'" in out.err and budget in out.err
