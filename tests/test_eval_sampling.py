"""``eval_deterministic``: the evaluation gate and ``ppokit eval`` act on the most likely action by default and
sample when it is off (CleanRL's published Atari scores sample), reproducibly from the gate's seed and without
touching the training run's random stream."""

from __future__ import annotations

import math

import pytest

from ppokit.cli import main
from ppokit.config.ppo_config import ConfigError, PPOConfig
from ppokit.core import schema as S
from ppokit.training.trainer import train

SMALL = dict(env_id="CartPole-v1", num_envs=2, num_steps=32, num_minibatches=2, update_epochs=1, total_timesteps=192,
             tensorboard=False, eval_every=1, eval_threshold=1e9, eval_episodes=8)


def _run(tmp_path, name: str, deterministic: bool) -> list[dict]:
    cfg = PPOConfig(**SMALL, eval_deterministic=deterministic)
    return train(cfg, run_dir=tmp_path / name, console_enabled=False).metrics


def _training(metrics: list[dict]) -> list[dict]:
    """What the run computed, without the gate's return and the timings."""
    return [{k: v for k, v in m.items() if k != S.EVAL_RETURN and not k.startswith("perf/") and k != S.SPS}
            for m in metrics]


def test_the_gate_samples_when_eval_deterministic_is_off_and_training_is_unchanged(tmp_path):
    greedy = _run(tmp_path, "greedy", True)
    sampled = _run(tmp_path, "sampled", False)
    again = _run(tmp_path, "again", False)
    assert len(greedy) == len(sampled) == 3
    # The gate's draws come from a forked RNG: the training itself is the same run, value for value.
    assert _training(greedy) == _training(sampled)
    assert [m[S.EVAL_RETURN] for m in sampled] == [m[S.EVAL_RETURN] for m in again]  # seeded by the gate's seed
    # Greedy and sampled actions play different episodes (measured: 96.5, 105.4, 74.2 greedy; the sampled gate
    # differs), so the setting reaches the gate.
    assert [m[S.EVAL_RETURN] for m in greedy] != [m[S.EVAL_RETURN] for m in sampled]
    assert all(math.isfinite(m[S.EVAL_RETURN]) for m in sampled)


def test_ppokit_eval_follows_the_runs_setting_and_the_flag_overrides_it(tmp_path, capsys):
    cfg = PPOConfig(**{**SMALL, "eval_every": 0, "eval_threshold": None, "total_timesteps": 64},
                    eval_deterministic=False)
    train(cfg, run_dir=tmp_path / "run", console_enabled=False)
    run = str(tmp_path / "run")
    assert main(["eval", run, "--episodes", "2"]) == 0
    assert "(stochastic)" in capsys.readouterr().out  # the run's own eval_deterministic = false
    assert main(["eval", run, "--episodes", "2", "--eval-deterministic"]) == 0
    assert "(deterministic)" in capsys.readouterr().out
    assert main(["eval", run, "--episodes", "2", "--no-eval-deterministic"]) == 0
    assert "(stochastic)" in capsys.readouterr().out


def test_a_non_boolean_eval_deterministic_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="eval_deterministic"):
        PPOConfig(eval_deterministic="sometimes").validate()
