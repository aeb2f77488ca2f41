"""What an LM run's inputs must satisfy before any work: a tokenizer with a vocabulary, prompts (and DPO pairs) that
fit the model's context with the generation budget, and a batch that fits in memory.

Each check raises ``ConfigError`` naming the config field (``max_new_tokens``, ``batch_prompts``...) or
``ValueError`` naming the input (``prompts[3]``, ``pairs[0]``, ``tokenizer``), with the limit it broke. The
trainers call them in their constructor, before pi_ref or the value model is copied from the policy.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from ppokit.config.ppo_config import ConfigError
from ppokit.config.resources import available_memory

__all__ = ["PromptError", "warn_half_precision", "context_limit", "check_tokenizer", "prompt_lengths", "check_context", "check_pairs_context",
           "estimate_lm_memory", "check_lm_memory"]

# The config attributes in which Hugging Face models state their longest sequence, in the order looked up.
_CONTEXT_ATTRS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length")
_TOKENIZE_CHUNK = 1024  # prompts tokenized per call when measuring them (a list of any length, bounded memory)


class PromptError(ValueError):
    """A prompt (or DPO pair) the model cannot take: no tokens, or longer than its context."""


def context_limit(model: Any) -> tuple[int | None, str]:
    """``(positions, attribute)``: the longest sequence the model's config allows; ``(None, "")`` if it says none."""
    config = getattr(model, "config", None)
    for attr in _CONTEXT_ATTRS:
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, attr
    return None, ""


def check_tokenizer(tokenizer: Any) -> None:
    """Refuse a tokenizer that encodes text to nothing: what ``AutoTokenizer`` builds from a model directory that
    has a config but no tokenizer files (an empty vocabulary)."""
    try:
        size = len(tokenizer)
    except TypeError:
        return  # not a sized tokenizer (a test's stand-in): the prompt check below still sees empty encodings
    if size <= 1 or getattr(tokenizer, "vocab_size", 1) == 0:
        raise ValueError(f"tokenizer: its vocabulary is empty ({size} token(s)), so every text encodes to no tokens; "
                         "it was built without tokenizer files (tokenizer.json, vocab.json...): load it from a "
                         "directory that has them (tokenizer.save_pretrained(DIR))")


def prompt_lengths(tokenizer: Any, prompts: Sequence[str], add_special_tokens: bool = True) -> list[int]:
    """Token counts of ``prompts`` as the rollout encodes them (``rollout.encode_prompts``)."""
    out: list[int] = []
    for i in range(0, len(prompts), _TOKENIZE_CHUNK):
        ids = tokenizer(list(prompts[i:i + _TOKENIZE_CHUNK]), add_special_tokens=add_special_tokens)["input_ids"]
        out += [len(row) for row in ids]
    return out


def check_context(tokenizer: Any, model: Any, prompts: Sequence[str], max_new_tokens: int,
                  where: str = "prompts") -> int:
    """Every prompt has a token and, with ``max_new_tokens`` more, fits the model's positions; the longest
    prompt's token count. Past the positions an embedding lookup fails mid-run (``index out of range in self``)."""
    limit, attr = context_limit(model)
    if limit is not None and max_new_tokens >= limit:
        raise ConfigError("max_new_tokens", f"{max_new_tokens:,} new tokens after a prompt of at least one token "
                          f"exceed the model's context of {limit:,} positions (config.{attr}); use at most "
                          f"{limit - 1:,}")
    lengths = prompt_lengths(tokenizer, prompts)
    for i, n in enumerate(lengths):
        if n == 0:
            raise PromptError(f"{where}[{i}] ({_short(prompts[i])}) tokenizes to no tokens; the first response token "
                             "needs a prompt token to condition on")
    longest = max(lengths, default=1)
    if limit is not None and longest + max_new_tokens > limit:
        i = lengths.index(longest)
        if longest >= limit:
            raise PromptError(f"{where}[{i}] is {longest:,} tokens; the model's context is {limit:,} positions "
                              f"(config.{attr}), so with max_new_tokens {max_new_tokens:,} a prompt can have at most "
                              f"{limit - max_new_tokens:,}; shorten it")
        raise ConfigError("max_new_tokens", f"the longest prompt ({where}[{i}], {longest:,} tokens) plus "
                          f"{max_new_tokens:,} new tokens exceeds the model's context of {limit:,} positions "
                          f"(config.{attr}); use at most {limit - longest:,} or shorten the prompt")
    return longest


def check_pairs_context(tokenizer: Any, model: Any, pairs: Sequence[tuple[str, str, str]]) -> tuple[int, int]:
    """DPO: every prompt has a token and prompt + response + EOS fits the model's positions; the longest prompt's
    and response's token counts."""
    limit, attr = context_limit(model)
    prompt_n = prompt_lengths(tokenizer, [p for p, _, _ in pairs])
    chosen_n = prompt_lengths(tokenizer, [c for _, c, _ in pairs], add_special_tokens=False)
    rejected_n = prompt_lengths(tokenizer, [r for _, _, r in pairs], add_special_tokens=False)
    for i, (p, c, r) in enumerate(zip(prompt_n, chosen_n, rejected_n)):
        if p == 0:
            raise PromptError(f"pairs[{i}]: the prompt ({_short(pairs[i][0])}) tokenizes to no tokens")
        total = p + max(c, r) + 1
        if limit is not None and total > limit:
            raise PromptError(f"pairs[{i}]: prompt + response + EOS is {total:,} tokens, more than the model's "
                             f"context of {limit:,} positions (config.{attr}); shorten it")
    return max(prompt_n), max(chosen_n + rejected_n) + 1


