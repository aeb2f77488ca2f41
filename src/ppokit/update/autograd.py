"""The reference (eager autograd) minibatch step of a PPO update, for any policy and objective.

``minibatch_loss`` is one minibatch's loss and diagnostics (``sequence_minibatch_loss`` that of a sequence
minibatch, for a stateful policy); ``AutogradStep`` is the ``epochs.UpdateStep`` that
backpropagates it and steps a ``torch.optim`` optimizer; ``ppo_update`` runs the epoch loop (``epochs.ppo_epochs``)
with it. Nothing here knows of environments or logging.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import Tensor

from ppokit.core.advantages import normalize
from ppokit.core.algos import get_algo, loss_terms
from ppokit.core.objectives import approx_kl_k1, approx_kl_k3, clip_fraction
from ppokit.core.reductions import reduce
from ppokit.policies import ActorCritic, StatefulPolicy
from ppokit.update.epochs import (
    KL_STOP_FACTOR,
    STAT_NAMES,
    Batch,
    MinibatchResult,
    SequenceBatch,
    UpdateSettings,
    kl_stops,
    ppo_epochs,
)

__all__ = ["Batch", "UpdateSettings", "AutogradStep", "AutogradGuards", "ppo_update", "minibatch_loss",
           "sequence_minibatch_loss", "kl_stops", "KL_STOP_FACTOR", "STAT_NAMES"]


def minibatch_loss(policy: ActorCritic, mb: Batch, s: UpdateSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """Total loss of one minibatch and its signed terms and diagnostics (all scalar tensors)."""
    logp_new, entropy, values = policy.evaluate(mb.obs, mb.actions, action_mask=mb.action_mask)
    logratio = logp_new - mb.logp_old
    ratio = logratio.exp()
    advantages = normalize(mb.advantages) if s.norm_adv and len(mb) > 1 else mb.advantages

    # The algo's signed terms by name (algos.ALGOS says, once, what each variant's policy and value terms are).
    terms = loss_terms(get_algo(s.algo), logp_new, mb.logp_old, ratio, advantages, entropy, values, mb.returns,
                       mb.values_old, s)
    loss_policy, loss_value = terms["policy"], terms["value"]
    loss = loss_policy + s.vf_coef * loss_value + s.ent_coef * terms["entropy"]

    with torch.no_grad():
        stats = {
            "policy_loss": loss_policy.detach(),
            "value_loss": loss_value.detach(),
            "entropy": entropy.detach().mean(),
            "approx_kl": approx_kl_k3(logp_new.detach(), mb.logp_old),
            "approx_kl_k1": approx_kl_k1(logp_new.detach(), mb.logp_old),
            "clipfrac": clip_fraction(ratio.detach(), s.clip_coef),
        }
    return loss, stats


def sequence_minibatch_loss(policy: StatefulPolicy, mb: SequenceBatch,
                            s: UpdateSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """``minibatch_loss`` of a sequence minibatch (every field ``[L, M, ...]``): ``policy.evaluate_sequence``
    replays each chunk in order from its stored ``state0``, and every term, every diagnostic and the advantage
    normalization is the masked mean over ``mb.mask`` (valid steps, not padding; ``core.reductions.reduce``), so a
    left-out step carries exactly zero weight and zero gradient."""
    mask = mb.mask
    logp_new, entropy, values = policy.evaluate_sequence(mb.obs, mb.actions, mb.state0, mb.episode_start,
                                                         mb.action_mask)
    # A left-out step's ratio is exactly 1: exp of a padded step's arbitrary log-ratio could overflow, and its
    # 0 * inf backward would be NaN even under the mask (core.reductions' caveat).
    logp_old = torch.where(mask, mb.logp_old, logp_new.detach())
    ratio = (logp_new - logp_old).exp()
    advantages = normalize(mb.advantages, mask=mask) if s.norm_adv else mb.advantages
    terms = loss_terms(get_algo(s.algo), logp_new, logp_old, ratio, advantages, entropy, values, mb.returns,
                       mb.values_old, s, mask=mask)
    loss_policy, loss_value = terms["policy"], terms["value"]
    loss = loss_policy + s.vf_coef * loss_value + s.ent_coef * terms["entropy"]

    with torch.no_grad():
        stats = {
            "policy_loss": loss_policy.detach(),
            "value_loss": loss_value.detach(),
            "entropy": reduce(entropy.detach(), mask),
            "approx_kl": approx_kl_k3(logp_new.detach(), logp_old, mask),
            "approx_kl_k1": approx_kl_k1(logp_new.detach(), logp_old, mask),
            "clipfrac": clip_fraction(ratio.detach(), s.clip_coef, mask),
        }
    return loss, stats


class AutogradGuards:
    """What every eager-autograd ``epochs.UpdateStep`` shares (this one and the language-model trainers'
    ``lm.step.TokenStep``): the gradients and statistics the ``sync`` hook averages, the global-norm clip with the
    guards' single host read, and discarding a skipped minibatch. Needs ``params``, ``optimizer``, ``_loss`` (the
    minibatch loss) and ``_stats`` (its 0-dim diagnostics, ``approx_kl`` among them)."""

    params: list[Tensor]
    optimizer: torch.optim.Optimizer
    _loss: Tensor
    _stats: dict[str, Tensor]

    def gradients(self) -> list[Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def sync_stats(self) -> list[Tensor]:
        # The detached loss shares its storage with the loss the guard reads.
        return [self._loss.detach(), *self._stats.values()]

    def clip_and_read(self, max_grad_norm: float) -> tuple[Tensor, float, float, float]:
        """Clip the gradients in place to ``max_grad_norm``; ``(norm before clipping, loss, norm, approx KL)`` with
        the three floats read from the device at once (one host sync serves the NaN skip and the KL early stop)."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):  # FSDP-sharded gradients: the norm over every rank's shards
            grad_norm = grad_norm.full_tensor()
        grad_norm = grad_norm.to(self._loss.device)  # CPU-offloaded (FSDP) gradients: a CPU norm
        loss_v, grad_v, kl_v = torch.stack([self._loss.detach().float(), grad_norm.float(),
                                            self._stats["approx_kl"].float()]).tolist()
        return grad_norm, loss_v, grad_v, kl_v

    def discard(self) -> None:
        self.optimizer.zero_grad(set_to_none=False)


