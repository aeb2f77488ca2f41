"""The fused PPO update: ``epochs.ppo_epochs`` with ``FusedStep``, the same update as ``autograd.ppo_update``
without autograd.

``FusedStep`` is the ``epochs.UpdateStep`` whose gradient comes from the hand-derived backward
(``mlp_backward.MLPLossKernel``) into ``FlatAdam``'s flat buffer: the gradient norm is one kernel, the clip one
in-place multiply, Adam one fused kernel, and each minibatch's statistics reach the host in one read. The epoch
loop, its guards and the diagnostics' means are ``epochs.ppo_epochs``'s, shared with the autograd path;
``tests/test_fused.py`` checks the two paths agree and ``tests/test_bit_identity.py`` that runs stay unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import Tensor

from ppokit.core.advantages import normalize
from ppokit.core.algos import get_algo
from ppokit.kernels.flat_adam import FlatAdam
from ppokit.kernels.mlp_backward import MLPLossKernel
from ppokit.policies import ActorCritic
from ppokit.update.epochs import Batch, MinibatchResult, UpdateSettings, ppo_epochs

__all__ = ["FusedStep", "fused_ppo_update", "host_stats"]

# One minibatch's tensors in the order MLPLossKernel.loss_and_grad takes them:
# (obs, actions, logp_old, values_old, advantages, returns).
FusedMinibatch = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


def host_stats(row: list[float], s: UpdateSettings) -> tuple[float, dict[str, float]]:
    """The minibatch loss and its named ``epochs.STAT_NAMES`` values from the kernel's means of
    ``MLPLossKernel.ROWS`` followed by the gradient norm (``stat_buf`` read as a list)."""
    surrogate, sq, neg_ent, k3, logratio, outside, grad_norm = row
    loss_pi, loss_v, entropy = -surrogate, 0.5 * sq, -neg_ent
    loss = loss_pi + s.vf_coef * loss_v - s.ent_coef * entropy
    return loss, {"policy_loss": loss_pi, "value_loss": loss_v, "entropy": entropy, "approx_kl": k3,
                  "approx_kl_k1": -logratio, "clipfrac": outside, "grad_norm": grad_norm}


def _normalize_rows(adv: Tensor, sizes: list[int]) -> Tensor:
    """Per-minibatch advantage normalization: ``advantages.normalize`` of each chunk (the same function, so both
    paths share its rule for constant chunks), vectorized over the chunks when they are equal-sized."""
    if len(set(sizes)) == 1:
        return normalize(adv.view(len(sizes), sizes[0]), dim=1).view(-1)
    return torch.cat([normalize(chunk) if chunk.numel() > 1 else chunk for chunk in torch.split(adv, sizes)])


class FusedStep:
    """``epochs.UpdateStep`` by the hand-derived backward on ``optimizer`` (the policy's ``FlatAdam``); only the
    clipped surrogate ("ppo") is fused. The whole update runs in inference mode: no op records autograd state."""

    def __init__(self, policy: ActorCritic, optimizer: FlatAdam):
        if not isinstance(optimizer, FlatAdam):
            raise TypeError("the fused update needs the policy's FlatAdam optimizer")
        self.optimizer = optimizer
        self.kernel = MLPLossKernel(policy, optimizer)
        self.settings: UpdateSettings | None = None

    @contextmanager
    def update(self, batch: Batch, settings: UpdateSettings) -> Iterator[None]:
        if not get_algo(settings.algo).fused:
            raise ValueError(f"the fused update: algo {settings.algo!r} is not fused; use update.AutogradStep")
        self.settings, self.batch = settings, batch
        # Inference mode rather than no_grad: it also skips the autograd dispatch of every op (~1 us each here).
        with torch.inference_mode():
            # The per-sample scalars travel as rows of one [4, B] matrix: one gather per epoch instead of four.
            self.aux = torch.stack([batch.logp_old, batch.values_old, batch.advantages,
                                    batch.returns]).to(self.kernel.dtype)
            self.whole: FusedMinibatch | None = None  # the one minibatch of a one-minibatch update
            try:
                yield
            finally:
                self.batch = self.aux = self.whole = None

    def minibatches(self, perm: Tensor, sizes: list[int]) -> Iterator[FusedMinibatch]:
        s, batch, aux = self.settings, self.batch, self.aux
        if len(sizes) == 1:
            # One minibatch is the whole batch: every mean is order-free, so skip the gather, and the normalized
            # advantages are the same every epoch: the same minibatch is handed out each epoch, built once (its
            # six views cost more than the epoch's bookkeeping on RL-Zoo CartPole's 20 epochs of 256 samples).
            if self.whole is None:
                adv = aux[2]
                if s.norm_adv and len(batch) > 1:
                    adv = _normalize_rows(aux[2], sizes)
                self.whole = (batch.obs, batch.actions, aux[0], aux[1], adv, aux[3])
            yield self.whole
            return
        # Gathering in permuted order makes the epoch's minibatches contiguous row ranges.
        obs_e, act_e, aux_e = batch.obs[perm], batch.actions[perm], aux[:, perm]
        adv_e = _normalize_rows(aux_e[2], sizes) if s.norm_adv else aux_e[2]
        # Each epoch's views made by one split per tensor (32 minibatches of the mujoco preset: 6 slicing ops
        # each otherwise); the same row ranges, so the same strides and offsets as slicing would give.
        for M, obs_mb, act_mb, aux_mb, adv_mb in zip(sizes, obs_e.split(sizes), act_e.split(sizes),
                                                     aux_e.split(sizes, 1), adv_e.split(sizes)):
            logp_old, values_old, adv_raw, returns = aux_mb.unbind(0)
            # The reference leaves a single-sample minibatch's advantage as is.
            yield obs_mb, act_mb, logp_old, values_old, adv_raw if s.norm_adv and M == 1 else adv_mb, returns

    def backward(self, mb: FusedMinibatch) -> None:
        self.kernel.loss_and_grad(*mb, self.settings)

    def gradients(self) -> list[Tensor]:
        return [self.kernel.flat_grad]

    def sync_stats(self) -> list[Tensor]:
        # The means of MLPLossKernel.ROWS; the gradient norm (the last entry) is computed after the sync.
        return [self.kernel.stat_buf[:len(MLPLossKernel.ROWS)]]

    def measure(self) -> MinibatchResult:
        self.kernel.grad_norm_into_stats()
        # One host read per minibatch serves the NaN guard, the clip, KL early stopping and the stats.
        loss, stats = host_stats(self.kernel.stat_buf.tolist(), self.settings)
        return MinibatchResult(loss=loss, grad_norm=stats["grad_norm"], approx_kl=stats["approx_kl"], stats=stats)

    def apply(self, result: MinibatchResult) -> None:
        coef = self.settings.max_grad_norm / (result.grad_norm + 1e-6)
        if coef < 1.0:
            self.kernel.flat_grad.mul_(coef)
        self.optimizer.step()

    def discard(self) -> None:
        self.optimizer.zero_grad()


def fused_ppo_update(policy: ActorCritic, optimizer: FlatAdam, batch: Batch, s: UpdateSettings,
                     generator: torch.Generator | None = None) -> dict[str, float]:
    """Drop-in for ``autograd.ppo_update`` (same minibatches, guards and returned diagnostics), without autograd:
    ``epochs.ppo_epochs`` with a ``FusedStep``. ``optimizer`` must be the policy's ``FlatAdam``; ``s.algo`` "ppo"."""
    return ppo_epochs(batch, s, FusedStep(policy, optimizer), generator=generator)
