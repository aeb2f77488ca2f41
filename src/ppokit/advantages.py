"""Advantage estimation: Generalized Advantage Estimation (Schulman et al. 2016) and normalization.

``terminated`` and ``truncated`` are kept apart (as in TorchRL): a termination cuts the bootstrap (the
episode really ended, the next state's value is 0), a truncation by a time limit does not (the value of the
true final observation is bootstrapped). Both cut the GAE recursion, since the next step of that env belongs
to a new episode.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["gae", "normalize"]


def gae(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor,
    terminated: Tensor,
    truncated: Tensor,
    gamma: float,
    gae_lambda: float,
) -> tuple[Tensor, Tensor]:
    """GAE over a time-major rollout; all inputs ``[T, N]``, returns ``(advantages, returns)``, both ``[T, N]``.

    ``values[t]`` is V(s_t); ``next_values[t]`` is V of the observation that followed step t (for a truncated
    step the final observation of that episode, never the reset observation).
    ``delta_t = r_t + gamma * (1 - terminated_t) * next_values[t] - values[t]`` and
    ``A_t = delta_t + gamma * lambda * (1 - done_t) * A_{t+1}`` with ``done = terminated or truncated``;
    ``returns = advantages + values``. One reverse loop over T, vectorized over N.
    """
    shape = rewards.shape
    for name, t in (("values", values), ("next_values", next_values), ("terminated", terminated), ("truncated", truncated)):
        if t.shape != shape:
            raise ValueError(f"gae: {name} has shape {tuple(t.shape)}, rewards has {tuple(shape)}; all must be [T, N]")
    if rewards.dim() != 2:
        raise ValueError(f"gae: expected [T, N] tensors, got {rewards.dim()} dims")
    not_terminated = 1.0 - terminated.to(rewards.dtype)
    not_done = 1.0 - (terminated | truncated).to(rewards.dtype)
    # Everything that does not depend on the recursion is computed for all steps at once.
    deltas = rewards + gamma * not_terminated * next_values - values
    decay = (gamma * gae_lambda) * not_done
    advantages = torch.empty_like(rewards)
    last = torch.zeros_like(rewards[0])
    for t in range(shape[0] - 1, -1, -1):
        last = deltas[t] + decay[t] * last
        advantages[t] = last
    return advantages, advantages + values


def normalize(x: Tensor, eps: float = 1e-8) -> Tensor:
    """Zero-mean, unit-std copy of ``x`` over all its elements (population std), any shape."""
    return (x - x.mean()) / (x.std(unbiased=False) + eps)
