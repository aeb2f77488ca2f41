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

__all__ = ["Agent", "load", "evaluate"]


class Agent:
    """pi_theta from a checkpoint with its saved observation normalization applied (frozen)."""

    def __init__(self, policy: ActorCritic, config: PPOConfig, obs_norm: ObsNormalizer | None = None,
                 action_low: np.ndarray | None = None, action_high: np.ndarray | None = None):
        self.policy = policy.eval()
        self.config = config
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


def load(run_dir: str | Path, device: str = "cpu") -> Agent:
    """Load the agent saved in ``run_dir`` (or a checkpoint file path)."""
    from .trainer import CHECKPOINT_NAME

    path = Path(run_dir)
    if path.is_dir():
        path = path / CHECKPOINT_NAME
    state = ckpt.load_checkpoint(path, map_location=device)
    try:
        config = PPOConfig.from_dict(state["config"])
        policy = ActorCritic(**state["policy_spec"]).to(device)
        policy.load_state_dict(state["policy"])
    except (KeyError, TypeError, RuntimeError) as exc:
        raise ckpt.CheckpointError(f"{path} is not a valid ppokit training checkpoint: {exc}") from exc
    obs_norm = None
    if state.get("obs_norm") is not None:
        obs_norm = ObsNormalizer((policy.obs_dim,), device=device)
        obs_norm.load_state_dict(state["obs_norm"])
    low = high = None
    if policy.kind == "continuous":
        from .envs import make_eval_env

        env = make_eval_env(config.env_id)
        low, high = np.asarray(env.action_space.low), np.asarray(env.action_space.high)
        env.close()
    return Agent(policy, config, obs_norm, low, high)


def evaluate(agent: Agent, env_id: str | None = None, episodes: int = 10, deterministic: bool = True,
             seed: int = 10_000, video_dir: str | Path | None = None) -> dict[str, Any]:
    """Run ``episodes`` full episodes; returns ``{"mean", "std", "returns", "lengths"}`` of raw returns."""
    from .envs import make_eval_env

    env_id = env_id or agent.config.env_id
    env = make_eval_env(env_id, render_mode="rgb_array" if video_dir else None)
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
