"""The language-model policy losses, one registered function each, all with one signature.

A loss takes the response tokens' log-probabilities under pi_theta (``logp``, with gradient), pi_old
(``logp_old``) and pi_ref (``logp_ref``, or None), the per-token ``advantages``, the response ``mask`` and the
``LossSettings``, all ``[B, R]``, and returns ``(loss, stats)``: the scalar to minimize and named 0-dim
diagnostics. Which one a trainer uses is a config value (``LMConfig.policy_loss``); PPO-RLHF and GRPO differ in how
they make advantages and batches, not in copies of the loss (verl's ``compute_policy_loss_*`` functions are the
model for this shape). A new loss is one function and one ``register_loss`` call.

``dpo`` fits the same signature with sequences instead of tokens: ``logp`` / ``logp_ref`` are ``[2N, R]``
token log-probs of the chosen completions stacked over the rejected ones, the mask selects the response tokens,
and the advantages are unused (a preference pair carries its own signal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ppokit.core.objectives import approx_kl_k1, approx_kl_k3, clip_fraction, clipped_surrogate
from ppokit.core.reductions import reduce
from ppokit.lm.logprobs import kl_per_token

__all__ = ["LossSettings", "LOSSES", "register_loss", "get_loss", "settings_for", "policy_loss_ppo", "policy_loss_dpo"]


@dataclass(frozen=True)
class LossSettings:
    """The knobs a policy loss reads (the trainer fills them from ``LMConfig``)."""

    clip_coef: float = 0.2
    beta: float = 0.0  # coefficient of the k3 KL(pi_theta || pi_ref) term (GRPO's; 0 leaves it out)
    reduction: str = "token_mean"  # a mode of ``core.reductions.reduce``
    normalizer: float | None = None  # the constant of the "seq_mean_token_sum_norm" mode (max_new_tokens)


def settings_for(config, beta: float) -> LossSettings:
    """The loss settings of an ``LMConfig`` (``beta``: the reference-KL coefficient this trainer puts in the loss)."""
    return LossSettings(clip_coef=config.clip_coef, beta=beta, reduction=config.loss_reduction,
                        normalizer=config.max_new_tokens)


PolicyLoss = Callable[[Tensor, Tensor, "Tensor | None", Tensor, Tensor, LossSettings], "tuple[Tensor, dict]"]
LOSSES: dict[str, PolicyLoss] = {}


def register_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Register a policy loss under ``name`` (a name is taken once: a config value must always mean one loss)."""

    def add(fn: PolicyLoss) -> PolicyLoss:
        if name in LOSSES and LOSSES[name] is not fn:
            raise ValueError(f"policy loss {name!r} is already registered to {LOSSES[name].__qualname__}")
        LOSSES[name] = fn
        return fn

    return add


def get_loss(name: str) -> PolicyLoss:
    """The registered loss ``name``; ValueError listing the known ones otherwise."""
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy loss {name!r}; known: {', '.join(sorted(LOSSES))}") from None


def _ratio_stats(logp: Tensor, logp_old: Tensor, mask: Tensor, clip_coef: float) -> dict[str, Tensor]:
    """approx KL (k3, and k1) of pi_theta against pi_old and the clip fraction, token means over the mask."""
    lp = logp.detach()
    return {"approx_kl": approx_kl_k3(lp, logp_old, mask, "token_mean"),
            "approx_kl_k1": approx_kl_k1(lp, logp_old, mask, "token_mean"),
            "clipfrac": clip_fraction((lp - logp_old).exp(), clip_coef, mask, "token_mean")}


@register_loss("ppo")
def policy_loss_ppo(logp: Tensor, logp_old: Tensor, logp_ref: Tensor | None, advantages: Tensor, mask: Tensor,
                    s: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped surrogate per token (Schulman et al. 2017, eq. 7), negated, plus ``beta`` times the k3
    KL(pi_theta || pi_ref) per token when ``beta > 0`` and a reference is given (GRPO, Shao et al. 2024, eq. 3),
    reduced over the mask by ``s.reduction``:

        loss = reduce( -min(r A, clip(r, 1 - eps, 1 + eps) A) + beta * k3(pi_theta, pi_ref) )

    Padding positions take pi_old's log-prob, so their ratio is exactly 1 and no gradient reaches them."""
    logp = torch.where(mask, logp, logp_old)
    surrogate = clipped_surrogate(logp, logp_old, advantages, s.clip_coef)
    per_token = -surrogate
    stats: dict[str, Tensor] = {}
    if logp_ref is not None and s.beta > 0:
        kl_ref = torch.where(mask, kl_per_token(logp, logp_ref, "k3"), 0.0)
        per_token = per_token + s.beta * kl_ref
        stats["kl_ref_token"] = reduce(kl_ref.detach(), mask, "token_mean")
    loss = reduce(per_token, mask, s.reduction, normalizer=s.normalizer)
    with torch.no_grad():
        stats["policy_loss"] = -reduce(surrogate.detach(), mask, s.reduction, normalizer=s.normalizer)
        stats.update(_ratio_stats(logp, logp_old, mask, s.clip_coef))
    return loss, stats


@register_loss("dpo")
def policy_loss_dpo(logp: Tensor, logp_old: Tensor, logp_ref: Tensor | None, advantages: Tensor, mask: Tensor,
                    s: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """DPO (Rafailov et al. 2023, eq. 7) on ``[2N, R]`` rows, chosen over rejected: with sequence log-probs
    ``L = sum_t logp`` and implicit rewards ``beta * (L - L_ref)``,

        loss = mean( -log sigmoid( beta (L_c - L_c,ref) - beta (L_r - L_r,ref) ) )

    (``logsigmoid`` is the stable form). ``logp_old`` and ``advantages`` are unused."""
    if logp_ref is None:
        raise ValueError("the dpo loss needs the reference log-probs (logp_ref)")
    if logp.shape[0] % 2:
        raise ValueError(f"the dpo loss takes chosen rows over rejected rows (an even count), got {logp.shape[0]}")
    seq = torch.where(mask, logp, 0.0).sum(-1)
    seq_ref = torch.where(mask, logp_ref, 0.0).sum(-1)
    rewards = s.beta * (seq - seq_ref)
    chosen, rejected = rewards.chunk(2)
    margin = chosen - rejected
    loss = -F.logsigmoid(margin).mean()
    with torch.no_grad():
        stats = {"chosen_rewards": chosen.detach().mean(), "rejected_rewards": rejected.detach().mean(),
                 "margin": (chosen - rejected).detach().mean(), "accuracy": (chosen > rejected).float().mean()}
    return loss, stats
