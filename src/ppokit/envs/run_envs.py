"""The vector envs a training run builds from its config: the training envs and the evaluation gate's."""

from __future__ import annotations

from typing import Any

from ppokit.envs.errors import EnvError, env_failure

__all__ = ["make_eval_envs", "make_train_envs"]


def make_train_envs(cfg: Any, custom_env: Any = None) -> Any:
    """The training vector env of ``cfg`` (``custom_env``: a resolved factory or instance); sets ``cfg.env_id``
    to a custom env's record name once it exists. A constructor that raises is one EnvError line."""
    from ppokit.envs import check_spaces, make_vec_env
    from ppokit.envs.atari import is_atari_id, make_atari_vec_env
    from ppokit.envs.backends import get_backend

    try:
        if custom_env is None and not get_backend(cfg.vector_mode).own_atari_wrappers and is_atari_id(cfg.env_id):
            # An ALE game gets the 9 Atari details (atari.py): the training stack clips rewards and ends an
            # episode at a life loss.
            envs = make_atari_vec_env(cfg.env_id, cfg.num_envs, cfg.vector_mode, cfg.env_kwargs, train=True)
            check_spaces(envs)
            envs.action_space.seed(cfg.seed)
            envs.single_action_space.seed(cfg.seed)
            return envs
        envs = make_vec_env(cfg.env_id, cfg.num_envs, cfg.seed, cfg.vector_mode, cfg.env_kwargs, env_fn=custom_env)
        if custom_env is not None:
            cfg.env_id = custom_env.name  # the record now that the env exists (spec id or custom:Class)
    except (ValueError, EnvError):
        raise  # an unknown id or unsupported spaces: already one clear line
    except Exception as exc:  # noqa: BLE001 - an env whose constructor raises: one line, not its traceback
        raise env_failure(cfg.env_id, "make()", 0, exc) from exc
    return envs


def make_eval_envs(cfg: Any, custom_env: Any = None) -> tuple[Any, int]:
    """The evaluation gate's vector env (``eval_episodes`` envs, unseeded until reset) and its step cap."""
    from ppokit.envs import make_vec_env
    from ppokit.envs.atari import is_atari_id, make_atari_vec_env
    from ppokit.envs.backends import get_backend
    from ppokit.envs.factory import _get_spec

    if custom_env is None and not get_backend(cfg.vector_mode).own_atari_wrappers and is_atari_id(cfg.env_id):
        # The game score: unclipped rewards over a whole game, across lives (atari.WholeGame); 108,000 frames cap
        # an ALE game (v5's max_num_frames_per_episode), 4 frames a step.
        return make_atari_vec_env(cfg.env_id, cfg.eval_episodes, "sync", cfg.env_kwargs, train=False), 27_000
    spec = _get_spec(cfg.env_id) if custom_env is None else None
    # Batched (native) where the env has one: an evaluation then costs about as much as a rollout step.
    mode = "native" if spec is not None and spec.vector_entry_point is not None else "sync"
    envs = make_vec_env(cfg.env_id, cfg.eval_episodes, None, mode, cfg.env_kwargs, env_fn=custom_env)
    return envs, (spec.max_episode_steps if spec is not None else None) or 100_000
