"""Sampling completions: a small ``Generator`` interface and its Hugging Face ``generate`` backend.

The backends: ``sampling.CachedSampler`` (ppokit's own decoding loop over the model's KV cache; the default,
``LMConfig.sampler="cached"``) and ``HFGenerator`` here (``model.generate``, ``sampler="hf"``). Both sample the same
distribution; for one seed they draw different samples.

The learner only needs response token ids; it recomputes every log-probability itself (``logprobs``), so a
backend is free to sample any way it likes as long as it samples the *plain tempered distribution*
``softmax(logits / temperature)``. Anything else (top-k, top-p, a repetition penalty, a minimum length) samples
from a distribution other than the one the ratio's denominator pi_old is computed from, which is TRL's negative-KL
bug (trl#235, trl#925). A third backend, ``vllm_generator.VLLMGenerator`` (``sampler="vllm"``), implements the same
interface; ``backends.make_generator`` builds the one a config names.
"""

from __future__ import annotations

import warnings
from typing import Protocol

import torch
from torch import Tensor, nn

__all__ = ["Generator", "HFGenerator", "SamplingSettings", "stop_token_ids", "warn_ignored_generation_config"]

# Settings of a model's generation config that change the sampling distribution, with their neutral values.
_NEUTRAL = {"top_k": (0, None), "top_p": (1.0, None), "typical_p": (1.0, None), "min_p": (None, 0.0),
            "repetition_penalty": (1.0, None), "no_repeat_ngram_size": (0, None), "min_length": (0, None),
            "min_new_tokens": (0, None), "bad_words_ids": (None,), "suppress_tokens": (None,),
            "begin_suppress_tokens": (None,), "forced_bos_token_id": (None,), "forced_eos_token_id": (None,),
            "epsilon_cutoff": (0.0, None), "eta_cutoff": (0.0, None), "encoder_repetition_penalty": (1.0, None),
            "num_beams": (1, None), "sequence_bias": (None,)}


class SamplingSettings:
    """What every backend must honour: pure sampling at ``temperature``, at most ``max_new_tokens`` tokens,
    stopping a row at the first of ``stop_token_ids`` (``eos_token_id`` and any others, ``stop_token_ids``);
    finished rows are filled with ``pad_token_id``."""

    def __init__(self, max_new_tokens: int, temperature: float, eos_token_id: int, pad_token_id: int,
                 stop_token_ids: tuple[int, ...] = ()):
        self.max_new_tokens = int(max_new_tokens)
        self.temperature = float(temperature)
        self.eos_token_id = int(eos_token_id)
        self.pad_token_id = int(pad_token_id)
        self.stop_token_ids = tuple(dict.fromkeys([self.eos_token_id, *(int(t) for t in stop_token_ids)]))


def stop_token_ids(tokenizer, model: nn.Module) -> tuple[int, ...]:
    """The ids that end a completion: the tokenizer's EOS, then every id of the model's
    ``generation_config.eos_token_id`` (an int or a list: instruct models such as Llama-3-Instruct and
    Qwen2.5-Instruct list their end-of-turn tokens there beside the EOS), in that order, without repeats."""
    ids = [int(tokenizer.eos_token_id)]
    own = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for t in (own if isinstance(own, (list, tuple)) else [own]):
        if t is not None:
            ids.append(int(t))
    return tuple(dict.fromkeys(ids))


class Generator(Protocol):
    """Samples completions of left-padded prompts.

    ``generate(model, prompt_ids [B, P], prompt_mask [B, P], settings) -> response_ids [B, R]`` with
    ``R <= settings.max_new_tokens``; row ``b`` holds the sampled tokens up to and including its first EOS, then
    anything (the rollout masks everything after the first EOS itself). Sampling draws from torch's global RNG.
    """

    def generate(self, model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor,
                 settings: SamplingSettings) -> Tensor: ...


class HFGenerator:
    """``Generator`` over ``transformers``' ``model.generate`` with ``do_sample=True, top_k=0, top_p=1.0``.

    A model's own ``generation_config`` is merged into ``generate``'s arguments by transformers (measured with
    transformers 5.24: a ``repetition_penalty`` there still applies when the call passes ``top_k=0`` and
    ``top_p=1``), so the model's config is swapped for a clean one for the duration of the call, and a warning says
    once which of its settings were overridden.
    """

    def __init__(self):
        self._warned: set[int] = set()

    def generate(self, model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor,
                 settings: SamplingSettings) -> Tensor:
        from transformers import GenerationConfig

        clean = GenerationConfig(do_sample=True, top_k=0, top_p=1.0, temperature=settings.temperature,
                                 max_new_tokens=settings.max_new_tokens, eos_token_id=list(settings.stop_token_ids),
                                 pad_token_id=settings.pad_token_id, num_beams=1, use_cache=True)
        own = getattr(model, "generation_config", None)
        warn_ignored_generation_config(model, settings, self._warned)
        try:
            if own is not None:
                model.generation_config = clean
            with torch.no_grad():
                sequences = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=clean)
        finally:
            if own is not None:
                model.generation_config = own
        return sequences[:, prompt_ids.shape[1]:]


def warn_ignored_generation_config(model: nn.Module, settings: SamplingSettings, warned: set[int]) -> None:
    """Warn once per model (``warned`` holds the ids already warned about) when its ``generation_config`` asks for
    anything but pure sampling at ``settings.temperature``: every backend ignores it during training."""
    own = getattr(model, "generation_config", None)
    if own is None or id(model) in warned:
        return
    warned.add(id(model))
    differs = [f"{name}={getattr(own, name)!r}" for name, neutral in _NEUTRAL.items()
               if getattr(own, name, None) not in neutral]
    temperature = getattr(own, "temperature", None)
    if temperature not in (None, 1.0) and temperature != settings.temperature:
        differs.append(f"temperature={temperature!r}")
    if differs:
        warnings.warn(f"the model's generation_config sets {', '.join(differs)}; ppokit samples with "
                      f"do_sample=True, top_k=0, top_p=1.0, temperature={settings.temperature} and nothing "
                      "else (the log-probs of pi_old must be those of the distribution that sampled), so "
                      "these settings are ignored during training", UserWarning, stacklevel=3)
