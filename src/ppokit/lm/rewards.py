"""Rewards for completions: a plain function, a weighted list of them, or an ``nn.Module`` reward model.

A reward model is not required where a function will do (trl#2451, trl#2363). Every kind becomes one
``RewardFn``: ``reward(prompts, completions, info) -> Tensor [B]`` float32, checked: one finite number per
completion, or a ``ValueError`` naming the function and what it returned.

* a callable ``fn(prompts, completions, **info) -> list[float]``; ``info`` holds ``completion_ids`` (token ids of
  each completion, EOS excluded) and ``eos`` (whether it ended with the EOS token). A function is passed only the
  ``info`` keys it names, unless it takes ``**kwargs``, so ``fn(prompts, completions)`` works too;
* a list of ``fn`` or ``(fn, weight)``: the weighted sum;
* an ``nn.Module`` (e.g. an ``AutoModelForSequenceClassification`` with one label): called as
  ``module(input_ids=..., attention_mask=...)`` on the prompt + completion tokens (left-padded prompt, the
  completion through its EOS, the policy's tokenizer), under ``torch.no_grad``; its output (a tensor, or an
  object with ``.logits``) must be ``[B]`` or ``[B, 1]``.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

__all__ = ["RewardFn", "make_reward"]

RewardFn = Callable[[list[str], list[str], dict[str, Any]], Tensor]


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _as_scores(values: Any, n: int, who: str) -> Tensor:
    if isinstance(values, Tensor):
        values = values.detach().float().cpu().reshape(-1).tolist()
    try:
        scores = [float(v) for v in values]
    except (TypeError, ValueError):
        raise ValueError(f"reward {who} must return a list of {n} numbers, got {type(values).__name__}") from None
    if len(scores) != n:
        raise ValueError(f"reward {who} returned {len(scores)} values for {n} completions")
    bad = [i for i, v in enumerate(scores) if not math.isfinite(v)]
    if bad:
        raise ValueError(f"reward {who} returned a non-finite value ({scores[bad[0]]!r}) for completion {bad[0]}")
    return torch.tensor(scores, dtype=torch.float32)


def _callable(fn: Callable) -> RewardFn:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        params = []
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params)
    named = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}

    def reward(prompts: list[str], completions: list[str], info: dict[str, Any]) -> Tensor:
        extra = info if takes_all else {k: v for k, v in info.items() if k in named}
        return _as_scores(fn(prompts, completions, **extra), len(completions), _name(fn))

    return reward


def _module(module: nn.Module) -> RewardFn:
    def reward(prompts: list[str], completions: list[str], info: dict[str, Any]) -> Tensor:
        with torch.no_grad():
            out = module(input_ids=info["input_ids"], attention_mask=info["attention_mask"])
        logits = out.logits if hasattr(out, "logits") else out
        if not isinstance(logits, Tensor) or logits.dim() not in (1, 2) or (logits.dim() == 2 and logits.shape[1] != 1):
            shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise ValueError(f"reward model {type(module).__name__} must return [B] or [B, 1] scores, got {shape}")
        return _as_scores(logits, len(completions), f"model {type(module).__name__}")

    return reward


def make_reward(reward: Any) -> RewardFn:
    """One ``RewardFn`` from a callable, an ``nn.Module`` or a list of callables / ``(callable, weight)`` pairs."""
    if isinstance(reward, nn.Module):
        return _module(reward)
    if callable(reward):
        return _callable(reward)
    if isinstance(reward, Sequence) and not isinstance(reward, (str, bytes)) and len(reward) > 0:
        parts: list[tuple[RewardFn, float]] = []
        for i, item in enumerate(reward):
            fn, weight = (item if isinstance(item, tuple) and len(item) == 2 else (item, 1.0))
            if not (callable(fn) or isinstance(fn, nn.Module)):
                raise ValueError(f"reward[{i}] must be a callable, an nn.Module or a (callable, weight) pair, "
                                 f"got {type(item).__name__}")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ValueError(f"reward[{i}]'s weight must be a finite number, got {weight!r}")
            parts.append((make_reward(fn), float(weight)))

        def weighted(prompts: list[str], completions: list[str], info: dict[str, Any]) -> Tensor:
            total = torch.zeros(len(completions))
            for fn, weight in parts:
                total = total + weight * fn(prompts, completions, info)
            return total

        return weighted
    raise ValueError(f"reward must be a callable reward_fn(prompts, completions, **info), a list of them (or of "
                     f"(fn, weight) pairs) or an nn.Module reward model, got {type(reward).__name__}")
