"""Advantage estimation: Generalized Advantage Estimation (Schulman et al. 2016) and normalization.

``terminated`` and ``truncated`` are kept apart (as in TorchRL): a termination cuts the bootstrap (the
episode really ended, the next state's value is 0), a truncation by a time limit does not (the value of the
true final observation is bootstrapped). Both cut the GAE recursion, since the next step of that env belongs
to a new episode.

Both functions take an optional ``mask`` for padded data (a token-level trainer's responses of different
lengths): a zero entry is padding, it gets exactly 0 out and none of its values leak into the valid entries.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = ["gae", "normalize"]


def gae(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor,
    terminated: Tensor,
    truncated: Tensor,
    gamma: float,
    gae_lambda: float,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """GAE over a time-major rollout; all inputs ``[T, N]``, returns ``(advantages, returns)``, both ``[T, N]``.

    ``values[t]`` is V(s_t); ``next_values[t]`` is V of the observation that followed step t (for a truncated
    step the final observation of that episode, never the reset observation).
    ``delta_t = r_t + gamma * (1 - terminated_t) * next_values[t] - values[t]`` and
    ``A_t = delta_t + gamma * lambda * (1 - done_t) * A_{t+1}`` with ``done = terminated or truncated``;
    ``returns = advantages + values``. One reverse loop over T, vectorized over N.

    ``mask`` (``[T, N]`` like the rest, nonzero = a real step, zero = padding) is for padded sequences, e.g. a
    token trainer's ``[B, T]`` responses, passed transposed (``gae(r.T, v.T, ..., mask=m.T)``, results ``.T``).
    Each unbroken run of real steps along T is one sequence: padded steps get advantage 0 and return 0, and the
    last real step of a run ends its episode: it bootstraps from 0 (it is treated as terminated, so the padding's
    or the next sequence's value never reaches it) unless ``truncated`` is set there, which asks for the usual
    bootstrap from ``next_values``. Padding values may be garbage, even non-finite. So a right-padded row gives
    exactly what the unmasked ``gae`` gives on its real steps alone with ``terminated`` set at the last one.
    """
    shape = rewards.shape
    for name, t in (("values", values), ("next_values", next_values), ("terminated", terminated), ("truncated", truncated)):
        if t.shape != shape:
            raise ValueError(f"gae: {name} has shape {tuple(t.shape)}, rewards has {tuple(shape)}; all must be [T, N]")
    if rewards.dim() != 2:
        raise ValueError(f"gae: expected [T, N] tensors, got {rewards.dim()} dims")
    if mask is not None:
        return _masked_gae(rewards, values, next_values, terminated, truncated, gamma, gae_lambda, mask)
    not_terminated = 1.0 - terminated.to(rewards.dtype)
    not_done = 1.0 - (terminated | truncated).to(rewards.dtype)
    # Everything that does not depend on the recursion is computed for all steps at once.
    deltas = rewards + gamma * not_terminated * next_values - values
    decay = (gamma * gae_lambda) * not_done
    advantages = _recursion(deltas, decay)
    return advantages, advantages + values


def _recursion(deltas: Tensor, decay: Tensor) -> Tensor:
    """``A_t = delta_t + decay_t * A_{t+1}`` with ``A_T = 0``, one reverse loop over T (``[T, N]`` -> ``[T, N]``)."""
    if (deltas.device.type == "cpu" and decay.device.type == "cpu" and deltas.dtype == decay.dtype
            and deltas.dtype in _HOST_DTYPES and not (deltas.requires_grad or decay.requires_grad)):
        return _host_recursion(deltas, decay)
    advantages = torch.empty_like(deltas)
    last = torch.zeros_like(deltas[0])
    for t in range(deltas.shape[0] - 1, -1, -1):
        last = deltas[t] + decay[t] * last
        advantages[t] = last
    return advantages


_HOST_DTYPES = (torch.float32, torch.float64)


def _host_recursion(deltas: Tensor, decay: Tensor) -> Tensor:
    """``_recursion`` in numpy, for CPU tensors: the same two IEEE-754 operations per element in the same dtype and
    order (a multiply, then an add, each rounded; torch's elementwise kernels fuse nothing across ops), so the same
    bits, at a fraction of the per-step dispatch cost of T tensor ops on ``[N]`` rows (with one env, a rollout of
    2048 steps spent ~10 ms here). One env runs on numpy scalars of the tensors' dtype (each op ~0.1 us)."""
    d, k = deltas.detach().numpy(), decay.detach().numpy()
    out = np.empty(d.shape, dtype=d.dtype)
    with np.errstate(all="ignore"):  # NaN/Inf propagate silently, as in torch
        _host_loop(d, k, out)
    return torch.from_numpy(out)


def _host_loop(d: np.ndarray, k: np.ndarray, out: np.ndarray) -> None:
    if d.shape[1] == 1:
        col_d, col_k, col_out = d[:, 0], k[:, 0], out[:, 0]
        last = d.dtype.type(0.0)
        for t in range(d.shape[0] - 1, -1, -1):
            last = col_d[t] + col_k[t] * last
            col_out[t] = last
    else:
        last = np.zeros(d.shape[1], dtype=d.dtype)
        for t in range(d.shape[0] - 1, -1, -1):
            last = d[t] + k[t] * last
            out[t] = last


def _masked_gae(rewards: Tensor, values: Tensor, next_values: Tensor, terminated: Tensor, truncated: Tensor,
                gamma: float, gae_lambda: float, mask: Tensor) -> tuple[Tensor, Tensor]:
    """``gae`` with padding (see its docstring); all inputs already checked to be ``[T, N]``."""
    if mask.shape != rewards.shape:
        raise ValueError(f"gae: mask has shape {tuple(mask.shape)}, rewards has {tuple(rewards.shape)}; "
                         f"all must be [T, N]")
    keep = mask if mask.dtype == torch.bool else mask != 0
    # A real step whose next step is padding (or past the end of T) is the last step of its sequence.
    keep_next = torch.cat([keep[1:], torch.zeros_like(keep[:1])])
    seq_end = keep & ~keep_next
    cut_bootstrap = terminated | (seq_end & ~truncated)
    # Padding also cuts the recursion, so a padded step's A = 0 never multiplies into a real one (0 * Inf = NaN
    # if the padding held garbage).
    cut_recursion = terminated | truncated | seq_end | ~keep
    # ``where`` rather than ``* 0``: a non-finite value in the padding must not survive as NaN.
    bootstrap = torch.where(cut_bootstrap, 0.0, next_values)
    deltas = torch.where(keep, rewards + gamma * bootstrap - values, 0.0)
    decay = (gamma * gae_lambda) * (1.0 - cut_recursion.to(rewards.dtype))
    advantages = _recursion(deltas, decay)
    returns = torch.where(keep, advantages + values, 0.0)
    return torch.where(keep, advantages, 0.0), returns


# A spread of at most this many ulps of |mean| is rounding noise, not signal: the computed mean of n equal
# float values is off by up to ~log2(n) ulps (pairwise summation), so the "centred" values of a constant vector
# are that error, and dividing them by an equally tiny std turns them into O(1) garbage (seven float32 copies of
# 0.1 normalize to -0.427 each). 32 ulps covers any batch below 2^32 elements; measured worst case on 2^21
# float32 elements is under 5 ulps.
SPREAD_ULPS = 32.0


def normalize(x: Tensor, eps: float = 1e-8, dim: int | None = None, mask: Tensor | None = None) -> Tensor:
    """Zero-mean, unit-std copy of ``x`` (population std): over all its elements, or along ``dim`` per slice.

    ``(x - mean) / (std + eps)``, except that a slice whose std is within rounding error of its mean
    (``std <= SPREAD_ULPS * finfo.eps * |mean|``, which includes every constant slice) becomes exactly 0: it holds
    no ordering information, only rounding noise. NaN/Inf inputs stay non-finite, so the update's guard still
    skips them. The fused update (``kernels.fused_step._normalize_rows``) calls this same function.

    With ``mask`` (same shape as ``x``, nonzero = counted; TRL calls this masked whitening) the mean and std are
    those of the counted entries only (of each slice along ``dim``), the uncounted entries come out exactly 0
    whatever they held, and the constant rule holds for the counted entries (a slice with no or one counted entry
    is all 0).
    """
    if mask is not None:
        return _masked_normalize(x, eps, dim, mask)
    if dim is None:
        std, mean = torch.std_mean(x, unbiased=False)
    else:
        std, mean = torch.std_mean(x, dim, unbiased=False, keepdim=True)
    tol = SPREAD_ULPS * torch.finfo(x.dtype).eps
    # ``<=`` is False for a NaN std, so a non-finite input is not silently turned into zeros.
    noise = std <= tol * mean.abs()
    return torch.where(noise, torch.zeros_like(x), (x - mean) / (std + eps))


def _masked_normalize(x: Tensor, eps: float, dim: int | None, mask: Tensor) -> Tensor:
    if mask.shape != x.shape:
        raise ValueError(f"normalize: mask has shape {tuple(mask.shape)}, x has {tuple(x.shape)}; they must match")
    keep = mask if mask.dtype == torch.bool else mask != 0

    def total(t: Tensor) -> Tensor:
        return t.sum() if dim is None else t.sum(dim, keepdim=True)

    count = total(keep).clamp(min=1)
    mean = total(torch.where(keep, x, 0.0)) / count
    # Two passes (centre, then square), as std_mean does: the population variance of the counted entries.
    std = (total(torch.where(keep, (x - mean) ** 2, 0.0)) / count).sqrt()
    tol = SPREAD_ULPS * torch.finfo(x.dtype).eps
    noise = std <= tol * mean.abs()
    return torch.where(keep & ~noise, (x - mean) / (std + eps), 0.0)
