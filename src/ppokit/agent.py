"""A trained policy loaded from a run dir, for acting and evaluation (numpy in, numpy out)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import checkpoint as ckpt
from .config import PPOConfig
from .normalize import ObsNormalizer
from .policies import ActorCritic

__all__ = ["Agent", "load", "evaluate", "stored_config"]


class Agent:
    """pi_theta from a checkpoint with its saved observation normalization applied (frozen)."""

    def __init__(self, policy: ActorCritic, config: PPOConfig, obs_norm: ObsNormalizer | None = None,
                 action_low: np.ndarray | None = None, action_high: np.ndarray | None = None,
                 env_id: str | None = None, spaces: dict | None = None):
        self.policy = policy.eval()
        self.config = config
        # The env the agent acts in by default (the run's, unless load() was given another) and the run's spaces.
        self.env_id = env_id or config.env_id
        self.spaces = spaces
        self.obs_norm = obs_norm
        if obs_norm is not None:
            obs_norm.frozen = True
        self.action_low, self.action_high = action_low, action_high
        self.device = next(policy.parameters()).device

    def _obs(self, obs: Any) -> tuple[torch.Tensor, bool]:
        x = torch.as_tensor(np.asarray(obs, dtype=np.float32), device=self.device)
        # One observation is [obs_dim] (or the env's unflattened shape); anything with a leading batch axis is a batch.
        single = x.dim() == 1 or (x.numel() == self.policy.obs_dim and x.shape[0] != 1)
        x = x.reshape(1, -1) if single else x.reshape(x.shape[0], -1)
        if x.shape[1] != self.policy.obs_dim:
            raise ValueError(f"observation has {x.shape[1]} features, the policy expects {self.policy.obs_dim}")
        if self.obs_norm is not None:
            x = self.obs_norm.normalize(x)
        return x, single

    def act(self, obs: Any, deterministic: bool = True) -> np.ndarray:
        """Actions for one observation or a batch ``[B, ...]``; continuous actions clipped to the env bounds."""
        x, single = self._obs(obs)
        with torch.inference_mode():
            head = self.policy.actor(x)
            actions = self.policy.sample(head, deterministic).cpu().numpy()
        if self.policy.kind == "continuous" and self.action_low is not None:
            actions = np.clip(actions, self.action_low, self.action_high)
        return actions[0] if single else actions

    def value(self, obs: Any) -> np.ndarray | float:
        """V(obs) for one observation (a float) or a batch (``[B]`` array)."""
        x, single = self._obs(obs)
        with torch.inference_mode():
            v = self.policy.value(x).cpu().numpy()
        return float(v[0]) if single else v


def stored_config(state: dict, path: str | Path, allow_import: Any = ()) -> PPOConfig:
    """The run's config from a loaded checkpoint, refusing what the checkpoint must not decide on its own.

    A ``"module:Env-v0"`` env id would make Gymnasium import ``module`` (running its code); unless ``module`` is in
    ``allow_import`` that is refused before anything is built. A missing or invalid config (an unknown key, a
    bad value) raises ``CheckpointError`` naming the field.
    """
    from .config import ConfigError

    raw = state.get("config")
    if not isinstance(raw, dict):
        raise ckpt.CheckpointError(f"{path} is not a valid ppokit training checkpoint: it has no 'config' entry")
    ckpt.check_stored_env_id(raw.get("env_id"), allow_import, path)
    try:
        return PPOConfig.from_dict(raw)
    except ConfigError as exc:
        raise ckpt.CheckpointError(f"{path} has an invalid stored config: {exc}") from exc


def spaces_record(obs_space: Any, act_space: Any) -> dict[str, Any]:
    """What a checkpoint keeps of the run's spaces: their text (cut to a readable length) and Box action bounds."""
    record: dict[str, Any] = {"observation": str(obs_space)[:300], "action": str(act_space)[:300]}
    if hasattr(act_space, "low") and hasattr(act_space, "high"):
        record["action_low"] = torch.as_tensor(np.asarray(act_space.low, dtype=np.float32))
        record["action_high"] = torch.as_tensor(np.asarray(act_space.high, dtype=np.float32))
    return record


def describe_policy_spec(spec: Any) -> str:
    """``"4 observation features, discrete actions [2]"`` for a policy spec (or what is wrong with it)."""
    if not isinstance(spec, dict):
        return f"an unreadable policy spec {spec!r}"
    return f"{spec.get('obs_dim')} observation features, {spec.get('kind')} actions {spec.get('action_dims')}"


def _check_env_fits(policy: ActorCritic, env: Any, env_id: str, spaces: dict | None) -> None:
    """ValueError naming both sides when ``env``'s spaces are not the ones ``policy`` was trained for."""
    from .envs import check_spaces
    from .policies import action_spec

    obs_space, act_space = env.observation_space, env.action_space
    try:
        check_spaces(env)
        kind, dims = action_spec(act_space)
        obs_dim = int(np.prod(obs_space.shape))
    except ValueError as exc:
        raise ValueError(f"{env_id} cannot be used with this policy: {exc}") from None
    if (obs_dim, kind, list(dims)) == (policy.obs_dim, policy.kind, list(policy.action_dims)):
        return
    if spaces and "observation" in spaces and "action" in spaces:
        run = f"observation space {spaces['observation']} and action space {spaces['action']}"
    else:  # checkpoints from before the spaces were stored
        run = describe_policy_spec(policy.spec())
    raise ValueError(f"{env_id} does not match the trained policy: the run was trained on {run}, but {env_id} has "
                     f"observation space {obs_space} and action space {act_space}")


