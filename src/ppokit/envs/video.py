"""``--capture-video``: env 0 of the training envs records an mp4 every ``video_every`` episodes, as CleanRL does.

CleanRL wraps its first env in Gymnasium's ``RecordVideo`` when ``--capture-video`` is set; so does ppokit, into
``RUN_DIR/videos``, once the run dir is claimed and before the first reset. The recorded env is built with
``render_mode="rgb_array"`` (the same dynamics: classic-control and MuJoCo rendering draw no random numbers), so a
run computes what it computes without video. Episodes are counted from the run's start; a file is written when
its episode ends (or when the run closes the envs mid-episode). Names carry the env step the run (or its resume)
started at, ``train-step<N>-episode-<k>.mp4``, so a resumed run never overwrites the videos of the run before.

Supported: registered Gymnasium ids with ``vector_mode = "sync"`` (the sub-envs live in this process), and custom
env factories that build their env with ``render_mode="rgb_array"``. Writing mp4 needs moviepy (extra
``ppokit[video]``, which also brings pygame for classic-control rendering).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ppokit.core.errors import ConfigError

__all__ = ["VIDEO_DIR", "require_video", "record_env0", "prepare_offscreen", "MUJOCO_GL_HINT"]

VIDEO_DIR = "videos"

# MuJoCo's headless OpenGL backends, in the order tried (EGL: GPU or Mesa's EGL; OSMesa: software).
HEADLESS_GL = ("egl", "osmesa")
MUJOCO_GL_HINT = ("MuJoCo found no display to render on: set MUJOCO_GL=egl (or MUJOCO_GL=osmesa) for headless "
                  "rendering, which needs libEGL (or libOSMesa)")


def prepare_offscreen(env_id: str | None) -> None:
    """Before an env is built to render ``rgb_array`` frames (``ppokit eval --video``, ``--capture-video``):

    * SDL's dummy video driver (pygame, classic control), so a headless machine prints no "XDG_RUNTIME_DIR is
      invalid" line; a driver the user set is kept;
    * for a Gymnasium MuJoCo id on Linux without a display and without ``MUJOCO_GL``: the first headless backend
      of ``HEADLESS_GL`` that creates a context, tried in a subprocess (a failed backend cannot be replaced in this
      process: PyOpenGL binds its platform once), set in ``MUJOCO_GL`` before MuJoCo's renderer is imported.
      Without this, Gymnasium tries GLFW first, which fails, and then EGL in a poisoned process (mujoco.FatalError).
      When none works, ``MUJOCO_GL`` stays unset and the render fails; the caller says ``MUJOCO_GL_HINT``.
    """
    import os
    import sys

    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    if (os.environ.get("MUJOCO_GL") or not sys.platform.startswith("linux") or os.environ.get("DISPLAY")
            or os.environ.get("WAYLAND_DISPLAY") or not _is_mujoco(env_id)):
        return
    for backend in HEADLESS_GL:
        if _gl_works(backend):
            os.environ["MUJOCO_GL"] = backend
            return


def _is_mujoco(env_id: str | None) -> bool:
    import gymnasium as gym

    entry = getattr(gym.registry.get(env_id or ""), "entry_point", None)
    return isinstance(entry, str) and entry.startswith("gymnasium.envs.mujoco")


def _gl_works(backend: str) -> bool:
    """Whether MuJoCo's ``backend`` creates an OpenGL context here (in a subprocess, ~1 s)."""
    import os
    import subprocess
    import sys

    code = (f"from mujoco.{backend} import GLContext\n"
            "context = GLContext(8, 8)\ncontext.make_current()\ncontext.free()\n")
    env = {k: v for k, v in os.environ.items() if k != "PYOPENGL_PLATFORM"}
    try:
        return subprocess.run([sys.executable, "-c", code], env={**env, "MUJOCO_GL": backend},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def require_video() -> None:
    """ConfigError for ``capture_video`` when moviepy (which writes the mp4 files) cannot be imported."""
    import importlib.util

    if importlib.util.find_spec("moviepy") is None:
        raise ConfigError("capture_video", "needs moviepy to write the videos, which is not installed: "
                                           "pip install 'ppokit[video]'")


def record_env0(envs: Any, env_id: str, env_kwargs: dict, folder: Path, every: int, start_step: int,
                custom: bool = False) -> None:
    """Replace sub-env 0 of the (un-reset) sync vector env ``envs`` by a ``RecordVideo`` of an ``rgb_array`` copy
    of it, recording every ``every``-th episode (0, every, 2*every, ...) into ``folder``."""
    import gymnasium as gym
    from gymnasium.wrappers import RecordVideo

    prepare_offscreen(None if custom else env_id)  # rgb_array frames are drawn off-screen
    subs = getattr(envs, "envs", None)
    if not subs:
        raise ConfigError("capture_video", "records env 0 of a sync vector env (sub-envs in this process); set "
                                           "vector_mode = sync")
    env0 = subs[0]
    if env0.render_mode != "rgb_array":
        if custom:
            raise ConfigError("capture_video", f"env 0 renders with render_mode={env0.render_mode!r}; a custom env "
                                               "factory must build its env with render_mode='rgb_array' to be "
                                               "recorded")
        try:
            replacement = gym.make(env_id, render_mode="rgb_array", **env_kwargs)
        except Exception as exc:  # noqa: BLE001 - an env without an rgb_array mode: one line
            raise ConfigError("capture_video", f"{env_id} cannot render rgb_array frames: {type(exc).__name__}: "
                                               f"{exc}") from None
        if replacement.observation_space != env0.observation_space or replacement.action_space != env0.action_space:
            replacement.close()  # env 0 is wrapped beyond gym.make (e.g. the Atari stack): not rebuilt here
            raise ConfigError("capture_video", f"env 0 of {env_id} is wrapped beyond gym.make, so it cannot be "
                                               "rebuilt to record it; this env has no video capture yet")
        env0.close()
        env0 = replacement
    subs[0] = RecordVideo(env0, str(folder), episode_trigger=lambda episode: episode % every == 0,
                          name_prefix=f"train-step{int(start_step)}", disable_logger=True)
