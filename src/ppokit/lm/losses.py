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

from ppokit.core.objectives import approx_kl_k1, approx_kl_k3, clip_fraction, clipped_surrogate, past_clip
from ppokit.core.reductions import reduce
from ppokit.lm.logprobs import kl_per_token

__all__ = ["LossSettings", "LOSSES", "LOSS_TYPES", "DPO_LOSSES", "IS_LEVELS", "register_loss", "get_loss",
           "settings_for", "reduce_tokens", "policy_loss_ppo", "policy_loss_dpo"]

# TRL's GRPO ``loss_type`` names for the reductions (TRL's GRPOTrainer docs): grpo = mean over sequences of each
# one's token mean (Shao et al. 2024); bnpo = mean over the minibatch's tokens; dr_grpo = token sums over
# (sequences x the generation budget) (Liu et al. 2025); dapo = token sums over the rollout's tokens per
# minibatch, so every token of the rollout weighs the same whatever minibatch it lands in (Yu et al. 2025,
# eq. 10's 1 / sum_i |o_i|; TRL's num_items_in_batch). ``dapo`` is the one reduction the core does not have.
LOSS_TYPES = {"grpo": "seq_mean_token_mean", "bnpo": "token_mean", "dr_grpo": "seq_mean_token_sum_norm",
              "dapo": "dapo"}
IS_LEVELS = ("token", "sequence")
DPO_LOSSES = ("sigmoid", "ipo", "hinge")


@dataclass(frozen=True)
class LossSettings:
    """The knobs a policy loss reads (the trainer fills them from ``LMConfig``)."""

    clip_coef: float = 0.2
    beta: float = 0.0  # coefficient of the k3 KL(pi_theta || pi_ref) term (GRPO's; 0 leaves it out)
    reduction: str = "token_mean"  # a mode of ``core.reductions.reduce``, or "dapo" (``reduce_tokens``)
    normalizer: float | None = None  # seq_mean_token_sum_norm: max_new_tokens; dapo: the rollout's tokens per minibatch
    clip_high: float | None = None  # the upper clip eps_high (DAPO's clip-higher); None: clip_coef
    is_level: str = "token"  # importance ratio per token, or per sequence (GSPO, Zheng et al. 2025)
    dpo_loss: str = "sigmoid"
    label_smoothing: float = 0.0


def settings_for(config, beta: float, tokens_per_minibatch: float | None = None) -> LossSettings:
    """The loss settings of an ``LMConfig`` (``beta``: the reference-KL coefficient this trainer puts in the loss;
    ``tokens_per_minibatch``: the rollout's response tokens / num_minibatches, what ``loss_type="dapo"`` divides by)."""
    reduction = LOSS_TYPES[config.loss_type] if config.loss_type is not None else config.loss_reduction
    normalizer = tokens_per_minibatch if reduction == "dapo" else config.max_new_tokens
    if reduction == "dapo" and not (normalizer and normalizer > 0):
        raise ValueError("loss_type dapo needs the rollout's tokens per minibatch (tokens_per_minibatch > 0)")
    return LossSettings(clip_coef=config.clip_coef, beta=beta, reduction=reduction, normalizer=normalizer,
                        clip_high=config.epsilon_high, is_level=config.importance_sampling_level,
                        dpo_loss=config.dpo_loss, label_smoothing=config.label_smoothing)


def reduce_tokens(x: Tensor, mask: Tensor, s: LossSettings) -> Tensor:
    """``x [B, R]`` to a scalar by ``s.reduction``: the core's ``reduce``, or for ``dapo`` the masked sum divided
    by ``s.normalizer``."""
    if s.reduction == "dapo":
        return torch.where(mask, x, 0.0).sum() / s.normalizer
    return reduce(x, mask, s.reduction, normalizer=s.normalizer)


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


