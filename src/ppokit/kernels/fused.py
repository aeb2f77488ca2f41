"""The fused PPO update, by job (this module only re-exports them under their historical names):

* ``flat_adam.FlatAdam``: Adam over one flat buffer backing every parameter (one kernel per step);
* ``mlp_backward.MLPLossKernel``: the hand-derived forward/backward of the PPO minibatch loss for MLP policies,
  and ``supports`` / ``unsupported_reason``, which say where it applies;
* ``fused_step.FusedStep``: that kernel as an ``epochs.UpdateStep``, and ``fused_ppo_update`` (the epoch loop with
  it); ``fused_step.FusedKernel`` is what ``FlatAdam.kernel`` is;
* ``acting.ActingKernel``: acting during the rollout on cached acting weights.

Eager autograd (``update.ppo_update``) remains the reference; ``tests/test_fused.py`` checks the two agree.
"""

from __future__ import annotations

from ppokit.kernels.acting import ActingKernel
from ppokit.kernels.flat_adam import FlatAdam
from ppokit.kernels.fused_step import FusedKernel, FusedStep, _normalize_rows, fused_ppo_update, host_stats
from ppokit.kernels.mlp_backward import MLPLossKernel, supports, unsupported_reason

__all__ = ["ActingKernel", "FlatAdam", "FusedKernel", "FusedStep", "MLPLossKernel", "fused_ppo_update", "host_stats",
           "supports", "unsupported_reason", "_normalize_rows"]
