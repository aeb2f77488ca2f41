"""Env backends are one registration away: a toy backend registered here (no other module edited) trains through
``ppokit.train(vector_mode=...)``, its capabilities (not its name) decide the Gymnasium id check, and an unknown
``vector_mode`` is one line naming the field and every registered mode."""

from __future__ import annotations

import gymnasium as gym
import pytest

import ppokit
from ppokit.cli import main
from ppokit.config.ppo_config import ConfigError, PPOConfig
from ppokit.envs import backend_names, register_backend
from ppokit.envs.backends import unregister_backend
from ppokit.runtime import checkpoint as ckpt

BUILTIN = ("sync", "async", "native", "envpool")


def _sync(env_id: str, num_envs: int, seed, env_kwargs: dict, calls: list) -> gym.vector.VectorEnv:
    calls.append((env_id, num_envs, seed))
    return gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="sync",
                        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}, **env_kwargs)


@pytest.fixture
def toy():
    """A backend "toy" that builds Gymnasium's SyncVectorEnv and counts its calls; removed after the test."""
    calls: list = []
    register_backend("toy", lambda *args: _sync(*args, calls))
    yield calls
    unregister_backend("toy")


def _config(tmp_path, **fields) -> PPOConfig:
    return PPOConfig(**{**dict(env_id="CartPole-v1", num_envs=2, num_steps=16, total_timesteps=64, seed=1,
                               tensorboard=False, run_dir=str(tmp_path / "run")), **fields})


def test_the_builtin_backends_are_registered_in_order():
    assert backend_names()[:4] == BUILTIN


def test_a_registered_toy_backend_trains_and_resumes(toy, tmp_path):
    run = ppokit.train(_config(tmp_path, vector_mode="toy"), console_enabled=False)
    assert toy == [("CartPole-v1", 2, 1)]  # the training envs, built once by the toy backend
    assert len(run.metrics) == 2 and run.global_step == 64
    assert ckpt.load_checkpoint(run.checkpoint)["config"]["vector_mode"] == "toy"
    resumed = ppokit.resume(run.run_dir, total_timesteps=96, console_enabled=False)
    assert resumed.global_step == 96 and len(toy) == 2  # the resume built its envs with the toy backend too


def test_a_backend_with_its_own_task_ids_skips_the_gymnasium_id_check(tmp_path):
    calls: list = []
    # "Toy/Balance-v0" is no Gymnasium id: the backend maps its own task name to an env.
    register_backend("own-ids", lambda env_id, n, seed, kw: _sync("CartPole-v1", n, seed, kw, calls),
                     own_task_ids=True)
    try:
        run = ppokit.train(_config(tmp_path, env_id="Toy/Balance-v0", vector_mode="own-ids"), console_enabled=False)
    finally:
        unregister_backend("own-ids")
    assert calls == [("CartPole-v1", 2, 1)] and run.global_step == 64


def test_a_backend_without_own_task_ids_checks_the_gymnasium_id(toy, tmp_path):
    with pytest.raises(ValueError, match="Toy/Balance-v0"):
        ppokit.train(_config(tmp_path, env_id="Toy/Balance-v0", vector_mode="toy"), console_enabled=False)
    assert toy == [] and not (tmp_path / "run").exists()


def test_an_unknown_vector_mode_names_the_field_and_the_registered_modes(toy, tmp_path):
    with pytest.raises(ConfigError) as info:
        ppokit.train(_config(tmp_path, vector_mode="nope"), console_enabled=False)
    message = str(info.value)
    assert "'vector_mode'" in message and "\n" not in message
    assert f"must be one of {', '.join(BUILTIN)}, toy, got 'nope'" in message
    assert not (tmp_path / "run").exists()


def test_the_cli_refuses_an_unknown_vector_mode_in_one_line(tmp_path, capsys):
    rc = main(["train", "--env", "CartPole-v1", "--vector-mode", "nope", "--run-dir", str(tmp_path / "run"),
               "--quiet", "--no-tensorboard"])
    err = capsys.readouterr().err
    assert rc == 2 and "'vector_mode'" in err and ", ".join(BUILTIN) in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
