"""Rewards for completions: a plain function, a weighted list of them, or an ``nn.Module`` reward model.

A reward model is not required where a function will do (trl#2451, trl#2363). Every kind becomes one
``RewardFn``: ``reward(prompts, completions, info) -> Tensor [B]`` float32, checked: one finite number per
completion (a list/tuple of numbers or a 1-D tensor/array), or a ``RewardError`` naming the function and what it
returned; an exception the function raises becomes a ``RewardError`` naming it too.

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


def _module(module: nn.Module) -> RewardFn:
    who = f"model {type(module).__qualname__}"

    def reward(prompts: list[str], completions: list[str], info: dict[str, Any]) -> Tensor:
        with torch.no_grad():
            out = _call(module, who, input_ids=info["input_ids"], attention_mask=info["attention_mask"])
        logits = out.logits if hasattr(out, "logits") else out
        if not isinstance(logits, Tensor) or logits.dim() not in (1, 2) or (logits.dim() == 2 and logits.shape[1] != 1):
            shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise RewardError(f"reward {who} must return [B] or [B, 1] scores, got {shape}")
        return _as_scores(logits.reshape(-1), len(completions), who)

    return reward


REWARD_PARTS = "reward_parts"  # the info entry where a weighted list leaves each function's scores


def _short_name(fn: Any, i: int) -> str:
    """A column name for a reward function: its ``__name__`` (a model's class name), ``reward_<i>`` otherwise."""
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return f"reward_{i}" if name == "<lambda>" else str(name)


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
            name = _short_name(fn, i)
            parts.append((make_reward(fn), float(weight), name if name not in {p[2] for p in parts} else
                          f"{name}_{i}"))

        def weighted(prompts: list[str], completions: list[str], info: dict[str, Any]) -> Tensor:
            total, own = torch.zeros(len(completions)), {}
            for fn, weight, name in parts:
                own[name] = scores = fn(prompts, completions, info)
                total = total + weight * scores
            # Each function's own scores, for completions.jsonl's per-function fields (rollout.Sampled); set after
            # the calls, so no reward function is passed them.
            info[REWARD_PARTS] = own
            return total

        return weighted
    raise ValueError(f"reward must be a callable reward_fn(prompts, completions, **info), a list of them (or of "
                     f"(fn, weight) pairs) or an nn.Module reward model, got {type(reward).__name__}")
