"""Token log-probabilities, response masks and per-token KL estimators: the one copy every LM trainer uses.

Layout of every sequence batch here: ``input_ids [B, P + R]`` = a left-padded prompt block ``[B, P]`` followed by
a response block ``[B, R]``; ``attention_mask`` is 1 on real prompt tokens and on response tokens up to and
including the first stop token, 0 elsewhere. Position ids are ``cumsum(attention_mask) - 1`` (clamped at 0 on the
left padding): without them a left-padded row's positions are shifted by its padding, which moves its log-probs
by up to 0.85 nats/token on a real model (issue 11), and the recomputed log-probs no longer equal the ones the
generation sampled with (``transformers``' ``generate`` derives positions the same way).

The logits predicting response token ``t`` sit at position ``P + t - 1``, so the response's log-probs come from
positions ``P - 1 .. P + R - 2`` (the last prompt token is always real with left padding); the last position
``P + R - 1`` is never run (``sequence_forward``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["position_ids", "response_mask", "sequence_forward", "token_logprobs", "selective_logprobs", "entropy_of",
           "kl_per_token", "logprobs_of", "micro_slices", "in_micro_batches"]


def micro_slices(rows: int, size: int | None) -> list[slice]:
    """``rows`` split into consecutive slices of ``size`` rows (the last one may be shorter); one slice when
    ``size`` is None (``LMConfig.micro_batch_size``)."""
    step = rows if size is None else size
    return [slice(i, min(i + step, rows)) for i in range(0, rows, max(1, step))] or [slice(0, 0)]


def in_micro_batches(fn, size: int | None, *tensors: Tensor) -> Tensor:
    """``fn(*tensors)`` computed over row slices of ``size`` (``micro_slices``) and concatenated along the rows: a
    no-gradient pass (pi_old, pi_ref, the values) then holds one micro-batch's activations and logits, not the
    rollout's. Rows are independent sequences, so the result is the one pass's to rounding."""
    if size is None or tensors[0].shape[0] <= size:
        return fn(*tensors)
    return torch.cat([fn(*(t[s] for t in tensors)) for s in micro_slices(tensors[0].shape[0], size)])


def position_ids(attention_mask: Tensor) -> Tensor:
    """``cumsum(mask) - 1`` clamped at 0: ``[B, L]`` -> ``[B, L]`` long (left padding gets position 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def response_mask(response_ids: Tensor, stop_ids: Tensor | list[int] | int) -> Tensor:
    """``[B, R]`` bool: True up to and including the first stop token of each row, all True when there is none.

    Decided by position, never by comparing with the pad id: when pad == EOS (GPT-2's convention) the EOS is a
    real token the policy chose and must be trained on and scored (trl PR#6357), while the pads after it are not.
    """
    stops = torch.as_tensor(stop_ids, device=response_ids.device).reshape(-1)
    is_stop = torch.isin(response_ids, stops)  # [B, R]
    # Stops strictly before t: t is past the first stop iff one came earlier.
    before = torch.cumsum(is_stop.long(), -1) - is_stop.long()
    return before == 0


def _forward(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, keep: int):
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                  use_cache=False)
    try:
        # Only the last ``keep`` positions' logits: the prompt's [B, P, V] logits are never materialized.
        return model(**kwargs, logits_to_keep=keep)
    except TypeError:  # a model without logits_to_keep
        return model(**kwargs)


def sequence_forward(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, n_response: int) -> Tensor:
    """Logits predicting the ``n_response`` response tokens: ``[B, R, V]`` (float, before any temperature).

    The forward runs on ``[:, :-1]``: the last position's logits would predict a token after the response and are
    never read, and a causal model's logits at the other positions do not depend on it (7.3 -> 7.0 ms per 32-row
    forward+backward on the tiny GPT-2). Cutting the mask before ``position_ids`` gives the same positions, since
    ``cumsum`` of a prefix is the prefix of the ``cumsum``. Every log-prob the trainers compare (pi_old, pi_ref,
    the minibatch forwards, DPO's) comes through here, so they all see the same cut.
    """
    if n_response < 1:  # logits_to_keep=0 would mean "all positions" to transformers
        raise ValueError(f"sequence_forward: n_response must be >= 1, got {n_response}")
    out = _forward(model, input_ids[:, :-1], attention_mask[:, :-1], n_response)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits[:, -n_response:]


