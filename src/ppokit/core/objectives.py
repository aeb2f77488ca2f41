"""PPO's math as pure functions: surrogate objectives, losses, KL estimators and diagnostics.

Every function takes tensors of any batch shape (``[B]`` or ``[T, N]``; shapes must match exactly, no silent
broadcasting) and holds no environment, optimizer or I/O. Conventions follow Schulman et al. (2017),
"Proximal Policy Optimization Algorithms": objectives are maximized, losses are minimized, and every loss
returned here is already signed for ``loss.backward()`` so the sign bug of maximizing the loss cannot be made
through the public API.

Each scalar loss and diagnostic reduces its per-sample terms through ``reductions.reduce(x, mask, mode)``: the
default (``mask=None, mode="mean"``) is exactly the plain batch ``.mean()`` of PPO; a token-level trainer passes
its ``[B, T]`` padding mask and an aggregation mode (see ``reductions``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ppokit.core.reductions import reduce

__all__ = [
    "ppo_objective",
    "clipped_surrogate",
    "past_clip",
    "policy_loss",
    "value_loss",
    "entropy_loss",
    "categorical_entropy",
    "gaussian_entropy",
    "kl_penalty_objective",
    "kl_penalty_loss",
    "approx_kl_k1",
    "approx_kl_k3",
    "categorical_kl",
    "gaussian_kl",
    "clip_fraction",
    "explained_variance",
]


def _same_shape(*tensors: Tensor) -> None:
    """Raise if the tensors differ in shape: a ``[B]`` vs ``[B, 1]`` broadcast is a classic silent PPO bug."""
    first = tensors[0].shape
    for t in tensors[1:]:
        if t.shape != first:
            raise ValueError(f"shape mismatch: {tuple(first)} vs {tuple(t.shape)} (no implicit broadcasting)")


def ppo_objective(logp_new: float, logp_old: float, advantage: float, eps: float) -> float:
    """Scalar clipped surrogate ``min(r*A, clip(r, 1-eps, 1+eps)*A)`` with ``r = exp(logp_new - logp_old)``."""
    ratio = math.exp(logp_new - logp_old)
    clipped = min(max(ratio, 1.0 - eps), 1.0 + eps)
    return min(ratio * advantage, clipped * advantage)


def clipped_surrogate(logp_new: Tensor, logp_old: Tensor, advantages: Tensor, clip_coef: float) -> Tensor:
    """Per-sample clipped surrogate, shape of the inputs; to be maximized.

    ``ratio = exp(logp_new - logp_old)``; the ratio is formed from log-probabilities, never ``p_new / p_old``,
    for numerical stability. ``logp_old`` and ``advantages`` are constants (detached): gradients flow only
    through ``logp_new``. The gradient w.r.t. ``logp_new`` is ``ratio * A`` except where the ratio has moved
    past the clip in the improving direction (A > 0 and r > 1+eps, or A < 0 and r < 1-eps), where it is 0.

    The branch is chosen by exactly that rule (``past_clip``), not by comparing the rounded products: in exact
    arithmetic it is where the minimum is the clipped term, but in float32 ``r*A`` and ``clip(r)*A`` can round
    to the same value with r just past the clip, and ``torch.minimum`` then splits the gradient 50/50 at the
    tie. Selecting with ``torch.where`` sends all of it to one branch; the fused update's hand-written backward
    uses the same mask, so the two paths agree at such ties.
    """
    _same_shape(logp_new, logp_old, advantages)
    advantages = advantages.detach()
    ratio = torch.exp(logp_new - logp_old.detach())
    ratio_clipped = torch.clamp(ratio, 1.0 - clip_coef, 1.0 + clip_coef)
    past = past_clip(ratio.detach(), ratio_clipped.detach(), advantages)
    return torch.where(past, ratio_clipped * advantages, ratio * advantages)


def past_clip(ratio: Tensor, ratio_clipped: Tensor, advantages: Tensor) -> Tensor:
    """Bool mask of samples whose ratio left the clip range in the improving direction: ``r`` above the range
    with ``A > 0`` or below it with ``A < 0`` (``ratio_clipped = clamp(r, 1-eps, 1+eps)``). There the clipped
    surrogate is the constant ``clip(r)*A`` and passes no gradient; everywhere else it is ``r*A``.

    Written as ``(r - clip(r)) * A > 0`` (the two signs agree): three ops instead of seven in the fused
    update's hot loop. The product only underflows to 0 for ``|A| < ~1e-30``, where r*A's gradient is nil anyway.
    """
    return (ratio - ratio_clipped).mul_(advantages) > 0


def policy_loss(logp_new: Tensor, logp_old: Tensor, advantages: Tensor, clip_coef: float,
                mask: Tensor | None = None, mode: str = "mean") -> Tensor:
    """Scalar PPO-Clip policy loss to minimize: ``-reduce(clipped_surrogate, mask, mode)`` (``-mean`` by default)."""
    return -reduce(clipped_surrogate(logp_new, logp_old, advantages, clip_coef), mask, mode)


def value_loss(
    values: Tensor,
    returns: Tensor,
    old_values: Tensor | None = None,
    clip_coef: float | None = None,
    mask: Tensor | None = None,
    mode: str = "mean",
) -> Tensor:
    """Scalar critic loss ``0.5 * mean((V - R)^2)`` (the mean is ``reduce(., mask, mode)``).

    With ``old_values`` and ``clip_coef`` given, the PPO2/CleanRL clipped form: the value change is clipped to
    ``old_values +- clip_coef`` and the loss is the elementwise max of the clipped and unclipped squared errors;
    the clipped branch is taken only where it is strictly larger, so at a tie (the return exactly midway between
    V and its clipped value, which float32 hits) the whole gradient goes to the unclipped branch, where
    ``torch.maximum`` would split it 50/50. The fused update's backward makes the same choice.
    """
    _same_shape(values, returns)
    returns = returns.detach()
    unclipped = (values - returns) ** 2
    if old_values is None or clip_coef is None:
        return 0.5 * reduce(unclipped, mask, mode)
    _same_shape(values, old_values)
    old_values = old_values.detach()
    values_clipped = old_values + torch.clamp(values - old_values, -clip_coef, clip_coef)
    clipped = (values_clipped - returns) ** 2
    return 0.5 * reduce(torch.where(clipped > unclipped, clipped, unclipped), mask, mode)


def categorical_entropy(logits: Tensor) -> Tensor:
    """Entropy in nats of categorical distributions, ``[..., K]`` logits -> ``[...]``."""
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def gaussian_entropy(log_std: Tensor) -> Tensor:
    """Entropy in nats of a diagonal Gaussian, ``[..., D]`` log-std -> ``[...]`` (summed over action dims)."""
    return (log_std + 0.5 * math.log(2.0 * math.pi * math.e)).sum(-1)


def entropy_loss(entropy: Tensor, mask: Tensor | None = None, mode: str = "mean") -> Tensor:
    """Scalar entropy term to add to the loss: ``-mean(entropy)`` (minimizing it raises entropy); the mean is
    ``reduce(entropy, mask, mode)``, which is also the entropy diagnostic of a masked batch."""
    return -reduce(entropy, mask, mode)


def approx_kl_k1(logp_new: Tensor, logp_old: Tensor, mask: Tensor | None = None, mode: str = "mean") -> Tensor:
    """k1 estimate of KL(pi_old || pi_theta) from actions sampled by pi_old: ``mean(logp_old - logp_new)``.

    Unbiased but high-variance and can be negative on a finite sample (Schulman, "Approximating KL divergence").
    """
    _same_shape(logp_new, logp_old)
    return reduce(logp_old - logp_new, mask, mode)


def approx_kl_k3(logp_new: Tensor, logp_old: Tensor, mask: Tensor | None = None, mode: str = "mean") -> Tensor:
    """k3 estimate of KL(pi_old || pi_theta): ``mean((r - 1) - log r)``, ``r = pi_theta/pi_old``; unbiased, >= 0."""
    _same_shape(logp_new, logp_old)
    logratio = logp_new - logp_old
    return reduce(torch.expm1(logratio) - logratio, mask, mode)


def categorical_kl(logits_p: Tensor, logits_q: Tensor) -> Tensor:
    """Exact KL(p || q) in nats between categoricals given by logits, ``[..., K]`` -> ``[...]``."""
    _same_shape(logits_p, logits_q)
    logp = torch.log_softmax(logits_p, dim=-1)
    logq = torch.log_softmax(logits_q, dim=-1)
    return (logp.exp() * (logp - logq)).sum(-1)


def gaussian_kl(mean_p: Tensor, log_std_p: Tensor, mean_q: Tensor, log_std_q: Tensor) -> Tensor:
    """Exact KL(p || q) between diagonal Gaussians, ``[..., D]`` -> ``[...]`` (summed over action dims)."""
    _same_shape(mean_p, mean_q)
    var_p = torch.exp(2.0 * log_std_p)
    var_q = torch.exp(2.0 * log_std_q)
    per_dim = log_std_q - log_std_p + (var_p + (mean_p - mean_q) ** 2) / (2.0 * var_q) - 0.5
    return per_dim.sum(-1)


def kl_penalty_objective(logp_new: Tensor, logp_old: Tensor, advantages: Tensor, beta: float,
                         mask: Tensor | None = None, mode: str = "mean") -> Tensor:
    """Scalar PPO-KL objective to maximize: ``mean(r * A) - beta * KL(pi_old || pi_theta)``.

    The KL term is the k3 estimate on the sampled actions (non-negative, so the penalty never rewards drift).
    Schulman et al. (2017), section 4; no clipping. Both means are ``reduce(., mask, mode)``.
    """
    _same_shape(logp_new, logp_old, advantages)
    ratio = torch.exp(logp_new - logp_old.detach())
    surrogate = reduce(ratio * advantages.detach(), mask, mode)
    return surrogate - beta * approx_kl_k3(logp_new, logp_old.detach(), mask, mode)


def kl_penalty_loss(logp_new: Tensor, logp_old: Tensor, advantages: Tensor, beta: float,
                    mask: Tensor | None = None, mode: str = "mean") -> Tensor:
    """Scalar PPO-KL loss to minimize: ``-kl_penalty_objective``."""
    return -kl_penalty_objective(logp_new, logp_old, advantages, beta, mask, mode)


def clip_fraction(ratio: Tensor, clip_coef: float, mask: Tensor | None = None, mode: str = "mean") -> Tensor:
    """Share of samples whose ratio left the trust region, ``mean(|r - 1| > eps)``, a float scalar in [0, 1]; the
    mean is ``reduce(., mask, mode)`` (padded tokens are neither clipped nor counted)."""
    if mask is not None:
        _same_shape(ratio, mask)
    return reduce(((ratio - 1.0).abs() > clip_coef).float(), mask, mode)


def explained_variance(predicted: Tensor, target: Tensor, mask: Tensor | None = None) -> Tensor:
    """``1 - Var(target - predicted) / Var(target)``: 1 is a perfect critic, 0 no better than the mean.

    Returns NaN when ``Var(target) == 0`` (the ratio is undefined; a constant target says nothing of the critic).
    A constant target is detected by comparing elements, not by ``var == 0``: the rounded mean of e.g. seven
    float32 copies of 0.1 is off by one ulp, so the computed variance is ~1e-17, not 0, and the ratio is garbage.

    With ``mask`` (same shape, nonzero = counted) both variances are taken over the counted entries only: the
    result is that of the unmasked function on those entries (NaN when none is counted). It is a ratio of
    variances over all counted tokens, so it has no per-sequence mode.
    """
    _same_shape(predicted, target)
    if mask is not None:
        _same_shape(target, mask)
        # Boolean indexing syncs with the host; this diagnostic is computed once per update, not per minibatch.
        keep = mask if mask.dtype == torch.bool else mask != 0
        predicted, target = predicted[keep], target[keep]
        if target.numel() == 0:
            return torch.full((), float("nan"), dtype=target.dtype, device=target.device)
    var_target = target.var(unbiased=False)
    var_resid = (target - predicted).var(unbiased=False)
    constant = (target == target.reshape(-1)[:1]).all() | (var_target == 0)
    nan = torch.full_like(var_target, float("nan"))
    return torch.where(constant, nan, 1.0 - var_resid / var_target)
