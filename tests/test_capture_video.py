"""``--capture-video``: env 0 records every video_every-th episode into RUN_DIR/videos as a playable mp4 (frames
decode back at the env's render size), and what the run computes does not change."""

from __future__ import annotations

import numpy as np
import pytest

from ppokit.config.ppo_config import ConfigError, PPOConfig

pytest.importorskip("moviepy", reason="needs pip install -e '.[video]'")
pytest.importorskip("pygame", reason="classic-control rendering needs pip install -e '.[video]'")


def _config(tmp_path, name: str, **kw) -> PPOConfig:
    # 2 envs x 64 steps x 2 updates: env 0 finishes several CartPole episodes under a random-ish policy.
    base = dict(env_id="CartPole-v1", num_envs=2, num_steps=64, num_minibatches=2, update_epochs=1,
                total_timesteps=256, seed=3, tensorboard=False, log_every=1000, run_dir=str(tmp_path / name))
    base.update(kw)
    return PPOConfig(**base)


def test_capture_video_writes_playable_mp4s_of_env_0(tmp_path):
    from moviepy import VideoFileClip

    from ppokit.training.trainer import train

    run = train(_config(tmp_path, "video", capture_video=True, video_every=2), console_enabled=False)
    videos = sorted((run.run_dir / "videos").glob("*.mp4"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    episodes = [int(p.stem.rsplit("-", 1)[1]) for p in videos]
    assert episodes and episodes[:2] == [0, 2] and all(e % 2 == 0 for e in episodes)  # every 2nd episode
    assert all(p.name.startswith("train-step0-episode-") for p in videos)
    clip = VideoFileClip(str(videos[0]))
    try:
        frames = list(clip.iter_frames())
        assert clip.size == [600, 400] and len(frames) >= 8  # CartPole renders 600x400, an episode >= 8 steps
        assert frames[0].shape == (400, 600, 3) and frames[0].dtype == np.uint8 and frames[0].std() > 0
    finally:
        clip.close()
    # Recording changes nothing the run computes.
    plain = train(_config(tmp_path, "plain"), console_enabled=False)
    for a, b in zip(run.metrics, plain.metrics):
        assert {k: v for k, v in a.items() if not k.startswith("perf/") and k != "charts/SPS"} == \
               {k: v for k, v in b.items() if not k.startswith("perf/") and k != "charts/SPS"}


def test_capture_video_needs_sync_envs(tmp_path):
    with pytest.raises(ConfigError, match="capture_video.*vector_mode = sync"):
        _config(tmp_path, "v", capture_video=True, vector_mode="async").validate()
    with pytest.raises(ConfigError, match="video_every"):
        _config(tmp_path, "v", capture_video=True, video_every=0).validate()


def test_eval_video_prints_no_sdl_runtime_dir_line(tmp_path):
    # pygame's SDL says "XDG_RUNTIME_DIR is invalid or not set" on a headless shell unless its dummy driver is used.
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("XDG_RUNTIME_DIR", "SDL_VIDEODRIVER", "DISPLAY")}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ppokit", *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=600)

    done = cli("train", "--env", "CartPole-v1", "--preset", "cartpole", "--total-timesteps", "512", "--quiet",
               "--no-tensorboard", "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr
    done = cli("eval", str(tmp_path / "run"), "--episodes", "1", "--video", str(tmp_path / "videos"))
    assert done.returncode == 0, done.stderr
    assert "XDG_RUNTIME_DIR" not in done.stderr and done.stderr.strip() == "", done.stderr
    assert list((tmp_path / "videos").glob("*.mp4"))