def policy_loss_ppo(logp: Tensor, logp_old: Tensor, logp_ref: Tensor | None, advantages: Tensor, mask: Tensor,
                    s: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped surrogate per token (Schulman et al. 2017, eq. 7), negated, plus ``beta`` times the k3
    KL(pi_theta || pi_ref) per token when ``beta > 0`` and a reference is given (GRPO, Shao et al. 2024, eq. 3),
    reduced over the mask by ``s.reduction`` (``reduce_tokens``):

        loss = reduce( -min(r A, clip(r, 1 - eps, 1 + eps_high) A) + beta * k3(pi_theta, pi_ref) )

    ``eps_high`` is ``s.clip_high`` (DAPO's clip-higher, Yu et al. 2025), ``clip_coef`` when None. With
    ``s.is_level == "sequence"`` the ratio of every token of row i is GSPO's sequence ratio (Zheng et al. 2025,
    eq. 7): ``r_i = exp(mean_t (log pi_theta - log pi_old))`` over the row's real tokens, gradient through the mean.

    Padding positions take pi_old's log-prob, so their ratio is exactly 1 and no gradient reaches them."""
    logp = torch.where(mask, logp, logp_old)
    ratio_logp = logp
    if s.is_level == "sequence":
        seq_log_ratio = (logp - logp_old).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        ratio_logp = torch.where(mask, logp_old.detach() + seq_log_ratio, logp_old)
    if s.clip_high is None:
        surrogate = clipped_surrogate(ratio_logp, logp_old, advantages, s.clip_coef)
    else:
        surrogate = _asymmetric_surrogate(ratio_logp, logp_old, advantages, s.clip_coef, s.clip_high)
    per_token = -surrogate
    stats: dict[str, Tensor] = {}
    if logp_ref is not None and s.beta > 0:
        kl_ref = torch.where(mask, kl_per_token(logp, logp_ref, "k3"), 0.0)
        per_token = per_token + s.beta * kl_ref
        stats["kl_ref_token"] = reduce(kl_ref.detach(), mask, "token_mean")
    loss = reduce_tokens(per_token, mask, s)
    with torch.no_grad():
        stats["policy_loss"] = -reduce_tokens(surrogate.detach(), mask, s)
        stats.update(_ratio_stats(ratio_logp, logp_old, mask, s.clip_coef))
    return loss, stats


def _asymmetric_surrogate(logp: Tensor, logp_old: Tensor, advantages: Tensor, low: float, high: float) -> Tensor:
    """``clipped_surrogate`` with the range ``[1 - low, 1 + high]``, the branch chosen by the same rule
    (``past_clip``)."""
    advantages = advantages.detach()
    ratio = torch.exp(logp - logp_old.detach())
    ratio_clipped = torch.clamp(ratio, 1.0 - low, 1.0 + high)
    past = past_clip(ratio.detach(), ratio_clipped.detach(), advantages)
    return torch.where(past, ratio_clipped * advantages, ratio * advantages)


# Registered by a call, not as a decorator: mutmut 3 makes no mutants of a decorated function (docs/mutation.md).
register_loss("ppo")(policy_loss_ppo)


def policy_loss_dpo(logp: Tensor, logp_old: Tensor, logp_ref: Tensor | None, advantages: Tensor, mask: Tensor,
                    s: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """DPO (Rafailov et al. 2023, eq. 7) and its variants on ``[2N, R]`` rows, chosen over rejected. With sequence
    log-probs ``L = sum_t logp`` and ``h = (L_c - L_c,ref) - (L_r - L_r,ref)``, by ``s.dpo_loss``:

    * ``sigmoid``: ``-(1 - ls) log sigmoid(beta h) - ls log sigmoid(-beta h)``, ``ls = s.label_smoothing``
      (0: the paper's loss; > 0: conservative DPO, the labels flipped with probability ls, as TRL);
    * ``ipo``: ``(h - 1 / (2 beta))^2`` (Azar et al. 2023, eq. 17) with ``L`` the token MEAN of each sequence
      (TRL's IPO: length-normalized log-probs);
    * ``hinge``: ``max(0, 1 - beta h)`` (SLiC, Zhao et al. 2023).

    averaged over the pairs (``logsigmoid`` is the stable form). The implicit rewards in the stats are
    ``beta * (L - L_ref)``. ``logp_old`` and ``advantages`` are unused."""
    if logp_ref is None:
        raise ValueError("the dpo loss needs the reference log-probs (logp_ref)")
    if logp.shape[0] % 2:
        raise ValueError(f"the dpo loss takes chosen rows over rejected rows (an even count), got {logp.shape[0]}")
    seq = torch.where(mask, logp, 0.0).sum(-1)
    seq_ref = torch.where(mask, logp_ref, 0.0).sum(-1)
    if s.dpo_loss == "ipo":
        lengths = mask.sum(-1).clamp(min=1)
        seq, seq_ref = seq / lengths, seq_ref / lengths
    rewards = s.beta * (seq - seq_ref)
    chosen, rejected = rewards.chunk(2)
    margin = chosen - rejected  # beta * h
    h_c, h_r = (seq - seq_ref).chunk(2)
    h = h_c - h_r
    if s.dpo_loss == "sigmoid":
        losses = -F.logsigmoid(margin)
        if s.label_smoothing:
            losses = (1 - s.label_smoothing) * losses - s.label_smoothing * F.logsigmoid(-margin)
    elif s.dpo_loss == "ipo":
        losses = (h - 1 / (2 * s.beta)) ** 2
    elif s.dpo_loss == "hinge":
        losses = torch.relu(1 - s.beta * h)
    else:
        raise ValueError(f"unknown dpo_loss {s.dpo_loss!r}; choose one of {', '.join(DPO_LOSSES)}")
    loss = losses.mean()
    with torch.no_grad():
        stats = {"chosen_rewards": chosen.detach().mean(), "rejected_rewards": rejected.detach().mean(),
                 "margin": margin.detach().mean(), "accuracy": (chosen > rejected).float().mean()}
    return loss, stats


register_loss("dpo")(policy_loss_dpo)
