"""What the learner needs from the rollout side: the ``RolloutSource`` protocol that ``collector.Collector`` fills.

The trainer (the learner: GAE, the epoch loop, logging, checkpoints) reads rollouts through these members only,
so another way of producing them plugs in without touching the learner. ``Collector`` steps a local vector env;
data-parallel runs (``distributed.py``) give each rank its own ``Collector`` and make the ranks agree on the
learner's side.

Another backend plugs in as ``ppokit.train(config, rollout=Backend)`` (and ``resume(..., rollout=Backend)``):
``Backend`` is called with ``Collector``'s arguments (the local vector env, the policy, its acting kernel,
``num_steps``, ``device``, ``env_id``, the normalizers, the perf timers, the ``fail`` callback) and returns a
``RolloutSource``. A remote rollout-worker backend (e.g. Ray actors, not part of ppokit) would be one:

* ``collect(global_step)`` sends the current actor weights (``policy.state_dict()``, or the flat ``FlatAdam``
  buffer) and the normalizer statistics to the workers, each worker steps its envs ``num_steps`` times with
  pi_old and returns its slice of the ``[T, N, ...]`` arrays (obs, actions, log-probs, values, rewards,
  terminated/truncated, valid, the truncation bootstrap values) plus its finished episodes; the source writes
  the slices into ``buffer`` (``buffer.RolloutBuffer``, allocated once on the learner's device) along the env
  axis and returns ``(episodes, nonfinite)`` as ``Collector.collect`` does;
* ``last_obs`` is the normalized observation after the rollout (GAE's bootstrap), gathered the same way;
* ``reset``/``loop_state``/``load_loop_state`` forward to the workers (a resume may also start fresh episodes,
  as non-main ranks do), and ``normalize`` is the learner's frozen view of the normalizer statistics.

Keeping log-probs and values computed by the workers (pi_old at acting time) is what makes the ratio correct:
the learner must never recompute them with newer weights.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

__all__ = ["RolloutSource"]


@runtime_checkable
class RolloutSource(Protocol):
    """The rollout side as the trainer uses it (``collector.Collector`` is the local implementation)."""

    buffer: Any  # buffer.RolloutBuffer: [T, N, ...] tensors on the learner's device, filled by collect()
    same_step: bool  # Gymnasium's SAME_STEP autoreset (decides which steps are transitions)
    action_bounds: tuple[np.ndarray, np.ndarray] | None  # (low, high) of a Box action space, else None
    last_obs: torch.Tensor | None  # [N, obs_dim] normalized observation after the rollout (GAE's bootstrap)
    next_obs_raw: Any  # the raw observation the next rollout starts from

    def reset(self, seed: int) -> None:
        """Reset every env; env ``i`` gets ``seed + i``."""

    def collect(self, global_step: int) -> tuple[list[tuple[float, int]], int]:
        """Fill ``buffer`` with ``num_steps`` steps of every env; (finished episodes' (return, length), count of
        non-finite env steps)."""

    def loop_state(self) -> dict[str, torch.Tensor]:
        """What carries from one rollout to the next, for a checkpoint."""

    def load_loop_state(self, loop: dict[str, torch.Tensor]) -> None:
        """Restore ``loop_state()``."""

    def normalize(self, obs: torch.Tensor) -> torch.Tensor:
        """``obs`` as the policy sees it (the running statistics, not updated)."""