def logprobs_of(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """``log softmax(logits / temperature)`` at ``tokens``: ``[B, R, V]``, ``[B, R]`` -> ``[B, R]``."""
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits.float(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


# Rows per chunk of the no-gradient log-softmax: at most about this many logits in float32 at once (64 MB).
_CHUNK_ELEMENTS = 1 << 24


def selective_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """``log softmax(logits)`` at ``tokens`` as ``logit[token] - logsumexp(logits)`` (the same function).

    Without gradient (pi_old, pi_ref) it runs over row chunks of ``_CHUNK_ELEMENTS`` logits, so no float32
    ``[B, R, V]`` tensor is made beside the logits (a half-precision model's logits are never upcast whole).
    With gradient it is one pass: the backward holds one full-vocabulary tensor either way (``logsumexp``'s
    input here, ``log_softmax``'s output in the textbook form)."""
    if torch.is_grad_enabled() and logits.requires_grad:
        lf = logits.float()
        return lf.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(lf, -1)
    rows = max(1, _CHUNK_ELEMENTS // max(1, logits.shape[1] * logits.shape[2]))
    out = []
    with torch.no_grad():
        for lg, tk in zip(logits.split(rows), tokens.split(rows)):
            lf = lg.float()
            out.append(lf.gather(-1, tk.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(lf, -1))
    return torch.cat(out)


def entropy_of(logits: Tensor) -> Tensor:
    """``[B, R]`` entropy of ``softmax(logits)`` as ``logsumexp(x) - sum(p x)``; without gradient over row chunks,
    as ``selective_logprobs``."""
    def one(lf: Tensor) -> Tensor:
        return torch.logsumexp(lf, -1) - (torch.softmax(lf, -1) * lf).sum(-1)

    if torch.is_grad_enabled() and logits.requires_grad:
        return one(logits.float())
    rows = max(1, _CHUNK_ELEMENTS // max(1, logits.shape[1] * logits.shape[2]))
    with torch.no_grad():
        return torch.cat([one(lg.float()) for lg in logits.split(rows)])


def token_logprobs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, n_response: int,
                   temperature: float = 1.0, with_entropy: bool = False,
                   entropy_grad: bool = True) -> tuple[Tensor, Tensor | None]:
    """Log-probs of the response tokens under ``model``'s tempered distribution, and optionally its entropy.

    ``input_ids``/``attention_mask`` ``[B, P + R]`` (layout in the module docstring) -> ``logp [B, R]`` float32 and
    ``entropy [B, R]`` (nats of ``softmax(logits / temperature)`` at each response position) or None. With
    ``entropy_grad=False`` the entropy is computed detached (for logging only: no graph, no saved
    full-vocabulary tensors). Values at masked positions are finite but meaningless; every caller masks them out.
    """
    B = input_ids.shape[0]
    if n_response == 0:
        empty = torch.zeros(B, 0, device=input_ids.device)
        return empty, (empty if with_entropy else None)
    logits = sequence_forward(model, input_ids, attention_mask, n_response)
    if temperature != 1.0:
        logits = logits / temperature
    logp = selective_logprobs(logits, input_ids[:, -n_response:])
    entropy = None
    if with_entropy:
        entropy = entropy_of(logits if entropy_grad else logits.detach())
    return logp, entropy


def kl_per_token(logp: Tensor, logp_ref: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled by pi; ``[B, R]`` -> ``[B, R]``.

    * ``k1 = log pi - log pi_ref``: unbiased, can be negative on a sample (summed over a sequence it is the
      sequence's log-ratio, the classic RLHF penalty; Ziegler et al. 2019).
    * ``k3 = (r - 1) - log r`` with ``r = pi_ref / pi``: unbiased and >= 0 token by token (Schulman, "Approximating
      KL divergence", 2020); GRPO's penalty (Shao et al. 2024). The same formula as
      ``objectives.approx_kl_k3(logp_ref, logp)`` before its reduction.
    """
    if logp.shape != logp_ref.shape:
        raise ValueError(f"kl_per_token: shapes {tuple(logp.shape)} and {tuple(logp_ref.shape)} differ")
    if estimator == "k1":
        return logp - logp_ref
    if estimator == "k3":
        logratio = logp_ref - logp
        return torch.expm1(logratio) - logratio
    raise ValueError(f"kl_per_token: unknown estimator {estimator!r}; choose k1 or k3")