def _short(text: str) -> str:
    return repr(text) if len(text) <= 40 else repr(text[:37]) + "..."


def _model_sizes(model: Any) -> tuple[int, int, int, int, int, int]:
    """``(parameters, trainable, bytes per value, layers, hidden, vocab)`` of a Hugging Face causal LM."""
    params = list(model.parameters())
    n = sum(p.numel() for p in {id(p): p for p in params}.values())
    trainable = sum(p.numel() for p in {id(p): p for p in params if p.requires_grad}.values())
    itemsize = params[0].element_size() if params else 4
    config = getattr(model, "config", None)

    def attr(*names: str, default: int) -> int:
        for name in names:
            value = getattr(config, name, None)
            if isinstance(value, int) and value > 0:
                return value
        return default

    return (n, trainable, itemsize, attr("num_hidden_layers", "n_layer", default=1),
            attr("hidden_size", "n_embd", "d_model", default=1), attr("vocab_size", default=1))


def estimate_lm_memory(config: Any, model: Any, rows: int, prompt_len: int, response_len: int, *,
                       extra_models: int, value_model: bool, update_rows: int | None = None,
                       shards: int = 1) -> dict[str, int]:
    """Bytes a run needs beyond the models already loaded, roughly and on the low side (so a run that fits is
    never refused): ``models`` (the copies the trainer makes and AdamW's two moments and the gradient of every
    trainable weight), ``rollout`` (sampling ``rows`` sequences: the KV cache and the log-prob forwards' float32
    logits over the response) and ``update`` (one minibatch's forward and backward: the logits and ~16 hidden-size
    activations per token and layer, the standard transformer count without the attention scores).
    ``update_rows`` is how many sequences one backward pass holds: by default a minibatch of the rollout
    (``rows / num_minibatches``) or its micro-batch (``micro_batch_size``); the trainers without epochs (DPO, SFT,
    RM) give theirs (a micro-batch of pairs is two sequences each). ``shards``: the ranks an fsdp run shards the
    models over (``lm.fsdp``): each holds ``1/shards`` of the copies, gradients and moments, and none of them on the
    device with ``fsdp_offload`` (in host memory).

    Measured on the 10M-parameter tiny GPT-2 (GRPO, 8 x 8 completions of 32 tokens, 2 minibatches, CPU): 362 MiB
    estimated, 427 MiB of peak RSS growth over two iterations."""
    n, trainable, itemsize, layers, hidden, vocab = _model_sizes(model)
    L, R = prompt_len + response_len, response_len
    critic = 2 if value_model else 1  # PPO's critic is a copy of the trunk, trained too
    models = extra_models * n * itemsize + critic * trainable * (2 * 4 + itemsize)
    if shards > 1:
        models = 0 if getattr(config, "fsdp_offload", False) else models // shards
    # The no-gradient forwards (pi_old, pi_ref, values) hold one micro-batch's logits at a time.
    micro = getattr(config, "micro_batch_size", None) or rows
    rollout = rows * 2 * layers * L * hidden * itemsize + min(rows, micro) * R * vocab * 4 + rows * L * 4 * 16
    mb = math.ceil(rows / max(1, config.num_minibatches)) if update_rows is None else update_rows
    if update_rows is None:  # an update step backpropagates one micro-batch at a time
        mb = min(mb, micro)
    act_layers = 1 if config.gradient_checkpointing else layers
    update = critic * mb * L * (act_layers * 16 * hidden * 4) + mb * R * vocab * 4 * 2
    return {"models": models, "rollout": rollout, "update": update}


def check_lm_memory(config: Any, model: Any, rows: int, prompt_len: int, response_len: int, *, extra_models: int,
                    value_model: bool, rows_text: str, update_rows: int | None = None, shards: int = 1) -> None:
    """``ConfigError`` naming the batch field when ``estimate_lm_memory`` exceeds the memory available now."""
    parts = estimate_lm_memory(config, model, rows, prompt_len, response_len, extra_models=extra_models,
                               value_model=value_model, update_rows=update_rows, shards=shards)
    need, have = sum(parts.values()), available_memory(config.device)
    if have is None or need <= have:
        return
    gib = {k: v / 2**30 for k, v in parts.items()}
    raise ConfigError("batch_prompts", f"{rows:,} sequences of up to {prompt_len + response_len:,} tokens per "
                      f"iteration ({rows_text}) need about "
                      f"{need / 2**30:,.1f} GiB (sampling {gib['rollout']:,.1f}, one update minibatch "
                      f"{gib['update']:,.1f}, model copies and optimizer {gib['models']:,.1f}), more than the "
                      f"{have / 2**30:,.1f} GiB available on {config.device}; lower them"
                      + (" (or raise num_minibatches, or set micro_batch_size)" if update_rows is None
                         else " (or set micro_batch_size)"))


def warn_half_precision(parameters: Sequence[Any]) -> str | None:
    """Warn (once, and return the message) when trainable parameters are bfloat16 or float16: AdamW then updates
    in half precision, where a step below the weight's rounding unit is lost (measured on a bf16 model at lr 1e-6:
    1.4% of the weights changed in 8 steps, against 75% in float32). None when every one is float32 or wider."""
    import warnings

    import torch

    half = sorted({str(p.dtype).removeprefix("torch.") for p in parameters
                   if p.dtype in (torch.bfloat16, torch.float16)})
    if not half:
        return None
    message = (f"trainable parameters are {', '.join(half)}: the optimizer updates them in half precision, where "
               "small steps round away and training stalls; set dtype bf16 (--dtype bf16: autocast over float32 master "
               "weights) or load the model in float32 (from_pretrained(..., dtype=torch.float32))")
    warnings.warn(message, UserWarning, stacklevel=3)
    return message
