"""ppokit export: ONNX and TorchScript graphs act as ``ppokit eval``'s policy (normalization folded in, the env's
actions); the archive is one file that ppokit.load and ppokit eval read."""

from __future__ import annotations

import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch

import ppokit
from ppokit.runtime import checkpoint as ckpt

TINY = dict(num_envs=2, num_steps=64, num_minibatches=2, update_epochs=2, total_timesteps=512, normalize_obs=True,
            tensorboard=False, log_every=1000, seed=5)


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "ppokit", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module", params=["CartPole-v1", "Pendulum-v1"])
def run(request, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("export") / "run"
    ppokit.train(ppokit.PPOConfig(env_id=request.param, **TINY), run_dir=run_dir, console_enabled=False)
    return run_dir


def _observations(env_id: str, n: int = 200) -> np.ndarray:
    """n observations the env really emits (random actions), some scaled far out to reach the normalizer's clip."""
    env = gym.make(env_id)
    env.action_space.seed(0)
    obs, _ = env.reset(seed=0)
    rows = []
    for _ in range(n):
        rows.append(obs)
        obs, _, terminated, truncated, _ = env.step(env.action_space.sample())
        if terminated or truncated:
            obs, _ = env.reset()
    out = np.asarray(rows, dtype=np.float32)
    out[::10] *= 50.0
    return out


def _same_actions(got: np.ndarray, agent, obs: np.ndarray) -> None:
    want = agent.act(obs, deterministic=True)
    assert got.shape == want.shape
    if agent.policy.kind == "continuous":
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    else:
        np.testing.assert_array_equal(got, want)


def test_onnx_acts_as_the_eval_policy(run, tmp_path):
    ort = pytest.importorskip("onnxruntime", reason="ONNX export checks need pip install 'ppokit[export]'")
    pytest.importorskip("onnx", reason="ONNX export needs pip install 'ppokit[export]'")
    proc = _cli("export", str(run), "--format", "onnx", "--out", str(tmp_path / "policy.onnx"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    agent = ppokit.load(run)
    assert agent.obs_norm is not None and float(agent.obs_norm.rms.count) > 0  # the folding is exercised
    obs = _observations(agent.env_id)
    session = ort.InferenceSession(str(tmp_path / "policy.onnx"))
    (actions,) = session.run(None, {"obs": obs})
    _same_actions(actions, agent, obs)


def test_torchscript_acts_as_the_eval_policy(run, tmp_path):
    proc = _cli("export", str(run), "--format", "torchscript", "--out", str(tmp_path / "policy.pt"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    agent = ppokit.load(run)
    obs = _observations(agent.env_id)
    module = torch.jit.load(str(tmp_path / "policy.pt"))
    _same_actions(module(torch.as_tensor(obs)).numpy(), agent, obs)


def test_archive_is_one_file_that_load_and_eval_read(run, tmp_path):
    out = tmp_path / "model.ppokit"
    proc = _cli("export", str(run), "--format", "archive", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    state = ckpt.load_checkpoint(out)
    card = state["model_card"]
    agent = ppokit.load(run)
    assert card["env_id"] == agent.env_id and card["global_step"] == 512
    assert card["settings"]["num_steps"] == 64 and card["settings"]["normalize_obs"] is True
    assert "optimizer" not in state and "rng" not in state  # what acting needs, nothing more
    obs = _observations(agent.env_id, 50)
    np.testing.assert_array_equal(ppokit.load(out).act(obs), agent.act(obs))
    proc = _cli("eval", str(out), "--episodes", "1", cwd=tmp_path)
    assert proc.returncode == 0 and "mean return" in proc.stdout, proc.stderr


def test_export_refusals_are_one_line(tmp_path):
    proc = _cli("export", str(tmp_path / "missing"), "--format", "onnx", "--out", "x.onnx", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "no checkpoint" in proc.stderr
    proc = _cli("export", str(tmp_path), "--format", "onnx", "--out", "x.onnx", "--best", cwd=tmp_path)
    assert proc.returncode == 2 and "has no best.pt" in proc.stderr and proc.stderr.count("\n") == 1
    assert not (tmp_path / "x.onnx").exists()
