"""One way to get good settings: ``PPOConfig.for_env(X)`` and ``ppokit.train(X)`` use the planner's config exactly
as ``ppokit train --env X`` does (``planner.planned_config``, one function for both); ``PPOConfig(env_id=X)`` stays
the explicit library defaults."""

from __future__ import annotations

import pytest

import ppokit
from ppokit.cli import build_parser
from ppokit.cli.train import resolve_config
from ppokit.config.ppo_config import ConfigError, PPOConfig, load_preset


def _cli_config(*flags: str) -> PPOConfig:
    return resolve_config(build_parser().parse_args(["train", *flags]))[0]


def test_for_env_is_the_cli_config():
    assert PPOConfig.for_env("CartPole-v1") == _cli_config("--env", "CartPole-v1")
    # Overrides are applied as flags are: the same values typed or as command-line text.
    assert (PPOConfig.for_env("CartPole-v1", learning_rate=0.01, total_timesteps=2048, num_envs=4)
            == _cli_config("--env", "CartPole-v1", "--learning-rate", "0.01", "--total-timesteps", "2048",
                           "--num-envs", "4"))
    # An id with no published settings: the planner's rules from a probe, on both paths.
    grid = PPOConfig.for_env("ppokit/GridWorld-v0", total_timesteps=4096)
    assert grid == _cli_config("--env", "ppokit/GridWorld-v0", "--total-timesteps", "4096")
    assert grid.total_timesteps == 4096


def test_for_env_is_tuned_and_the_constructor_is_not():
    tuned, plain = PPOConfig.for_env("CartPole-v1"), PPOConfig(env_id="CartPole-v1")
    preset = load_preset("cartpole")
    # The cartpole preset's RL-Zoo values (and its 100k length), not the library defaults.
    for name in ("num_envs", "num_steps", "update_epochs", "num_minibatches", "gamma", "gae_lambda",
                 "learning_rate", "anneal_clip", "total_timesteps"):
        assert getattr(tuned, name) == getattr(preset, name), name
    assert (tuned.gamma, tuned.gae_lambda, tuned.learning_rate) == (0.98, 0.8, 1e-3)
    assert (plain.gamma, plain.gae_lambda, plain.learning_rate) == (0.99, 0.95, 2.5e-4)
    assert plain == PPOConfig()


def test_for_env_refuses_a_bad_override_by_name():
    with pytest.raises(ConfigError, match="did you mean learning_rate"):
        PPOConfig.for_env("CartPole-v1", lerning_rate=1e-3)
    with pytest.raises(ConfigError) as e:
        PPOConfig.for_env("CartPole-v1", gamma=1.5)
    assert e.value.field == "gamma"


def test_train_with_an_env_id_trains_the_tuned_config(tmp_path):
    run = ppokit.train("CartPole-v1", total_timesteps=512, run_dir=tmp_path / "run", console_enabled=False,
                       tensorboard=False)
    want = PPOConfig.for_env("CartPole-v1", total_timesteps=512, tensorboard=False, run_dir=str(tmp_path / "run"))
    saved = PPOConfig.from_toml(tmp_path / "run" / "config.toml")
    for cfg in (run.config, saved):
        assert (cfg.num_envs, cfg.num_steps, cfg.update_epochs, cfg.gamma, cfg.gae_lambda, cfg.learning_rate) == \
            (8, 32, 20, 0.98, 0.8, 1e-3)
        assert {k: v for k, v in cfg.to_dict().items() if k != "run_dir"} == \
            {k: v for k, v in want.to_dict().items() if k != "run_dir"}
    assert run.global_step == 512  # two updates of the preset's 8 x 32 batch


def test_train_applies_overrides_to_a_config_too(tmp_path):
    base = PPOConfig(env_id="ppokit/GridWorld-v0", num_envs=2, num_steps=32, tensorboard=False)
    run = ppokit.train(base, total_timesteps=128, run_dir=tmp_path / "run", console_enabled=False)
    assert run.config.total_timesteps == 128 and run.global_step == 128 and run.config.gamma == base.gamma
