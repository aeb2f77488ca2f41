"""``train(config, callbacks=[...])``: on_update sees every update's metrics, on_checkpoint every checkpoint, and a
callback returning False stops the run after that update with a checkpoint of it, ending like a finished run."""

from __future__ import annotations

import json

import pytest
import torch

import ppokit
from ppokit.config.ppo_config import PPOConfig
from ppokit.core import schema as S
from ppokit.training.callbacks import UpdateInfo


def _config(tmp_path, **kw) -> PPOConfig:
    base = dict(env_id="CartPole-v1", num_envs=2, num_steps=16, num_minibatches=2, update_epochs=1,
                total_timesteps=2 * 16 * 6, seed=1, tensorboard=False, save_every=1000, log_every=1000,
                run_dir=str(tmp_path / "run"))
    base.update(kw)
    return PPOConfig(**base)


class Recorder:
    def __init__(self, stop_at: int | None = None):
        self.stop_at, self.updates, self.checkpoints = stop_at, [], []

    def on_update(self, info: UpdateInfo):
        # The metrics row is the one logged to metrics.csv for this update.
        self.updates.append((info.update, info.global_step, info.metrics[S.UPDATE], info.trainer.update_idx))
        return False if info.update == self.stop_at else None

    def on_checkpoint(self, path):
        state = torch.load(path, weights_only=True)  # complete when the callback runs
        self.checkpoints.append((path.name, int(state["update"])))


def test_callbacks_see_every_update_and_checkpoint(tmp_path):
    rec, seen = Recorder(), []
    run = ppokit.train(_config(tmp_path, save_every=2), console_enabled=False,
                       callbacks=[rec, lambda info: seen.append(info.update)])  # a function is an on_update
    assert [u for u, *_ in rec.updates] == [1, 2, 3, 4, 5, 6] == seen
    assert all(step == u * 32 and float(u) == row == idx for u, step, row, idx in rec.updates)
    assert rec.checkpoints == [("checkpoint.pt", 2), ("checkpoint.pt", 4), ("checkpoint.pt", 6)]
    assert run.stopped_by_callback is None and not run.interrupted


def test_returning_false_stops_after_that_update_with_a_checkpoint(tmp_path):
    rec, later = Recorder(stop_at=2), Recorder()
    run = ppokit.train(_config(tmp_path), console_enabled=False, callbacks=[rec, later])
    assert run.global_step == 2 * 32 and len(run.metrics) == 2
    assert [u for u, *_ in later.updates] == [1, 2]  # every callback still saw the stopping update
    assert run.stopped_by_callback == "Recorder" and not run.interrupted
    # The stopping update is checkpointed (save_every is far away) and the run ended like a finished one.
    assert rec.checkpoints == [("checkpoint.pt", 2)]
    state = torch.load(run.checkpoint, weights_only=True)
    assert int(state["update"]) == 2 and int(state["global_step"]) == 64
    assert (run.run_dir / "curves.png").is_file()
    alerts = [json.loads(line) for line in (run.run_dir / "alerts.jsonl").read_text().splitlines()]
    stop = [a for a in alerts if a["name"] == "stopped_by_callback"]
    assert len(stop) == 1 and stop[0]["level"] == "info" and "Recorder" in stop[0]["message"]
    # The stopped run resumes to its full length like any other.
    resumed = ppokit.resume(run.run_dir, console_enabled=False)
    assert resumed.global_step == 6 * 32


def test_none_and_truthy_returns_continue(tmp_path):
    run = ppokit.train(_config(tmp_path, total_timesteps=2 * 16 * 3), console_enabled=False,
                       callbacks=[lambda info: None, lambda info: 0, lambda info: True])
    assert run.global_step == 3 * 32 and run.stopped_by_callback is None


def test_a_callback_without_hooks_is_refused_before_anything_is_built(tmp_path):
    with pytest.raises(TypeError, match=r"callbacks\[0\].*neither on_update nor on_checkpoint"):
        ppokit.train(_config(tmp_path), console_enabled=False, callbacks=[object()])
    assert not (tmp_path / "run").exists()
