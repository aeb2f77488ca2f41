"""The cartpole-novel preset solves CartPole without velocities (issue: a deterministic evaluation of ~500 within
100k steps, on more than one seed). Its own file so the test runner can give these two long runs their own worker."""

from __future__ import annotations

from pathlib import Path

import pytest

import ppokit
from ppokit.config.ppo_config import load_preset
from ppokit.runtime.rundir import BEST_NAME


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_the_cartpole_novel_preset_balances_the_pole_without_velocities(seed, tmp_path):
    """RL-Zoo's ppo_lstm settings for CartPoleNoVel-v1 with its evaluation protocol (the best evaluated model kept,
    here the evaluation gate's best.pt) learn to balance the pole for the whole 500-step time limit without seeing
    a velocity.

    Measured on one machine (seeds 1-6): every seed's gate reached 500 over 10 deterministic episodes, at 15k-36k
    of the 100k steps; the final policy of a full 100k-step run without the gate evaluated 356.6 / 500 / 500 / 500 /
    500 / 203.6, which is why the best model, not the last, is what RL-Zoo reports and what this test evaluates."""
    cfg = load_preset("cartpole-novel")
    cfg.seed, cfg.tensorboard, cfg.run_dir = seed, False, str(tmp_path / "run")
    run = ppokit.train(cfg, console_enabled=False)
    assert run.global_step <= cfg.total_timesteps
    # A fresh evaluation of best.pt (other episode seeds than the gate's), frozen normalization, deterministic.
    result = ppokit.evaluate(ppokit.load(Path(run.run_dir) / BEST_NAME), episodes=10)
    assert result["mean"] >= 475, result