def _run_kwargs(config: PPOConfig, env_id: str) -> dict:
    """The run's env_kwargs apply to the run's own env id; another id gets none."""
    return dict(config.env_kwargs) if env_id == config.env_id else {}


def load(run_dir: str | Path, device: str = "cpu", *, env_id: str | None = None,
         allow_import: Any = ()) -> Agent:
    """Load the agent saved in ``run_dir`` (or a checkpoint file path).

    ``env_id`` is the env the agent will act in (default: the run's, built with the run's env_kwargs); it must
    have the run's spaces. A stored
    ``"module:Env-v0"`` id is refused unless ``module`` is in ``allow_import`` or ``env_id`` replaces it: loading
    never imports a module that only the checkpoint names. A damaged, diverged or inconsistent checkpoint raises
    :class:`~ppokit.checkpoint.CheckpointError`; an env with other spaces raises ``ValueError``.
    """
    from .trainer import CHECKPOINT_NAME

    path = Path(run_dir)
    if path.is_dir():
        path = path / CHECKPOINT_NAME
    # The policy and normalizer must be finite whatever the writer claimed ("finite" is part of the file).
    state = ckpt.load_checkpoint(path, map_location=device, require_finite=("policy", "obs_norm"))
    allowed = list(allow_import)
    if env_id is not None and isinstance(state.get("config"), dict):
        # The caller named the env to act in: the stored id stays a record and is never built, so its module
        # part imports nothing and needs no permission.
        allowed.append(str(state["config"].get("env_id", "")).partition(":")[0])
    config = stored_config(state, path, allowed)
    try:
        policy = ActorCritic(**state["policy_spec"]).to(device)
        policy.load_state_dict(state["policy"])
    except KeyError as exc:
        raise ckpt.CheckpointError(f"{path} is not a valid ppokit training checkpoint: it has no {exc.args[0]!r} "
                                   "entry") from exc
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ckpt.CheckpointError(f"{path} holds a policy that does not fit its policy_spec "
                                   f"({describe_policy_spec(state.get('policy_spec'))}): {ckpt.one_line(exc)}") from exc
    obs_norm = None
    if state.get("obs_norm") is not None:
        obs_norm = ObsNormalizer((policy.obs_dim,), device=device)
        try:
            obs_norm.load_state_dict(state["obs_norm"])
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise ckpt.CheckpointError(f"{path} has an unusable observation normalizer: {ckpt.one_line(exc)}") from exc
    spaces = state.get("spaces") if isinstance(state.get("spaces"), dict) else None
    act_env = env_id or config.env_id
    low = high = None
    if env_id is not None or (policy.kind == "continuous" and not (spaces and "action_low" in spaces)):
        # Build the env only when needed: to check the caller's env, or for old checkpoints' action bounds.
        from .envs import make_eval_env

        env = make_eval_env(act_env, env_kwargs=_run_kwargs(config, act_env))
        try:
            _check_env_fits(policy, env, act_env, spaces)
            if policy.kind == "continuous":
                low, high = np.asarray(env.action_space.low), np.asarray(env.action_space.high)
        finally:
            env.close()
    elif policy.kind == "continuous":
        low, high = spaces["action_low"].numpy(), spaces["action_high"].numpy()
    return Agent(policy, config, obs_norm, low, high, env_id=act_env, spaces=spaces)


def evaluate(agent: Agent, env_id: str | None = None, episodes: int = 10, deterministic: bool = True,
             seed: int = 10_000, video_dir: str | Path | None = None, *,
             env_kwargs: dict | None = None) -> dict[str, Any]:
    """Run ``episodes`` full episodes; returns ``{"mean", "std", "returns", "lengths"}`` of raw returns.

    ``env_id`` defaults to the env the agent was loaded for; another env must have the run's spaces.
    ``env_kwargs`` default to the run's for the run's own env id (none for another id).
    """
    from .envs import make_eval_env

    env_id = env_id or agent.env_id
    if env_kwargs is None:
        env_kwargs = _run_kwargs(agent.config, env_id)
    else:
        from .config import _coerce

        env_kwargs = _coerce("env_kwargs", env_kwargs, strict=True)
    env = make_eval_env(env_id, render_mode="rgb_array" if video_dir else None, env_kwargs=env_kwargs)
    try:
        _check_env_fits(agent.policy, env, env_id, agent.spaces)
    except ValueError:
        env.close()
        raise
    if video_dir:
        import gymnasium as gym

        env = gym.wrappers.RecordVideo(env, str(video_dir), episode_trigger=lambda i: True, disable_logger=True)
    returns, lengths = [], []
    try:
        for ep in range(episodes):
            obs, _ = env.reset(seed=seed + ep)
            total, n, done = 0.0, 0, False
            while not done:
                obs, reward, terminated, truncated, _ = env.step(agent.act(obs, deterministic=deterministic))
                total += float(reward)
                n += 1
                done = terminated or truncated
            returns.append(total)
            lengths.append(n)
    finally:
        env.close()
    return {"mean": float(np.mean(returns)), "std": float(np.std(returns)), "returns": returns, "lengths": lengths}