class AutogradStep(AutogradGuards):
    """``epochs.UpdateStep`` by eager autograd: ``minibatch_loss`` backpropagated into the parameters' ``.grad``,
    clipped by ``clip_grad_norm_`` and applied by ``optimizer`` (any ``torch.optim`` optimizer over ``policy``)."""

    def __init__(self, policy: ActorCritic, optimizer: torch.optim.Optimizer):
        self.policy = policy
        self.optimizer = optimizer
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.settings: UpdateSettings | None = None
        self.batch: Batch | None = None

    @contextmanager
    def update(self, batch: Batch, settings: UpdateSettings) -> Iterator[None]:
        self.batch, self.settings = batch, settings
        try:
            yield
        finally:
            self.batch = self._loss = self._stats = None

    def minibatches(self, perm: Tensor, sizes: list[int]) -> Iterator[Batch]:
        for idx in torch.split(perm, sizes):
            yield self.batch.index(idx)

    def backward(self, mb: Batch) -> None:
        # A sequence minibatch (whole env chunks, a stateful policy) is replayed; a flat one is rows.
        loss_fn = sequence_minibatch_loss if isinstance(mb, SequenceBatch) else minibatch_loss
        self._loss, self._stats = loss_fn(self.policy, mb, self.settings)
        self.optimizer.zero_grad(set_to_none=False)
        self._loss.backward()

    def measure(self) -> MinibatchResult:
        # clip_grad_norm_ clips in place and returns the norm before clipping; the step is taken only if applied.
        grad_norm, loss_v, grad_v, kl_v = self.clip_and_read(self.settings.max_grad_norm)
        stats = dict(self._stats, grad_norm=grad_norm.detach())
        return MinibatchResult(loss=loss_v, grad_norm=grad_v, approx_kl=kl_v, stats=stats)

    def apply(self, result: MinibatchResult) -> None:
        self.optimizer.step()


def ppo_update(policy: ActorCritic, optimizer: torch.optim.Optimizer, batch: Batch, s: UpdateSettings,
               generator: torch.Generator | None = None) -> dict[str, float]:
    """One update by eager autograd: ``epochs.ppo_epochs`` (its guards and returned diagnostics) with an
    ``AutogradStep``."""
    return ppo_epochs(batch, s, AutogradStep(policy, optimizer), generator=generator)
