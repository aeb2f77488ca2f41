"""What the learner needs from the rollout side: the ``RolloutSource`` protocol, and how another source plugs in.

The trainer (the learner: GAE, the epoch loop, logging, checkpoints) takes every rollout through these members
only, so another way of producing rollouts plugs in without touching the learner. ``collector.Collector`` is
the in-process source (it steps a local vector env with the live policy); data-parallel runs
(``runtime.distributed``) give each rank its own source and make the ranks agree on the learner's side.

The learner's side of the exchange, once per update:

1. ``collect(global_step)`` fills ``buffer`` (a ``buffer.RolloutBuffer``, ``[T, N, ...]`` tensors on the learner's
   device) with ``num_steps`` steps of every env and returns ``(episodes, nonfinite)``: each finished episode's
   (raw return, length) and the count of non-finite env steps. ``buffer.policy_version[t, n]`` says which
   published version of the weights acted at that step; ``logp``/``values`` are that policy's, at acting time
   (the ratio's denominator: the learner never recomputes them with newer weights). ``last_obs`` is the
   normalized observation after the rollout (GAE's bootstrap).
2. The learner updates, then ``publish(weights, version)``: ``weights`` is the learner's policy after update
   ``version`` (its ``state_dict()`` is what a remote source ships; in process it is the very module the
   collector acts with, so publishing costs nothing). ``publish(policy, update)`` is also called once when the
   run (or a resume) starts, so a source knows the weights before its first rollout.
3. The trainer logs ``diag/policy_lag`` (``core.schema.POLICY_LAG``): the learner's version when it consumes the
   batch minus the oldest ``policy_version`` in it, for a source whose ``stale`` is True (one whose actors may
   act with older weights). The in-process collector acts with the live policy (lag 0 by construction,
   ``stale`` False), so its runs log no such column.

Another source is given as ``ppokit.train(config, rollout=Backend)`` (and ``resume(..., rollout=Backend)``):
``Backend`` (a ``RolloutBackend``) is called with ``Collector``'s arguments (the local vector env, the policy,
its acting kernel, ``num_steps``, ``device``, ``env_id``, the normalizers, the perf timers, the ``fail``
callback) and returns a ``RolloutSource``. A worker-process or Ray source (issue 20) would:

* in ``publish``, send ``weights.state_dict()`` (or the flat ``FlatAdam`` buffer) and the normalizer statistics
  to its workers with the version number;
* in ``collect``, gather each worker's ``num_steps`` steps of its envs (obs, actions, log-probs, values,
  rewards, terminated/truncated, valid, the truncation bootstrap values, the acting ``policy_version``) into
  ``buffer`` along the env axis, plus their finished episodes; with ``stale`` True when a worker may still be
  acting with an older version;
* forward ``reset``/``loop_state``/``load_loop_state`` to the workers (a resume may also start fresh episodes,
  as non-main ranks do); ``normalize`` is the learner's frozen view of the normalizer statistics.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np
import torch

from ppokit.core.batch import Field
from ppokit.rollout.buffer import RolloutBuffer, declare_step_field

__all__ = ["Episodes", "RolloutBackend", "RolloutSource", "policy_lag", "policy_lag_mean"]

Episodes = list[tuple[float, int]]  # (raw return, length) of each episode finished in a rollout

# Every source writes it: the version (``publish``'s numbering) of the policy that acted at each step. It stays in
# the rollout (the update does not read it); the learner's version minus its oldest entry is the policy lag.
POLICY_VERSION = declare_step_field(Field("policy_version", (), torch.int64,
                                          doc="the version of the policy that acted at step t"))


@runtime_checkable
class RolloutSource(Protocol):
    """The rollout side as the trainer uses it (``collector.Collector`` is the in-process implementation)."""

    buffer: RolloutBuffer  # [T, N, ...] tensors on the learner's device, filled by collect()
    same_step: bool  # Gymnasium's SAME_STEP autoreset (decides which steps are transitions)
    action_bounds: tuple[np.ndarray, np.ndarray] | None  # (low, high) of a Box action space, else None
    last_obs: torch.Tensor | None  # [N, obs_dim] normalized observation after the rollout (GAE's bootstrap)
    next_obs_raw: Any  # the raw observation the next rollout starts from
    stale: bool  # whether a sample may come from an older version than the last published (diag/policy_lag)
    watchdog: Any  # what bounds each env reset()/step() (``envs.watchdog``; the trainer sets its own)

    def reset(self, seed: int) -> None:
        """Reset every env; env ``i`` gets ``seed + i``."""

    def collect(self, global_step: int) -> tuple[Episodes, int]:
        """Fill ``buffer`` with ``num_steps`` steps of every env; (finished episodes' (return, length), count of
        non-finite env steps)."""

    def publish(self, weights: torch.nn.Module, version: int) -> None:
        """The learner's policy after update ``version`` (0: before the first); the versions only increase."""

    def loop_state(self) -> dict[str, torch.Tensor]:
        """What carries from one rollout to the next, for a checkpoint."""

    def load_loop_state(self, loop: dict[str, torch.Tensor]) -> None:
        """Restore ``loop_state()``."""

    def normalize(self, obs: torch.Tensor) -> torch.Tensor:
        """``obs`` as the policy sees it (the running statistics, not updated)."""


# What ``train(rollout=...)`` takes: called with Collector's arguments, returns the run's source.
RolloutBackend = Callable[..., RolloutSource]


def policy_lag(buffer: RolloutBuffer, learner_version: int) -> int:
    """The learner's version minus the oldest version that acted in ``buffer`` (0: all of it is current)."""
    return learner_version - int(buffer.policy_version.min())


def policy_lag_mean(buffer: RolloutBuffer, learner_version: int) -> float:
    """The learner's version minus the mean version that acted in ``buffer``."""
    return learner_version - float(buffer.policy_version.double().mean())
