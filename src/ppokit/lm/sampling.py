"""``CachedSampler``: ppokit's own decoding loop over a causal LM's KV cache, the default ``Generator`` backend.

Why not ``model.generate``: for the small models RL on a CPU is run with, a decoding step is dominated by
``generate``'s per-step machinery (logits processors, stopping criteria, cache and output bookkeeping), not by the
model (measured on the demo's 2x64 GPT-2, 64 rows x 16 tokens, one thread: ``generate`` ~22 ms, this loop through
the model's ``forward`` ~18 ms, and ~12 ms through ``fast_gpt2``'s lean step, which it takes for a plain GPT-2; the
rest is the model's arithmetic). The loop does only what pure sampling needs:

1. prefill: one forward over the left-padded prompts with ``position_ids = cumsum(mask) - 1`` (the positions the
   learner recomputes the log-probs with, ``logprobs.position_ids``), keeping only the last position's logits;
2. each step: sample the next token of every row from ``softmax(logits / temperature)`` with ``torch.multinomial``
   (the full tempered distribution: no top-k, top-p or penalty, so the log-probs the ratio uses are those of the
   distribution that sampled; trl#235, trl#925), write it into a preallocated ``[B, max_new_tokens]`` block,
   mark the rows that emitted a stop token (``SamplingSettings.stop_token_ids``), and feed the tokens back with the next position of each row (its real-token
   count, so left padding shifts nothing) and the model's cache (or ``fast_gpt2``'s preallocated one);
3. stop as soon as every row has emitted a stop token (or at ``max_new_tokens``); a finished row gets ``pad_token_id``
   after its EOS, exactly as ``generate`` fills it, so the rollout's response masks are the same.

Randomness: ``torch.multinomial`` draws from torch's global generator, which the trainers seed and checkpoint
(``LMTrainer._rng``): one seed gives one run. For one seed this loop draws other samples than ``generate`` does (it
consumes the generator differently), from the same distribution (``tests/test_lm_sampling.py`` checks the sampled
tokens' log-probs against a recomputation, and first- and two-token frequencies against the model's probabilities).
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

from ppokit.lm.fast_gpt2 import gpt2_decoder
from ppokit.lm.generation import SamplingSettings, warn_ignored_generation_config
from ppokit.lm.logprobs import position_ids

__all__ = ["CachedSampler"]


def _cache_kwarg(model: nn.Module) -> str:
    """The name under which the model's forward takes its KV cache: ``cache`` (transformers >= 5.x renamed it)
    or ``past_key_values``. A PEFT wrapper passes keyword arguments through to its base model."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        params = inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - a forward without a readable signature
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def _returned_cache(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


class CachedSampler:
    """A ``Generator``: pure tempered sampling with the model's KV cache (module docstring).

    ``generate`` returns the response ids ``[B, R]``, ``R <= max_new_tokens`` (``R`` is the step at which the last
    row emitted a stop token); ``sample`` also returns the log-probabilities ``[B, R]`` of the sampled tokens under the
    distribution that drew them (0 after a row's EOS), for checking a backend against the learner's recomputation.
    """

    def __init__(self, fast: bool = True):
        self._warned: set[int] = set()
        self.fast = fast  # the lean GPT-2 step (``fast_gpt2``) where it applies; False: always the model's forward

    def generate(self, model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor,
                 settings: SamplingSettings) -> Tensor:
        return self._decode(model, prompt_ids, prompt_mask, settings, with_logprobs=False)[0]

    def sample(self, model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor,
               settings: SamplingSettings) -> tuple[Tensor, Tensor]:
        return self._decode(model, prompt_ids, prompt_mask, settings, with_logprobs=True)

    @staticmethod
    def _generic(model: nn.Module, prompt_ids: Tensor, attention: Tensor, first_positions: Tensor,
                 next_position: Tensor, P: int):
        """Prefill and steps through the model's own ``forward`` and its KV cache: ``(logits [B, V], advance)``."""
        cache_kw = _cache_kwarg(model)
        state = {"cache": None}

        def forward(inputs: Tensor, positions: Tensor, width: int) -> Tensor:
            kwargs = {"input_ids": inputs, "attention_mask": attention[:, :width], "position_ids": positions,
                      "use_cache": True}
            if state["cache"] is not None:
                kwargs[cache_kw] = state["cache"]
            try:
                result = model(**kwargs, logits_to_keep=1)
            except TypeError:  # a model without logits_to_keep
                result = model(**kwargs)
            state["cache"] = _returned_cache(result)
            return (result.logits if hasattr(result, "logits") else result[0])[:, -1]

        def advance(token: Tensor, t: int) -> Tensor:
            if state["cache"] is None:
                raise RuntimeError("CachedSampler: the model returned no KV cache for use_cache=True; sample with "
                                   "sampler='hf' instead")
            return forward(token[:, None], next_position + t, P + t + 1)

        return forward(prompt_ids, first_positions, P), advance

    @torch.no_grad()
    def _decode(self, model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, settings: SamplingSettings,
                with_logprobs: bool) -> tuple[Tensor, Tensor | None]:
        warn_ignored_generation_config(model, settings, self._warned)
        B, P = prompt_ids.shape
        device, N = prompt_ids.device, settings.max_new_tokens
        out = torch.full((B, N), settings.pad_token_id, dtype=torch.long, device=device)
        logp_out = torch.zeros((B, N), device=device) if with_logprobs else None
        if N == 0 or B == 0:
            return out, logp_out
        prompt_mask = prompt_mask.long()
        # Every row attends to its real prompt tokens and to all it generated (a finished row's pads are fed on
        # but never read: the rollout masks everything after the first EOS, as with ``generate``).
        attention = torch.cat([prompt_mask, torch.ones((B, N), dtype=torch.long, device=device)], 1)
        next_position = prompt_mask.sum(-1, keepdim=True)  # [B, 1]: the first response token's position
        done = torch.zeros(B, dtype=torch.bool, device=device)
        stops = torch.tensor(settings.stop_token_ids, dtype=torch.long, device=device)
        first_positions = position_ids(prompt_mask)
        fast = gpt2_decoder(model, prompt_ids, prompt_mask, first_positions, P + N) if self.fast else None
        if fast is not None:
            decoder, logits = fast

            def advance(token: Tensor, t: int) -> Tensor:
                visible = attention[:, None, None, :P + t + 1].bool()
                return decoder.step(token, next_position[:, 0] + t, visible)
        else:
            logits, advance = self._generic(model, prompt_ids, attention, first_positions, next_position, P)
        steps = 0
        for t in range(N):
            logits = logits.float()
            if settings.temperature != 1.0:
                logits = logits / settings.temperature
            probs = torch.softmax(logits, -1)
            token = torch.multinomial(probs, 1).squeeze(-1)  # [B]
            token = torch.where(done, settings.pad_token_id, token)
            out[:, t] = token
            if with_logprobs:
                logp = torch.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1)
                logp_out[:, t] = torch.where(done, 0.0, logp)
            done |= torch.isin(token, stops)
            steps = t + 1
            if steps == N or bool(done.all()):  # every row has ended (one host read per step, as generate's)
                break
            logits = advance(token, t)
        return out[:, :steps], (None if logp_out is None else logp_out[:, :steps])
