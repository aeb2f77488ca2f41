"""The one-env rollout's normalizer arithmetic on the host: ``ObsNormalizer`` and ``RewardScaler`` bit for bit.

With one environment (MuJoCo's usual setting, the ``mujoco`` preset) every env step merges ONE observation into
the running statistics, normalizes it and scales ONE reward. Done with torch, that is about thirty tensor ops on
one-row tensors per step, each costing several microseconds of dispatch for a few flops: measured at ~150 us a
step on Hopper-v5, a fifth of the whole per-step cost (issue 12, item 5). ``HostNormalizers`` does the same
arithmetic in numpy (the observation statistics, ``[D]`` float64) and Python floats (the reward's scalar
statistics), where an op costs well under a microsecond.

Bit identity with the torch classes (``normalize.py``) holds by construction, because every operation is an
IEEE-754 elementwise operation done in the same order on float64 values:

* ``RunningMeanStd.update`` with one row: its ``mean`` over one row is the row itself and its population
  ``var`` is 0, so ``m2 = var*count + 0 + delta**2 * (count*1/total)`` (adding +0.0 changes no value here);
  ``n / total`` is computed by torch as ``total.reciprocal() * n`` (``Tensor.__rdiv__``), which is copied;
* ``ObsNormalizer.normalize``: ``clip((x - mean) / sqrt(var + eps))`` in float64, then rounded to float32;
* ``RewardScaler.scale``: the reward first rounded to float32 (as the collector hands it over), the running
  return ``ret*gamma + r``, its statistics, ``clip(r / sqrt(var + eps))`` rounded to float32.

The torch objects stay the source of truth between rollouts (checkpoints, evaluation, resume read them): when a
rollout starts, their statistics are replaced by copies (so no tensor anyone else holds is ever written) that
are then written in place, through numpy views, after every merge; a save from within a rollout (an env failure)
sees what the torch path would have had.
``tests/test_hostnorm.py`` checks the identity op by op and on whole runs.

Used only for one env on a CPU device (several rows per merge would need torch's own reductions to match).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ppokit.rollout.normalize import ObsNormalizer, RewardScaler

__all__ = ["HostNormalizers"]


def _own(rms: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Give ``rms`` (a ``RunningMeanStd``) fresh copies of its statistics; numpy views of them (mean, var,
    count), written in place after each merge."""
    rms.mean, rms.var, rms.count = rms.mean.clone(), rms.var.clone(), rms.count.clone()
    return rms.mean.numpy(), rms.var.numpy(), rms.count.numpy()


class HostNormalizers:
    """Host-side replicas of an ``ObsNormalizer`` (observations ``[1, D]``) and/or a ``RewardScaler`` (one env)."""

    def __init__(self, obs_norm: ObsNormalizer | None, reward_scaler: RewardScaler | None):
        self.obs_norm, self.reward_scaler = obs_norm, reward_scaler

    @staticmethod
    def applies(num_envs: int, device: torch.device, obs_norm: Any, reward_scaler: RewardScaler | None) -> bool:
        """Whether the lean path can be used: one env, a CPU device, at least one normalizer, and the observation
        normalizer (if any) a plain ``ObsNormalizer`` (not one per part of a Dict observation)."""
        return (num_envs == 1 and device.type == "cpu" and (obs_norm is not None or reward_scaler is not None)
                and (obs_norm is None or (type(obs_norm) is ObsNormalizer and obs_norm.device.type == "cpu"))
                and (reward_scaler is None or (reward_scaler.device.type == "cpu" and reward_scaler.num_envs == 1)))

    def load(self) -> bool:
        """Read the current statistics from the torch objects (at the start of each rollout: a checkpoint load or
        anything else may have replaced them since). False, and nothing read, when a statistic merges through a
        reduce hook (data-parallel runs all-reduce every merge): the torch path must run then."""
        on, rs = self.obs_norm, self.reward_scaler
        if any(getattr(x.rms, "reduce", None) is not None for x in (on, rs) if x is not None):
            return False
        if on is not None:
            self.o_views = _own(on.rms)
            self.o_mean, self.o_var = self.o_views[0].copy(), self.o_views[1].copy()
            self.o_count = float(self.o_views[2])
            self.o_std = np.sqrt(self.o_var + on.eps)
        if rs is not None:
            self.r_views = _own(rs.rms)
            self.r_mean, self.r_var, self.r_count = (float(v) for v in self.r_views)
            rs.returns = rs.returns.clone()
            self.r_ret_view = rs.returns.numpy().reshape(-1)
            self.r_ret = float(self.r_ret_view[0])
        return True

    # ------------------------------------------------------------------ observations
    def update_obs(self, row: np.ndarray) -> None:
        """``obs_norm.update(row)`` for one observation ``[1, D]`` (float32) (a no-op when frozen)."""
        on = self.obs_norm
        if on.frozen:
            return
        x = row.reshape(-1).astype(np.float64)
        count = self.o_count
        total = count + 1.0
        delta = x - self.o_mean
        m2 = self.o_var * count + delta * delta * (count / total)
        self.o_mean = self.o_mean + delta * (1.0 / total)
        self.o_var = m2 / total
        self.o_count = total
        self.o_std = np.sqrt(self.o_var + on.eps)  # normalize's divisor until the next merge
        v_mean, v_var, v_count = self.o_views
        v_mean[...], v_var[...], v_count[...] = self.o_mean, self.o_var, total

    def normalize(self, obs: np.ndarray) -> np.ndarray:
        """``obs_norm.normalize(obs)`` as a float32 array of ``obs``'s shape."""
        on = self.obs_norm
        out = (obs.astype(np.float64) - self.o_mean) / self.o_std
        # torch's clamp is max then min (NaN passes through); np.clip's Python dispatch costs more than both.
        np.maximum(out, -on.clip, out=out)
        return np.minimum(out, on.clip, out=out).astype(np.float32)

    # ------------------------------------------------------------------ rewards
    def scale(self, reward: float, done: bool) -> np.float32:
        """``reward_scaler.scale([reward], [done])[0]`` (the running return and its statistics advance)."""
        rs = self.reward_scaler
        r = float(np.float32(reward))  # the collector hands the scaler float32 rewards
        ret = self.r_ret * rs.gamma + r
        if not rs.frozen:
            count = self.r_count
            total = count + 1.0
            delta = ret - self.r_mean
            m2 = self.r_var * count + delta * delta * (count / total)
            self.r_mean = self.r_mean + delta * (1.0 / total)
            self.r_var = m2 / total
            self.r_count = total
            v_mean, v_var, v_count = self.r_views
            v_mean[...], v_var[...], v_count[...] = self.r_mean, self.r_var, total
        scaled = min(max(r / math.sqrt(self.r_var + rs.eps), -rs.clip), rs.clip)
        # The return restarts for an env whose episode just ended, after this step's reward was used.
        self.r_ret = 0.0 if done else ret
        self.r_ret_view[0] = self.r_ret
        return np.float32(scaled)
