"""MuJoCo continuous control with the mujoco preset: the continuous details, normalization statistics that survive
save -> load and stay frozen at evaluation, and a short InvertedPendulum-v5 run that learns."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("mujoco", reason="needs pip install -e '.[mujoco]'")

import ppokit  # noqa: E402
from ppokit.config.planner import known_settings  # noqa: E402
from ppokit.config.ppo_config import load_preset  # noqa: E402
from ppokit.core import schema as S  # noqa: E402
from ppokit.runtime import checkpoint as ckpt  # noqa: E402
from ppokit.training.trainer import CHECKPOINT_NAME, Trainer  # noqa: E402

ENV = "InvertedPendulum-v5"


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    # MuJoCo writes its warnings to MUJOCO_LOG.TXT in the working directory: keep it out of the checkout.
    monkeypatch.chdir(tmp_path)


def _config(total: int, **kw):
    cfg = load_preset("mujoco")
    cfg.env_id, cfg.total_timesteps, cfg.tensorboard = ENV, total, False
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def test_mujoco_preset_is_cleanrls_continuous_setting():
    cfg = load_preset("mujoco")
    assert (cfg.num_envs, cfg.num_steps, cfg.update_epochs, cfg.num_minibatches) == (1, 2048, 10, 32)
    assert (cfg.learning_rate, cfg.anneal_lr, cfg.gamma, cfg.gae_lambda, cfg.ent_coef) == (3e-4, True, 0.99, 0.95, 0.0)
    assert cfg.normalize_obs and cfg.normalize_reward and cfg.total_timesteps == 1_000_000
    # The planner answers MuJoCo ids with the preset.
    for env_id in ("Hopper-v5", "HalfCheetah-v4", "Walker2d-v5"):
        source, values, preset = known_settings(env_id)
        assert preset == "mujoco" and "CleanRL" in source


def test_continuous_policy_details(tmp_path):
    trainer = Trainer(_config(2048), run_dir=tmp_path / "run", console_enabled=False)
    try:
        policy = trainer.policy
        # State-independent log-std initialised at 0; separate actor and critic (no shared parameter).
        torch.testing.assert_close(policy.log_std.detach(), torch.zeros(1))
        assert not {id(p) for p in policy.actor.parameters()} & {id(p) for p in policy.critic.parameters()}
        # Observation normalization clips at 10, reward scaling at 10.
        assert trainer.obs_norm.clip == 10.0 and trainer.reward_scaler.clip == 10.0
        # Actions are clipped for the env only: the buffer holds the unclipped Gaussian sample, whose log-prob is
        # the one stored. A wide log-std makes samples beyond the +-3 bounds certain.
        with torch.no_grad():
            policy.log_std.fill_(2.0)
        trainer.collect_rollout()
        actions = trainer.buffer.actions.reshape(-1, 1)
        assert actions.abs().max() > 3.0
        obs = trainer.buffer.obs.reshape(-1, policy.obs_dim)
        logp, _, _ = policy.evaluate(obs, actions)
        torch.testing.assert_close(logp, trainer.buffer.logp.reshape(-1), rtol=1e-5, atol=1e-5)
    finally:
        trainer._close_envs()
        trainer._claim.release()


def test_normalization_statistics_survive_save_load_and_are_frozen_at_evaluation(tmp_path):
    trainer = Trainer(_config(4096), run_dir=tmp_path / "run", console_enabled=False)
    trainer.run()
    trained = {k: v.clone() for k, v in trainer.obs_norm.state_dict().items()}
    scaler = {k: v.clone() for k, v in trainer.reward_scaler.state_dict().items()}
    assert float(trained["count"]) >= 4096  # every step's observation was counted
    state = ckpt.load_checkpoint(tmp_path / "run" / CHECKPOINT_NAME)
    for k in trained:
        torch.testing.assert_close(state["obs_norm"][k], trained[k], rtol=0, atol=0)
        torch.testing.assert_close(state["reward_scaler"][k], scaler[k], rtol=0, atol=0)

    agent = ppokit.load(tmp_path / "run")
    for k in trained:
        torch.testing.assert_close(agent.obs_norm.state_dict()[k], trained[k], rtol=0, atol=0)
    # The agent acts on the saved statistics: its action is the actor's mean of clip((obs - mean) / std, 10),
    # computed here independently of ObsNormalizer.
    obs = np.array([0.05, -0.1, 0.3, -2.0], dtype=np.float64)
    mean, var = trained["mean"].numpy(), trained["var"].numpy()
    x = np.clip((obs - mean) / np.sqrt(var + 1e-8), -10, 10).astype(np.float32)
    with torch.no_grad():
        expected = np.clip(agent.policy.actor(torch.as_tensor(x)[None]).numpy()[0], -3, 3)
    np.testing.assert_allclose(agent.act(obs), expected, rtol=1e-5, atol=1e-6)

    ppokit.evaluate(agent, episodes=3)
    for k in trained:  # evaluation did not move them
        torch.testing.assert_close(agent.obs_norm.state_dict()[k], trained[k], rtol=0, atol=0)


def test_the_evaluation_gate_does_not_update_the_statistics(tmp_path):
    trainer = Trainer(_config(2048, eval_every=1, eval_threshold=1e9, eval_episodes=2), run_dir=tmp_path / "run",
                      console_enabled=False)
    trainer.run()
    before = {k: v.clone() for k, v in trainer.obs_norm.state_dict().items()}
    trainer.evaluate_gate()
    for k, v in trainer.obs_norm.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert not np.isnan(trainer.metrics[-1][S.EVAL_RETURN])


def test_short_inverted_pendulum_run_improves_its_return(tmp_path):
    run = ppokit.train(_config(10_240), run_dir=tmp_path / "run", console_enabled=False)
    returns = [m[S.EPISODIC_RETURN] for m in run.metrics]
    assert returns[-1] > 2 * returns[0], returns
    result = ppokit.evaluate(ppokit.load(tmp_path / "run"), episodes=3)
    assert result["mean"] > 2 * returns[0], (result, returns)


# ----------------------------------------------------------------- the CLI on a headless machine, as a user runs it
def _cli(args: list[str], cwd):
    """``python -m ppokit ARGS`` with no display and none of the rendering variables set (a fresh headless shell)."""
    import os
    import subprocess
    import sys

    drop = ("MUJOCO_GL", "PYOPENGL_PLATFORM", "DISPLAY", "WAYLAND_DISPLAY", "XDG_RUNTIME_DIR", "SDL_VIDEODRIVER")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return subprocess.run([sys.executable, "-m", "ppokit", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def _gl_backend_here() -> str | None:
    from ppokit.envs.video import HEADLESS_GL, _gl_works

    return next((b for b in HEADLESS_GL if _gl_works(b)), None)


def test_halfcheetah_commands_print_no_settotalmass_deprecation(tmp_path):
    # HalfCheetah's XML sets compiler/settotalmass; MuJoCo >= 3.4 warns on every compile of it.
    done = _cli(["train", "--env", "HalfCheetah-v5", "--preset", "mujoco", "--total-timesteps", "256", "--num-steps",
                 "128", "--quiet", "--no-tensorboard", "--run-dir", str(tmp_path / "run")], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "settotalmass" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    done = _cli(["eval", str(tmp_path / "run"), "--episodes", "1"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "settotalmass" not in done.stderr, done.stderr


def test_eval_video_renders_headless_without_mujoco_gl(tmp_path):
    backend = _gl_backend_here()
    done = _cli(["train", "--env", ENV, "--preset", "mujoco", "--total-timesteps", "256", "--num-steps", "128",
                 "--quiet", "--no-tensorboard", "--run-dir", str(tmp_path / "run")], tmp_path)
    assert done.returncode == 0, done.stderr
    done = _cli(["eval", str(tmp_path / "run"), "--episodes", "1", "--video", str(tmp_path / "videos")], tmp_path)
    assert "Traceback" not in done.stderr and "FatalError" not in done.stderr, done.stderr
    assert "XDG_RUNTIME_DIR" not in done.stderr, done.stderr
    if backend is None:  # no headless OpenGL on this machine: one line naming the variable to set
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and "MUJOCO_GL=egl" in lines[0], done.stderr
        return
    assert done.returncode == 0, done.stderr
    videos = list((tmp_path / "videos").glob("*.mp4"))
    assert len(videos) == 1 and videos[0].stat().st_size > 1000, videos
