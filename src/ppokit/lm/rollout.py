"""The token rollout: prompts in, sampled completions with every tensor the update needs out.

Numbered as the pipeline runs (``sample``):

1. tokenize the prompts and pad them on the LEFT, so every row's last prompt token sits at the same column and
   the response block starts at column ``P`` for all rows;
2. sample the responses (``generation.Generator``);
3. the response mask: through the first stop token (``SamplingSettings.stop_token_ids``), included, decided by position (correct when pad == EOS);
4. log-probs under pi_old right after generation (the ratio's denominator), under pi_ref, and the values, all by
   one forward each with ``position_ids = cumsum(mask) - 1`` (``logprobs``);
5. the score of each completion (``rewards``; the prompts' extra dataset columns passed as keyword lists), minus ``missing_eos_penalty`` where no EOS was emitted; the
   trainers put it on the last real response token (the EOS when there is one: trl#1893, trl#3750 added it one
   token later).

``TokenBatch`` is the rollout as the epoch loop sees it (``epochs.ppo_epochs`` needs ``len`` and ``obs.device``):
rows are completions, the token axis is the response's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn

from ppokit.core.batch import Field, Schema, TensorBatch
from ppokit.lm.data import extra_columns
from ppokit.lm.generation import Generator, SamplingSettings
from ppokit.lm.logprobs import in_micro_batches, response_mask, token_logprobs

__all__ = ["TOKEN_FIELDS", "TokenBatch", "encode_prompts", "sample", "last_token_index", "place_scores"]

def _response(dims: dict) -> tuple[int, ...]:
    return (dims["R"],)


# One completion's tensors (``P`` prompt columns, ``R`` response columns), each declared once; a TokenBatch holds
# them as ``[B, ...]``.
TOKEN_FIELDS = Schema(
    Field("input_ids", lambda d: (d["P"] + d["R"],), torch.long,
          doc="left-padded prompt, then the response (pad after the first stop)"),
    Field("attention_mask", lambda d: (d["P"] + d["R"],), torch.long,
          doc="real prompt tokens and response tokens through the first stop"),
    Field("response_mask", _response, torch.bool,
          doc="the response tokens that count (through the first stop, EOS included)"),
    Field("logp_old", _response, doc="log pi_old of the sampled tokens (tempered), frozen right after generation"),
    Field("scores", (), doc="the completion's score (reward minus any missing-EOS penalty)"),
    Field("logp_ref", _response, optional=True, doc="log pi_ref of the sampled tokens"),
    Field("values", _response, optional=True, doc="V at the rollout (PPO)"),
    Field("advantages", _response, optional=True,
          doc="PPO: GAE, whitened; GRPO: the sequence's advantage on every token"),
    Field("returns", _response, optional=True, doc="value targets (PPO)"),
)


class TokenBatch(TensorBatch):
    """A rollout of ``B`` completions: ``TOKEN_FIELDS``, each ``[B, ...]``."""

    schema = TOKEN_FIELDS

    @property
    def obs(self) -> Tensor:
        """A tensor on the rows' device, for ``ppo_epochs``, which draws its shuffle there (the trainers' shuffle
        generator lives on the same device)."""
        return self.logp_old

    @property
    def n_response(self) -> int:
        return self.response_mask.shape[1]

    def index(self, idx: Tensor) -> "TokenBatch":
        return self.map(lambda t: t[idx.to(t.device)])


def encode_prompts(tokenizer: Any, prompts: list[str], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Left-padded ``(prompt_ids [B, P], prompt_mask [B, P])``; ``ValueError`` for a prompt with no tokens."""
    ids = [list(x) for x in tokenizer(list(prompts), add_special_tokens=True)["input_ids"]]
    for i, row in enumerate(ids):
        if not row:
            raise ValueError(f"prompt {i} ({prompts[i]!r}) tokenizes to no tokens; the first response token needs "
                             "a prompt token to condition on")
    P = max(len(r) for r in ids)
    # Padded as Python lists, then one tensor each (not two tensor writes per row).
    prompt_ids = torch.tensor([[pad_id] * (P - len(row)) + row for row in ids], dtype=torch.long)
    prompt_mask = torch.tensor([[0] * (P - len(row)) + [1] * len(row) for row in ids], dtype=torch.long)
    return prompt_ids.to(device), prompt_mask.to(device)


