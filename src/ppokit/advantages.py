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


# A spread of at most this many ulps of |mean| is rounding noise, not signal: the computed mean of n equal
# float values is off by up to ~log2(n) ulps (pairwise summation), so the "centred" values of a constant vector
# are that error, and dividing them by an equally tiny std turns them into O(1) garbage (seven float32 copies of
# 0.1 normalize to -0.427 each). 32 ulps covers any batch below 2^32 elements; measured worst case on 2^21
# float32 elements is under 5 ulps.
SPREAD_ULPS = 32.0


def normalize(x: Tensor, eps: float = 1e-8, dim: int | None = None) -> Tensor:
    """Zero-mean, unit-std copy of ``x`` (population std): over all its elements, or along ``dim`` per slice.

    ``(x - mean) / (std + eps)``, except that a slice whose std is within rounding error of its mean
    (``std <= SPREAD_ULPS * finfo.eps * |mean|``, which includes every constant slice) becomes exactly 0: it holds
    no ordering information, only rounding noise. NaN/Inf inputs stay non-finite, so the update's guard still
    skips them. The fused update (``fused._normalize_rows``) calls this same function.
    """
    if dim is None:
        std, mean = torch.std_mean(x, unbiased=False)
    else:
        std, mean = torch.std_mean(x, dim, unbiased=False, keepdim=True)
    tol = SPREAD_ULPS * torch.finfo(x.dtype).eps
    # ``<=`` is False for a NaN std, so a non-finite input is not silently turned into zeros.
    noise = std <= tol * mean.abs()
    return torch.where(noise, torch.zeros_like(x), (x - mean) / (std + eps))
