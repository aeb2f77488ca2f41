"""DAPO's dynamic sampling (Yu et al. 2025, section 3.2 and Algorithm 1): keep sampling prompt groups until the batch
holds ``batch_prompts`` groups whose G rewards are not all equal.

A group whose completions all score the same has advantage exactly 0 on every token (``grpo.group_advantages``):
it adds nothing to the policy gradient, and as the policy gets a prompt always right (or always wrong) more and more
of each batch is such groups, so the effective batch shrinks. DAPO over-samples: it drops those groups and samples
the next prompts, round after round, until the batch is full, then trims it to the batch size. The number of rounds
is bounded (``LMConfig.max_resample_rounds`` extra rounds; verl calls it ``max_num_gen_batches``): when the bound
is reached the iteration trains on the groups it has, fewer than asked for (none, when every group was constant).

``fill_groups`` runs that loop over any sampler; the trainer logs the extra rounds, the groups dropped and the
groups trained on (``lm/resample_rounds``, ``lm/dropped_groups``, ``lm/train_groups``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ppokit.lm.rollout import Sampled, TokenBatch

__all__ = ["DynamicSample", "fill_groups", "concat_sampled", "select_rows"]


@dataclass
class DynamicSample:
    """What ``fill_groups`` returns."""

    train: Sampled  # the groups with a reward spread, at most the first round's count, in the order they came
    generated: Sampled  # every completion sampled in all the rounds (the iteration's rollout metrics describe it)
    rounds: int  # extra generation rounds taken (0: the first round filled the batch)
    dropped: int  # groups left out because their rewards were all equal, over all rounds


def fill_groups(first: Sampled, sample_next: Callable[[], Sampled], zero_std: Callable[[Tensor], Tensor],
                group_size: int, max_rounds: int, pad_token_id: int) -> DynamicSample:
    """Dynamic sampling from the first round ``first`` (``P`` groups of ``group_size`` consecutive rows).

    ``sample_next()`` samples the next round (the next prompts, G completions each); ``zero_std(scores [B]) -> [B//G]``
    flags the groups whose rewards are all equal. Rounds are sampled while fewer than ``P`` groups were kept and
    fewer than ``max_rounds`` extra rounds were taken; the kept groups are trimmed to ``P``."""
    G = group_size
    want = len(first.completions) // G
    kept: list[Sampled] = []
    generated = [first]
    n_kept = rounds = dropped = 0
    s = first
    while True:
        zero = zero_std(s.batch.scores.detach().cpu()).bool()
        dropped += int(zero.sum())
        groups = torch.nonzero(~zero).squeeze(-1)[:want - n_kept]
        rows = (groups[:, None] * G + torch.arange(G)).reshape(-1)
        kept.append(select_rows(s, rows))
        n_kept += len(groups)
        if n_kept >= want or rounds >= max_rounds:
            break
        rounds += 1
        s = sample_next()
        generated.append(s)
    return DynamicSample(concat_sampled(kept, pad_token_id), concat_sampled(generated, pad_token_id), rounds, dropped)


def select_rows(s: Sampled, rows: Tensor) -> Sampled:
    """The rows ``rows`` (completion indices) of a ``Sampled``: its batch, texts, flags and reward terms."""
    idx = rows.tolist()
    return Sampled(s.batch.index(rows), [s.prompts[i] for i in idx], [s.completions[i] for i in idx],
                   s.has_eos[rows], s.raw_scores[rows], {k: v[rows] for k, v in s.reward_terms.items()})


def concat_sampled(parts: list[Sampled], pad_token_id: int) -> Sampled:
    """One ``Sampled`` of the rows of ``parts`` in order; the batches are padded to a common prompt width (on the
    left, as ``rollout.encode_prompts`` pads) and response width (on the right, as finished rows are), so every
    real token keeps its position (``position_ids = cumsum(mask) - 1``) and its log-probs."""
    if len(parts) == 1:
        return parts[0]
    batches = [p.batch for p in parts]
    R = max(b.n_response for b in batches)
    P = max(b.input_ids.shape[1] - b.n_response for b in batches)

    def pad(b: TokenBatch, name: str, t: Tensor) -> Tensor:
        r = b.n_response
        if name in ("input_ids", "attention_mask"):
            fill = pad_token_id if name == "input_ids" else 0
            p = t.shape[1] - r
            left = t.new_full((t.shape[0], P - p), fill)
            right = t.new_full((t.shape[0], R - r), fill)
            return torch.cat([left, t, right], 1)
        if t.dim() == 2:  # the response fields: masks and per-token values, nothing after the response
            return torch.cat([t, t.new_zeros((t.shape[0], R - r))], 1)
        return t  # per completion: scores

    names = [name for name, _ in batches[0].items()]
    fields = {name: torch.cat([pad(b, name, b[name]) for b in batches]) for name in names}
    terms = {k: torch.cat([p.reward_terms[k] for p in parts]) for k in parts[0].reward_terms}
    return Sampled(TokenBatch(**fields), [x for p in parts for x in p.prompts],
                   [x for p in parts for x in p.completions], torch.cat([p.has_eos for p in parts]),
                   torch.cat([p.raw_scores for p in parts]), terms)
