"""The rollout buffer: preallocated, time-major ``[T, N, ...]`` tensors on the training device.

Written once per step during the rollout and read once per update; nothing is reallocated between rollouts and
nothing is copied from numpy storage at update time (the observations land here as tensors as they arrive).
The observation storage takes its shapes and dtypes from the observation encoder (``encoders``): a flat
``[T, N, obs_dim]`` float32 tensor, uint8 ``[T, N, C, H, W]`` for an image (bytes, not floats), or a dict of
such tensors, one per key, for a Dict/Tuple observation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class RolloutBuffer:
    """One rollout of ``T`` steps from ``N`` envs.

    ``logp`` is log pi_old(a|s), frozen at acting time: the denominator of every ratio in the update.
    ``valid`` is False for steps that carry no transition (the reset step of Gymnasium's NEXT_STEP autoreset,
    or a step whose observation or reward was non-finite); they are left out of the update.
    ``final_values`` holds V(final observation) for steps that were truncated by a time limit in SAME_STEP
    autoreset mode, where the observation returned is already the next episode's.
    """

    # [T, N, obs_dim] float32, normalized as the policy saw it | [T, N, C, H, W] uint8 | {key: one of those}
    obs: Any
    actions: Tensor  # [T, N] long (discrete) | [T, N, k] long (multidiscrete) | [T, N, D] float (continuous)
    logp: Tensor  # [T, N]
    values: Tensor  # [T, N] V(s_t) at acting time
    rewards: Tensor  # [T, N] (scaled when reward normalization is on)
    terminated: Tensor  # [T, N] bool
    truncated: Tensor  # [T, N] bool
    valid: Tensor  # [T, N] bool
    final_values: Tensor  # [T, N] V(final obs) where has_final, else 0
    has_final: Tensor  # [T, N] bool: the step ended an episode and its final obs was not the next obs
    # [T, N, n_logits] bool: the actions the env allowed at s_t (True = allowed); None when the env has no masks,
    # so an unmasked run stores and computes nothing more.
    masks: Tensor | None = None
    # [T, N] int64: the version of the policy that acted at each step (``RolloutSource.publish``'s numbering);
    # the learner's version minus the oldest of them is the batch's policy lag.
    policy_version: Tensor | None = None

    @classmethod
    def allocate(cls, num_steps: int, num_envs: int, obs_dim: int | tuple | dict, action_shape: tuple[int, ...],
                 action_dtype: torch.dtype, device: torch.device | str,
                 mask_dim: int | None = None) -> "RolloutBuffer":
        """Zeroed storage for ``num_steps x num_envs`` transitions on ``device`` (action masks of ``mask_dim``
        columns when given). ``obs_dim`` is a flat size (float32), or an encoder's ``layout()``: ``(shape,
        dtype)`` of one observation, or a dict of those (one tensor per key)."""
        T, N = num_steps, num_envs

        def z(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        def obs(layout: Any) -> Any:
            if isinstance(layout, dict):
                return {key: obs(part) for key, part in layout.items()}
            if isinstance(layout, int):
                return z(T, N, layout)
            shape, dtype = layout
            return z(T, N, *shape, dtype=dtype)

        return cls(
            obs=obs(obs_dim),
            actions=z(T, N, *action_shape, dtype=action_dtype),
            logp=z(T, N),
            values=z(T, N),
            rewards=z(T, N),
            terminated=z(T, N, dtype=torch.bool),
            truncated=z(T, N, dtype=torch.bool),
            valid=z(T, N, dtype=torch.bool),
            final_values=z(T, N),
            has_final=z(T, N, dtype=torch.bool),
            masks=None if mask_dim is None else z(T, N, mask_dim, dtype=torch.bool),
            policy_version=z(T, N, dtype=torch.int64),
        )

    def next_values(self, last_values: Tensor) -> Tensor:
        """V of the observation that followed each step, ``[T, N]``; ``last_values`` is V(obs after step T-1).

        For a step truncated in SAME_STEP mode the final observation's value replaces the reset observation's.
        """
        nxt = torch.cat([self.values[1:], last_values.unsqueeze(0)], 0)
        return torch.where(self.has_final, self.final_values, nxt)
