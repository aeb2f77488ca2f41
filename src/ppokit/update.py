"""One PPO update: K epochs of shuffled minibatches over a flat batch, with KL early stopping.

This is the reference (autograd) implementation. It knows nothing of environments or logging: it takes the
policy, the optimizer and a ``Batch`` of tensors and returns the update's diagnostics, each the mean over all
minibatches that ran (not only the last one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .advantages import normalize
from .objectives import (
    approx_kl_k1,
    approx_kl_k3,
    clip_fraction,
    entropy_loss,
    kl_penalty_loss,
    policy_loss,
    value_loss,
)
from .policies import ActorCritic

__all__ = ["Batch", "UpdateSettings", "ppo_update", "minibatch_loss", "kl_stops", "KL_STOP_FACTOR", "STAT_NAMES"]

# Per-minibatch statistics accumulated on the device and read once per update.
STAT_NAMES = ("policy_loss", "value_loss", "entropy", "approx_kl", "approx_kl_k1", "clipfrac", "grad_norm")


@dataclass
class Batch:
    """A flat batch of ``B`` transitions (the rollout's valid steps, time and env axes merged)."""

    obs: Tensor  # [B, obs_dim]
    actions: Tensor  # [B] | [B, k] | [B, D]
    logp_old: Tensor  # [B] log pi_old(a|s), frozen at rollout time
    values_old: Tensor  # [B] V at rollout time (for value clipping)
    advantages: Tensor  # [B] GAE advantages, constants
    returns: Tensor  # [B] value targets, constants

    def __len__(self) -> int:
        return self.obs.shape[0]

    def index(self, idx: Tensor) -> "Batch":
        """The minibatch at row indices ``idx``."""
        return Batch(self.obs[idx], self.actions[idx], self.logp_old[idx], self.values_old[idx],
                     self.advantages[idx], self.returns[idx])


@dataclass
class UpdateSettings:
    """The knobs of one update (already annealed for this iteration)."""

    algo: str  # "ppo" | "ppo-kl" | "a2c"
    update_epochs: int
    num_minibatches: int
    clip_coef: float
    clip_vloss: bool
    norm_adv: bool
    ent_coef: float
    vf_coef: float
    max_grad_norm: float
    target_kl: float | None
    kl_beta: float = 1.0


# Early stopping fires when a minibatch's approx KL exceeds this multiple of target_kl (SB3's margin).
KL_STOP_FACTOR = 1.5


def kl_stops(approx_kl: float, target_kl: float | None) -> bool:
    """KL early stopping's test, shared by both update paths: ``approx_kl > KL_STOP_FACTOR * target_kl``."""
    return target_kl is not None and approx_kl > KL_STOP_FACTOR * target_kl


def minibatch_loss(policy: ActorCritic, mb: Batch, s: UpdateSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """Total loss of one minibatch and its signed terms and diagnostics (all scalar tensors)."""
    logp_new, entropy, values = policy.evaluate(mb.obs, mb.actions)
    logratio = logp_new - mb.logp_old
    ratio = logratio.exp()
    advantages = normalize(mb.advantages) if s.norm_adv and len(mb) > 1 else mb.advantages

    # Policy term: the clipped surrogate (ppo), the KL-penalized surrogate (ppo-kl) or plain policy gradient (a2c).
    if s.algo == "ppo":
        loss_policy = policy_loss(logp_new, mb.logp_old, advantages, s.clip_coef)
    elif s.algo == "ppo-kl":
        loss_policy = kl_penalty_loss(logp_new, mb.logp_old, advantages, s.kl_beta)
    else:
        # a2c: one step at ratio == 1, where the gradient of r*A equals that of logp*A.
        loss_policy = -(ratio * advantages.detach()).mean()

    clipped_value = s.clip_vloss and s.algo == "ppo"
    loss_value = value_loss(values, mb.returns, mb.values_old if clipped_value else None,
                            s.clip_coef if clipped_value else None)
    loss_entropy = entropy_loss(entropy)
    loss = loss_policy + s.vf_coef * loss_value + s.ent_coef * loss_entropy

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


def ppo_update(policy: ActorCritic, optimizer: torch.optim.Optimizer, batch: Batch, s: UpdateSettings,
               generator: torch.Generator | None = None) -> dict[str, float]:
    """Run the update's epochs over ``batch``; return mean diagnostics and counters as floats.

    Guards on every minibatch, checked after its forward and backward pass and before its optimizer step:

    * a non-finite loss, gradient norm or approx KL skips the minibatch (no NaN reaches the weights). The KL
      counts because an overflowing ratio (``logp_new - logp_old > 88`` in float32) can leave the clipped loss
      finite while ``r`` itself is Inf;
    * with ``target_kl`` set, KL early stopping as in Stable-Baselines3: when the minibatch's approx KL (k3 of
      pi_theta vs pi_old, measured on its own forward pass) exceeds ``1.5 * target_kl``, that minibatch is NOT
      applied and the remaining minibatches and epochs are dropped. The 1.5 margin (SB3's) lets the KL
      fluctuate around its target without stopping every update.

    The diagnostics are means over the minibatches that were applied; ``minibatches`` counts them.
    ``fused.fused_ppo_update`` implements exactly the same guards.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    device = batch.obs.device
    totals = torch.zeros(len(STAT_NAMES), device=device)
    n_done, n_skipped, epochs_run, early_stopped = 0, 0, 0, False
    B = len(batch)
    for epoch in range(s.update_epochs):
        epochs_run = epoch + 1
        perm = torch.randperm(B, device=device, generator=generator)
        for idx in torch.tensor_split(perm, s.num_minibatches):
            if idx.numel() == 0:
                continue
            mb = batch.index(idx)
            loss, stats = minibatch_loss(policy, mb, s)
            optimizer.zero_grad(set_to_none=False)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, s.max_grad_norm)
            # One host read per minibatch serves both guards (NaN skip and KL early stop).
            loss_v, grad_v, kl_v = torch.stack([loss.detach(), grad_norm, stats["approx_kl"]]).tolist()
            if not (math.isfinite(loss_v) and math.isfinite(grad_v) and math.isfinite(kl_v)):
                n_skipped += 1
                optimizer.zero_grad(set_to_none=False)
                continue
            if kl_stops(kl_v, s.target_kl):
                # Stop BEFORE this step: the minibatch that left the trust region is not applied.
                optimizer.zero_grad(set_to_none=False)
                early_stopped = True
                break
            optimizer.step()
            stats["grad_norm"] = grad_norm.detach()
            totals += torch.stack([stats[k] for k in STAT_NAMES])
            n_done += 1
        if early_stopped:
            break
    means = (totals / max(n_done, 1)).tolist() if n_done else [float("nan")] * len(STAT_NAMES)
    out = dict(zip(STAT_NAMES, means))
    out.update(minibatches=float(n_done), skipped_minibatches=float(n_skipped), epochs_run=float(epochs_run),
               early_stopped=float(early_stopped))
    return out
