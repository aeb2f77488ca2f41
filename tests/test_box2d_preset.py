"""LunarLander-v3 from the lunarlander preset, discrete and continuous (--env-kwargs '{"continuous": true}')."""

from __future__ import annotations

import csv

import pytest

pytest.importorskip("Box2D", reason="needs pip install -e '.[box2d]'")

import ppokit  # noqa: E402
from ppokit.cli import main  # noqa: E402
from ppokit.config.ppo_config import load_preset  # noqa: E402
from ppokit.core import schema as S  # noqa: E402


def test_lunarlander_preset_is_rl_zoos_setting():
    cfg = load_preset("lunarlander")
    assert cfg.env_id == "LunarLander-v3"
    assert (cfg.num_envs, cfg.num_steps, cfg.update_epochs, cfg.minibatch_size) == (16, 1024, 4, 64)
    assert (cfg.gamma, cfg.gae_lambda, cfg.ent_coef, cfg.learning_rate, cfg.anneal_lr) == (0.999, 0.98, 0.01, 3e-4,
                                                                                           False)
    assert not cfg.clip_vloss  # SB3's clip_range_vf=None


def test_lunarlander_trains_from_its_preset_on_the_cli(tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc = main(["train", "--preset", "lunarlander", "--total-timesteps", "16384", "--run-dir", str(run_dir),
               "--quiet", "--no-tensorboard"])
    assert rc == 0, capsys.readouterr().err
    rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    assert len(rows) == 1 and float(rows[0][S.EPISODES]) > 0  # one update of 16 x 1024 steps, episodes logged
    agent = ppokit.load(run_dir)
    assert agent.policy.kind == "discrete" and agent.policy.action_dims == [4]


def test_continuous_lunarlander_trains_a_gaussian_policy(tmp_path):
    cfg = load_preset("lunarlander")
    cfg.env_kwargs, cfg.total_timesteps, cfg.tensorboard = {"continuous": True}, 16384, False
    run = ppokit.train(cfg, run_dir=tmp_path / "run", console_enabled=False)
    assert run.global_step == 16384 and run.policy.kind == "continuous" and run.policy.action_dims == [2]
    result = ppokit.evaluate(ppokit.load(tmp_path / "run"), episodes=1)  # the run's env_kwargs: continuous again
    assert len(result["returns"]) == 1