def last_token_index(response_mask: Tensor) -> Tensor:
    """``[B]``: the column of each row's last real response token (its EOS when it has one); -1 for an empty row."""
    return response_mask.long().sum(-1) - 1


def place_scores(scores: Tensor, response_mask: Tensor) -> Tensor:
    """``[B, R]`` zeros with ``scores[b]`` on row ``b``'s last real token; an empty row gets nothing."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    last = last_token_index(response_mask)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = scores.to(out.device, torch.float32)[rows]
    return out


@dataclass
class Sampled:
    """What ``sample`` returns: the batch plus the text the reward saw."""

    batch: TokenBatch
    prompts: list[str]
    completions: list[str]
    has_eos: Tensor  # [B] bool
    raw_scores: Tensor  # [B] the reward before the missing-EOS penalty
    reward_terms: dict[str, Tensor] = field(default_factory=dict)  # name -> [B]: each term of a weighted reward


@torch.no_grad()
def sample(policy: nn.Module, tokenizer: Any, generator: Generator, prompts: list[str], settings: SamplingSettings,
           reward: Callable | None, device: torch.device, ref_logprobs: Callable | None = None,
           value_fn: Callable | None = None, missing_eos_penalty: float | None = None,
           storage: torch.device | None = None, micro_batch_size: int | None = None) -> Sampled:
    """One rollout of ``prompts`` (already repeated G times for groups); steps 1-5 of the module docstring.

    ``ref_logprobs(input_ids, attention_mask, R) -> [B, R]`` and ``value_fn(...) -> [B, R]`` are optional;
    ``storage`` is where the batch's tensors are kept (the CPU with ``offload_rollout``; default ``device``);
    ``micro_batch_size``: rows per pi_old forward (``LMConfig.micro_batch_size``; the callbacks chunk their own).
    """
    # 1. Left-padded prompts.
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, settings.pad_token_id, device)
    # 2. Sample.
    response_ids = generator.generate(policy, prompt_ids, prompt_mask, settings).to(device)
    # 3. Mask through the first stop token; what follows becomes padding.
    stops = torch.tensor(settings.stop_token_ids, dtype=torch.long, device=device)
    mask = response_mask(response_ids, stops)
    has_eos = torch.isin(response_ids, stops).any(-1)
    response_ids = torch.where(mask, response_ids, settings.pad_token_id)
    input_ids = torch.cat([prompt_ids, response_ids], 1)
    attention_mask = torch.cat([prompt_mask, mask.long()], 1)
    R = response_ids.shape[1]
    # 4. pi_old, pi_ref, values: one forward each (over micro-batches of rows).
    logp_old = in_micro_batches(lambda i, a: token_logprobs(policy, i, a, R, settings.temperature)[0],
                                micro_batch_size, input_ids, attention_mask)
    logp_ref = None if ref_logprobs is None else ref_logprobs(input_ids, attention_mask, R)
    values = None if value_fn is None else value_fn(input_ids, attention_mask, R)
    # 5. Scores from the decoded text (EOS excluded from the text and the ids the reward sees).
    lengths = mask.long().sum(-1) - has_eos.long()
    completion_ids = [row[:n] for row, n in zip(response_ids.tolist(), lengths.tolist())]  # one host read
    completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    raw = torch.zeros(len(prompts))
    info: dict[str, Any] = {}
    if reward is not None:
        # The prompts' dataset columns (data.Prompt.extra), one list each aligned with the completions (TRL's).
        info = {**extra_columns(prompts), "completion_ids": completion_ids, "eos": has_eos.tolist(), "input_ids": input_ids,
                "attention_mask": attention_mask}
        raw = reward(list(prompts), completions, info)
    scores = raw.clone()
    if missing_eos_penalty is not None:
        scores = scores - missing_eos_penalty * (~has_eos).float().cpu()
    batch = TokenBatch(input_ids, attention_mask, mask, logp_old.float(), scores.to(device), logp_ref=logp_ref,
                       values=values)
    if storage is not None:
        batch = batch.to(storage)
    terms = dict(getattr(reward, "last_terms", None) or {})
    return Sampled(batch, list(prompts), completions, has_eos.cpu(), raw, terms)
