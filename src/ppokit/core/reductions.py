"""How per-sample terms become one scalar: the plain mean of an RL batch, or a masked mean over a token axis.

Every loss and diagnostic in ``objectives`` reduces through ``reduce``, so a token-level trainer (responses of
different lengths padded into a ``[B, T]`` tensor) reuses the same objectives with an explicit mask and a named
aggregation, instead of a copy of each loss with its own ``masked_mean``.

The mask is a selection, not a weight: a nonzero (True) entry counts, a zero (False) entry is left out. Left-out
entries are removed with ``torch.where``, never multiplied by 0, so a NaN or Inf in the padding cannot reach the
result (``NaN * 0`` is NaN) and their gradient is exactly 0. (A caveat of every masked loss: if the op *before*
``reduce`` has an infinite local derivative at a padded entry, e.g. ``exp`` of a huge padded log-ratio, its
backward is ``0 * inf = NaN``; keep padded inputs finite.)

Nothing is averaged over zero entries: an all-zero mask reduces to exactly 0 with a zero gradient, which is what
a token trainer expects of a minibatch whose responses were all empty (NaN would trip the update's non-finite
skip for no fault of the data).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["reduce", "REDUCTION_MODES"]


def _keep(x: Tensor, mask: Tensor) -> Tensor:
    """``mask`` as a bool tensor of exactly ``x``'s shape (no broadcasting: a ``[B, T]`` mask against a ``[T, B]``
    tensor must fail, not silently pair the wrong tokens)."""
    if mask.shape != x.shape:
        raise ValueError(f"reduce: mask has shape {tuple(mask.shape)}, the values have {tuple(x.shape)}; "
                         f"they must match exactly (no implicit broadcasting)")
    return mask if mask.dtype == torch.bool else mask != 0


def _per_seq(x: Tensor, mode: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"reduce: mode {mode!r} needs a [B, T] tensor (rows are sequences), got shape "
                         f"{tuple(x.shape)}")


def _token_mean(x: Tensor, mask: Tensor | None, normalizer: float | None) -> Tensor:
    # ``x.mean()`` itself when unmasked, so every unmasked loss is bit-identical to a plain ``.mean()``.
    if mask is None:
        return x.mean()
    keep = _keep(x, mask)
    return torch.where(keep, x, 0.0).sum() / keep.sum().clamp(min=1)


def _seq_mean_token_mean(x: Tensor, mask: Tensor | None, normalizer: float | None) -> Tensor:
    _per_seq(x, "seq_mean_token_mean")
    if mask is None:
        return x.mean(-1).mean()
    keep = _keep(x, mask)
    n_tokens = keep.sum(-1)  # [B]
    per_seq = torch.where(keep, x, 0.0).sum(-1) / n_tokens.clamp(min=1)  # [B], 0 for an empty row
    # An empty row has no token mean, so it is not one of the sequences averaged (padding rows to a fixed batch
    # shape leaves the loss unchanged); its per_seq is 0, so summing over all rows sums the non-empty ones.
    return per_seq.sum() / (n_tokens > 0).sum().clamp(min=1)


def _seq_mean_token_sum_norm(x: Tensor, mask: Tensor | None, normalizer: float | None) -> Tensor:
    _per_seq(x, "seq_mean_token_sum_norm")
    norm = float(x.shape[-1]) if normalizer is None else float(normalizer)
    if not norm > 0:
        raise ValueError(f"reduce: normalizer must be > 0 (a token count such as the generation budget), got "
                         f"{normalizer!r}")
    if mask is None:
        return (x.sum(-1) / norm).mean()
    keep = _keep(x, mask)
    per_seq = torch.where(keep, x, 0.0).sum(-1) / norm  # [B]
    # As in seq_mean_token_mean, empty rows are not sequences; with none empty this divides by B.
    return per_seq.sum() / (keep.sum(-1) > 0).sum().clamp(min=1)


_Reduction = Callable[[Tensor, Tensor | None, float | None], Tensor]

# The modes by name (a table, not an if-ladder). ``mean`` and ``token_mean`` are the same reduction: ``mean`` is
# the name an RL batch reads naturally, ``token_mean`` the one a token trainer does.
_MODES: dict[str, _Reduction] = {
    "mean": _token_mean,
    "token_mean": _token_mean,
    "seq_mean_token_mean": _seq_mean_token_mean,
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,
}
REDUCTION_MODES = tuple(_MODES)


def reduce(x: Tensor, mask: Tensor | None = None, mode: str = "mean", normalizer: float | None = None) -> Tensor:
    """Reduce per-sample (or per-token) values ``x`` to a scalar; ``mask`` (same shape, nonzero = counted) selects
    the entries that count, ``None`` counts all of them.

    With ``m`` the mask (all ones when ``None``), ``n_b = sum_t m[b, t]`` the length of sequence ``b`` and
    ``S = {b : n_b > 0}`` the non-empty sequences (rows of a ``[B, T]`` tensor):

    * ``mean`` / ``token_mean`` (any shape): ``sum(x * m) / sum(m)``, every token weighs the same, so long
      sequences weigh more. Exactly ``x.mean()`` when unmasked (PPO's batch mean). TRL calls the token-level
      form ``bnpo`` (and ``dapo``, where the token count is taken over the whole global batch; DAPO, Yu et al.
      2025, section 3.3).
    * ``seq_mean_token_mean`` (``[B, T]``): ``mean_{b in S} (sum_t x[b, t] m[b, t] / n_b)``, every sequence
      weighs the same whatever its length, so each token of a short response weighs more. The original GRPO
      aggregation (Shao et al. 2024; TRL's ``grpo``).
    * ``seq_mean_token_sum_norm`` (``[B, T]``): ``mean_{b in S} (sum_t x[b, t] m[b, t] / L)`` with a constant
      ``L = normalizer``, default ``T`` (the padded length). Dr. GRPO's fix for the length bias of the per-sequence
      mean (Liu et al. 2025, "Understanding R1-Zero-Like Training"; TRL's ``dr_grpo``): pass the generation budget
      as ``normalizer`` to make ``L`` the same for every batch.

    Empty rows are left out of the sequence means (TRL's ``grpo``/``dr_grpo`` count them, as zeros, in ``B``; the
    two agree when no row is empty). An all-zero mask gives exactly 0 with a zero gradient in every mode.
    """
    reduction = _MODES.get(mode)
    if reduction is None:
        raise ValueError(f"reduce: unknown mode {mode!r}; choose one of {', '.join(REDUCTION_MODES)}")
    return reduction(x, mask, normalizer)
