"""Rewards for completions: a plain function, a weighted list of them, or an ``nn.Module`` reward model.

A reward model is not required where a function will do (trl#2451, trl#2363). Every kind becomes one
``RewardFn``: ``reward(prompts, completions, info) -> Tensor [B]`` float32, checked: one finite number per
completion (a list/tuple of numbers or a 1-D tensor/array), or a ``RewardError`` naming the function and what it
returned; an exception the function raises becomes a ``RewardError`` naming it too.

* a callable ``fn(prompts, completions, **info) -> list[float]``; ``info`` holds ``completion_ids`` (token ids of
  each completion, EOS excluded) and ``eos`` (whether it ended with the EOS token). A function is passed only the
  ``info`` keys it names, unless it takes ``**kwargs``, so ``fn(prompts, completions)`` works too;
* a list of ``fn`` or ``(fn, weight)``: the weighted sum;
* a list of ``fn`` or ``(fn, weight)``: the weighted sum; the unweighted values of each term of the last call are
  in ``reward.last_terms`` (name -> ``[B]``), which the trainers log as ``lm/reward/<name>`` (``schema.reward_term``);
* a reward model (``reward_models.RewardModel``): an ``AutoModelForSequenceClassification`` with one label as a
  ``(model, tokenizer)`` pair, or alone (its tokenizer then read from the directory it was loaded from, else the
  policy's): prompt + completion re-tokenized with its tokenizer and scored right-padded (batch-invariant).
"""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

__all__ = ["RewardFn", "RewardError", "make_reward"]

RewardFn = Callable[[list[str], list[str], dict[str, Any]], Tensor]


class RewardError(ValueError):
    """A reward function raised, or returned something that is not one finite number per completion; the message
    names the function (its qualified name) and what it returned or raised."""


def _name(fn: Any) -> str:
    qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None)
    return f"{module}.{qual}" if module and module != "builtins" else qual


def _describe(values: Any) -> str:
    """What a reward returned, for the message: its type and length (a tensor's or array's shape)."""
    kind = type(values).__name__
    shape = getattr(values, "shape", None)
    if shape is not None and not isinstance(values, (list, tuple)):
        return f"{kind} of shape {tuple(shape)}"
    try:
        return f"{kind} of length {len(values)}"
    except TypeError:
        return kind


def _number(v: Any) -> float | None:
    """``v`` as a float when it is one real number (a Python/numpy number or a one-element tensor), else None.
    A bool is not a reward (``True`` for 1.0 is more often a bug than a score, as for config numbers)."""
    if isinstance(v, Tensor):
        if v.numel() != 1 or v.dim() > 1 or v.dtype == torch.bool or v.is_complex():
            return None
        return float(v)
    if isinstance(v, (bool, str, bytes)) or not isinstance(v, numbers.Real) or type(v).__name__ == "bool_":
        return None
    return float(v)


def _as_scores(values: Any, n: int, who: str) -> Tensor:
    """``[n]`` float32 from a list/tuple of numbers or a 1-D tensor/array of ``n`` of them; RewardError otherwise.

    Only those: a dict would iterate over its keys and a string over its characters ("1111" -> four 1.0s), each
    a wrong reward that trains silently."""
    want = f"must return a list or 1-D array of {n} finite numbers (one per completion), got {_describe(values)}"
    if isinstance(values, Tensor) or type(values).__name__ == "ndarray":
        # A numeric 1-D tensor/array: float, int (a bool or complex one is not a score).
        kind = str(values.dtype).rsplit(".", 1)[-1]
        if values.ndim != 1 or kind == "bool" or "complex" in kind or not _numeric_dtype(values):
            raise RewardError(f"reward {who} {want}")
        scores = [float(v) for v in values.tolist()]
    elif isinstance(values, (list, tuple)):
        scores = []
        for i, v in enumerate(values):
            x = _number(v)
            if x is None:
                raise RewardError(f"reward {who} {want}, whose element {i} is {_describe(v)} {_short(v)}")
            scores.append(x)
    else:
        raise RewardError(f"reward {who} {want}")
    if len(scores) != n:
        raise RewardError(f"reward {who} returned {len(scores)} values for {n} completions ({_describe(values)}); "
                          "it must return one per completion")
    bad = [i for i, v in enumerate(scores) if not math.isfinite(v)]
    if bad:
        raise RewardError(f"reward {who} returned a non-finite value ({scores[bad[0]]!r}) for completion {bad[0]} "
                          f"of {n}")
    return torch.tensor(scores, dtype=torch.float32)


