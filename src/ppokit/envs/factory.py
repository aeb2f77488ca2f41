"""Building and validating the environments the trainer runs on."""

from __future__ import annotations

import difflib
import importlib
from typing import Any

import gymnasium as gym
from gymnasium import spaces
from gymnasium.envs.registration import EnvSpec

VECTOR_MODES = ("sync", "async", "native", "envpool")


def _split_module(env_id: str) -> tuple[str | None, str]:
    module, sep, name = env_id.rpartition(":")
    return (module, name) if sep else (None, env_id)


def _ensure_registered() -> None:
    # The factory can be imported on its own (e.g. in a subprocess); the GridWorld must exist first.
    from ppokit.envs import register_envs

    register_envs()


def check_env_id(env_id: str) -> None:
    """Raise ValueError naming the closest registered ids if ``env_id`` is not registered."""
    if not isinstance(env_id, str) or not env_id:
        raise ValueError(f"env_id must be a non-empty string, got {env_id!r}")
    _ensure_registered()
    module, _ = _split_module(env_id)
    if module is not None:
        # "module:Env-v0" registers on import; gymnasium reports its own errors for those.
        return
    if env_id in gym.registry:
        return
    ids = list(gym.registry.keys())
    # Compare case-insensitively so "cartpole-v1" still finds "CartPole-v1".
    by_lower: dict[str, str] = {}
    for i in ids:
        by_lower.setdefault(i.lower(), i)
    close = difflib.get_close_matches(env_id.lower(), list(by_lower), n=5, cutoff=0.6)
    suggestions = [by_lower[c] for c in close]
    if suggestions:
        hint = "Did you mean: " + ", ".join(repr(s) for s in suggestions) + "?"
    else:
        hint = "Run `python -c \"import gymnasium; gymnasium.pprint_registry()\"` to list the registered ids."
    raise ValueError(
        f"Unknown environment id {env_id!r}. {hint} "
        "(Environments from other packages need that package imported, or an id of the form 'module:EnvName-v0'.)"
    )


def _get_spec(env_id: str) -> EnvSpec:
    module, name = _split_module(env_id)
    if module is not None:
        importlib.import_module(module)
    return gym.spec(name)


def autoreset_mode(env: Any) -> gym.vector.AutoresetMode:
    """Autoreset mode a vector env declares in ``env.metadata`` (NEXT_STEP when it declares none)."""
    mode = getattr(env, "metadata", {}).get("autoreset_mode", gym.vector.AutoresetMode.NEXT_STEP)
    if isinstance(mode, gym.vector.AutoresetMode):
        return mode
    try:
        return gym.vector.AutoresetMode(mode)
    except ValueError:
        # Also accept the member name, e.g. "SAME_STEP", which is what people tend to write by hand.
        try:
            return gym.vector.AutoresetMode[str(mode)]
        except KeyError:
            raise ValueError(f"unrecognised autoreset_mode {mode!r} in env.metadata") from None


def check_spaces(env: Any) -> str:
    """Return "discrete" | "continuous" | "multidiscrete" from the (single) action space; ValueError if unsupported."""
    # A vector env describes one sub-env in single_*; a plain gym.Env only has the unbatched spaces.
    act = getattr(env, "single_action_space", None)
    act = env.action_space if act is None else act
    obs = getattr(env, "single_observation_space", None)
    obs = env.observation_space if obs is None else obs

    if not isinstance(obs, spaces.Box):
        extra = ""
        if isinstance(obs, spaces.Discrete):
            extra = (
                " A Discrete observation must be one-hot encoded first, e.g. with a wrapper that returns "
                "a float32 Box of length n."
            )
        raise ValueError(
            f"Unsupported observation space {obs}: ppokit only supports Box observations "
            f"(flat vectors or images).{extra}"
        )

    if isinstance(act, spaces.Discrete):
        # The policy samples indices 0..n-1; a shifted start would silently send wrong actions.
        if int(act.start) != 0:
            raise ValueError(f"Unsupported action space {act}: Discrete spaces must start at 0.")
        return "discrete"
    if isinstance(act, spaces.MultiDiscrete):
        if act.nvec.ndim != 1:
            raise ValueError(f"Unsupported action space {act}: MultiDiscrete must have a 1-D nvec.")
        if (act.start != 0).any():
            raise ValueError(f"Unsupported action space {act}: MultiDiscrete spaces must start at 0.")
        return "multidiscrete"
    if isinstance(act, spaces.Box):
        if len(act.shape) != 1:
            raise ValueError(
                f"Unsupported action space {act}: continuous actions must be a 1-D Box, got shape {act.shape}."
            )
        return "continuous"
    raise ValueError(
        f"Unsupported action space {type(act).__name__} ({act}): ppokit supports Discrete, "
        "MultiDiscrete and 1-D Box action spaces."
    )


def make_vec_env(
    env_id: str,
    num_envs: int,
    seed: int | None,
    vector_mode: str = "sync",
    env_kwargs: dict[str, Any] | None = None,
) -> gym.vector.VectorEnv:
    """Build ``num_envs`` envs, un-reset: "sync"/"async" with SAME_STEP autoreset, "native" the env's own vector
    class, "envpool" the optional envpool package (NEXT_STEP autoreset)."""
    if int(num_envs) < 1:
        raise ValueError(f"num_envs must be >= 1, got {num_envs}")
    if vector_mode not in VECTOR_MODES:
        raise ValueError(f"vector_mode must be one of {VECTOR_MODES}, got {vector_mode!r}")
    kwargs = dict(env_kwargs or {})

    if vector_mode == "envpool":
        from ppokit.envs.envpool_backend import EnvPoolVectorEnv

        # envpool has its own task list (Atari and MuJoCo need no Gymnasium registration there).
        env = EnvPoolVectorEnv(env_id, int(num_envs), seed, **kwargs)
    elif vector_mode in ("sync", "async"):
        check_env_id(env_id)
        # make_vec hands sub-processes an EnvSpec whose entry point is an import string,
        # so workers import ppokit.envs.gridworld themselves and need no registry state.
        env = gym.make_vec(
            env_id,
            num_envs=int(num_envs),
            vectorization_mode=vector_mode,
            vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
            **kwargs,
        )
    else:
        check_env_id(env_id)
        spec = _get_spec(env_id)
        if spec.vector_entry_point is None:
            raise ValueError(
                f"vector_mode='native' is not available for {env_id!r}: it has no vector entry point. "
                "Use vector_mode='sync' (or 'async')."
            )
        env = gym.make_vec(env_id, num_envs=int(num_envs), vectorization_mode="vector_entry_point", **kwargs)

    try:
        check_spaces(env)
    except ValueError:
        env.close()
        raise

    if seed is not None:
        # Only the spaces are seeded here: the trainer seeds the dynamics via env.reset(seed=seed).
        env.action_space.seed(seed)
        env.single_action_space.seed(seed)
    return env


def make_eval_env(
    env_id: str,
    render_mode: str | None = None,
    env_kwargs: dict[str, Any] | None = None,
) -> gym.Env:
    """Build one (un-reset) env for evaluation or rendering."""
    check_env_id(env_id)
    kwargs = dict(env_kwargs or {})
    if render_mode is not None:
        kwargs["render_mode"] = render_mode
    return gym.make(env_id, **kwargs)