def _numeric_dtype(values: Any) -> bool:
    if isinstance(values, Tensor):
        return values.dtype.is_floating_point or not (values.dtype.is_complex or values.dtype == torch.bool)
    return values.dtype.kind in "iuf"  # numpy: signed, unsigned, float


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _call(fn: Callable, who: str, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``; an exception it raises becomes one RewardError line naming it."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the user's function: anything it raises ends the run, named
        from ppokit.runtime.checkpoint import one_line

        raise RewardError(f"reward {who} raised {one_line(exc)}") from exc


def _callable(fn: Callable) -> RewardFn:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        params = []
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params)
    named = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    who = _name(fn)

    def reward(prompts: list[str], completions: list[str], info: dict[str, Any]) -> Tensor:
        extra = info if takes_all else {k: v for k, v in info.items() if k in named}
        return _as_scores(_call(fn, who, prompts, completions, **extra), len(completions), who)

    return reward


def _reward_model(rm: Any, micro_batch_size: int | None = None) -> RewardFn:
    """A ``RewardModel`` as a reward function, scoring ``micro_batch_size`` completions per forward (all at once
    when None): its batch invariance makes the chunked scores the one call's."""
    who = f"model {rm.name}"

    def reward(prompts: list[str], completions: list[str], info: dict[str, Any]) -> Tensor:
        step = micro_batch_size or max(1, len(completions))
        if len(completions) <= step:
            return _as_scores(_call(rm, who, prompts, completions), len(completions), who)
        return torch.cat([_as_scores(_call(rm, who, prompts[i:i + step], completions[i:i + step]),
                                     len(completions[i:i + step]), who) for i in range(0, len(completions), step)])

    reward.name = rm.name
    return reward


def _own_tokenizer(module: nn.Module, fallback: Any) -> Any:
    """The tokenizer saved beside a model loaded from a local directory (``name_or_path``), else ``fallback``."""
    from pathlib import Path

    path = getattr(module, "name_or_path", None) or getattr(getattr(module, "config", None), "_name_or_path", None)
    if path and Path(str(path)).is_dir() and any((Path(str(path)) / n).is_file()
                                                  for n in ("tokenizer.json", "tokenizer_config.json", "vocab.json",
                                                            "tokenizer.model")):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return fallback


def _is_pair(reward: Any) -> bool:
    return (isinstance(reward, tuple) and len(reward) == 2 and isinstance(reward[0], nn.Module)
            and not isinstance(reward[1], (int, float)))


def _term_name(fn: Any, i: int, taken: set[str]) -> str:
    """A metric-safe name for a reward term: its function's or model's name, made unique."""
    raw = getattr(fn, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__
    base = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in str(raw)) or f"term{i}"
    name, k = base, 2
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    taken.add(name)
    return name


def make_reward(reward: Any, tokenizer: Any = None, micro_batch_size: int | None = None) -> RewardFn:
    """One ``RewardFn`` from a callable, a reward model (an ``nn.Module``, a ``(model, tokenizer)`` pair or a
    ``RewardModel``) or a list of them / ``(item, weight)`` pairs. ``tokenizer``: the policy's, the last resort
    for a reward model given without one; ``micro_batch_size``: completions per reward-model forward."""
    from ppokit.lm.reward_models import RewardModel

    if isinstance(reward, RewardModel):
        return _reward_model(reward, micro_batch_size)
    if _is_pair(reward):
        return _reward_model(RewardModel(*reward), micro_batch_size)
    if isinstance(reward, nn.Module):
        own = _own_tokenizer(reward, tokenizer)
        if own is None:
            raise ValueError(f"reward model {type(reward).__name__}: has no tokenizer; pass reward=(model, tokenizer)")
        return _reward_model(RewardModel(reward, own), micro_batch_size)
    if callable(reward):
        return _callable(reward)
    if isinstance(reward, Sequence) and not isinstance(reward, (str, bytes)) and len(reward) > 0:
        parts: list[tuple[str, RewardFn, float]] = []
        taken: set[str] = set()
        for i, item in enumerate(reward):
            pair = isinstance(item, tuple) and len(item) == 2 and not _is_pair(item)
            fn, weight = (item if pair else (item, 1.0))
            if not (callable(fn) or isinstance(fn, (nn.Module, tuple))):
                raise ValueError(f"reward[{i}] must be a callable, an nn.Module or a (callable, weight) pair, "
                                 f"got {type(item).__name__}")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ValueError(f"reward[{i}]'s weight must be a finite number, got {weight!r}")
            made = make_reward(fn, tokenizer, micro_batch_size)
            parts.append((_term_name(made if hasattr(made, "name") else fn, i, taken), made, float(weight)))

        def weighted(prompts: list[str], completions: list[str], info: dict[str, Any]) -> Tensor:
            total = torch.zeros(len(completions))
            terms: dict[str, Tensor] = {}
            for name, fn, weight in parts:
                terms[name] = fn(prompts, completions, info)
                total = total + weight * terms[name]
            weighted.last_terms = terms
            return total

        weighted.last_terms = {}
        return weighted
    raise ValueError(f"reward must be a callable reward_fn(prompts, completions, **info), a list of them (or of "
                     f"(fn, weight) pairs) or an nn.Module reward model, got {type(reward).__name__}")
