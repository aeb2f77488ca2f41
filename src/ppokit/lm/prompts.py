"""Prompts from a list, an iterable or a file, served batch by batch in a seeded, resumable order.

``load_prompts(path)``: a ``.jsonl`` file (one JSON string, or an object with a ``"prompt"`` key, per line) or a
text file (one prompt per non-empty line). Reading a file never runs code.

``PromptSource`` also takes a ``datasets.Dataset``, a ``save_to_disk`` directory and rows in TRL's conventions
(``data``: conversational prompts through the tokenizer's chat template, extra columns kept with each prompt).
It cycles a finite list in a fresh seeded permutation per pass (the permutation of pass ``k`` is a
function of ``(seed, k)`` alone, so the position is the whole state to checkpoint); a one-shot iterable is read
lazily in its own order, and on resume the items already consumed are skipped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from ppokit.lm.data import numbered_rows, to_prompt

__all__ = ["load_prompts", "PromptSource"]


def load_prompts(source: str | os.PathLike) -> list[str]:
    """The prompts of a ``.jsonl`` or text file (see the module docstring); ``ValueError`` names line and reason."""
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"prompts: no such file {path}")
    prompts: list[str] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"prompts: {path} line {n} is not JSON ({exc.msg})") from None
                if isinstance(item, dict):
                    item = item.get("prompt")
                if not isinstance(item, str):
                    raise ValueError(f"prompts: {path} line {n} must be a JSON string or an object with a string "
                                     f"\"prompt\"")
                prompts.append(item)
            else:
                prompts.append(line.rstrip("\r\n"))
    if not prompts:
        raise ValueError(f"prompts: {path} holds no prompts")
    return prompts


class PromptSource:
    """Serves ``take(n)`` prompts at a time; ``state()`` / ``load_state()`` checkpoint the position."""

    def __init__(self, prompts: Any, seed: int, tokenizer: Any = None):
        self.seed = int(seed)
        self.consumed = 0
        self._iter: Iterator[str] | None = None
        self._tokenizer = tokenizer
        self._columns: list[str] | None = None
        self._labels: list[str] | None = None  # "line N" of a file's rows, for messages
        where = "prompts"
        if isinstance(prompts, (str, os.PathLike)):
            where = f"prompts {prompts}"
        if isinstance(prompts, (str, os.PathLike)) or hasattr(prompts, "column_names") \
                or type(prompts).__name__ == "DatasetDict":
            numbered = numbered_rows(prompts, "prompts")
            prompts, self._labels = [r for _, r in numbered], [n for n, _ in numbered]
        self._where = where
        if isinstance(prompts, (list, tuple)):
            self.items: list[str] | None = [self._check(p, i) for i, p in enumerate(prompts)]
            if not self.items:
                raise ValueError("prompts: the list is empty")
        elif isinstance(prompts, Iterable):
            self.items = None
            self._source = prompts
        else:
            raise ValueError(f"prompts must be a list of strings, an iterable of strings or a .jsonl/.txt path, got "
                             f"{type(prompts).__name__}")
        self._perm: tuple[int, torch.Tensor] | None = None

    def _check(self, p: Any, i: int) -> str:
        """A row as its prompt text (``data.to_prompt``); the first row fixes the extra columns every row has."""
        if isinstance(p, str) and self._columns is None:
            return p
        if not isinstance(p, (str, dict)):
            raise ValueError(f"prompts[{i}] must be a string or a row with a \"prompt\" column, got "
                             f"{type(p).__name__}")
        at = self._labels[i] if self._labels is not None and i < len(self._labels) else i
        out = to_prompt(p, at, self._tokenizer, self._where, self._columns)
        if self._columns is None:
            self._columns = list(getattr(out, "extra", {}))
        return out

    def _order(self, k: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != k:
            g = torch.Generator().manual_seed(self.seed * 100_003 + k)
            self._perm = (k, torch.randperm(len(self.items), generator=g))
        return self._perm[1]

    def take(self, n: int) -> list[str]:
        """The next ``n`` prompts."""
        out = []
        for _ in range(n):
            if self.items is not None:
                k, i = divmod(self.consumed, len(self.items))
                out.append(self.items[int(self._order(k)[i])])
            else:
                out.append(self._check(self._next(), self.consumed))
            self.consumed += 1
        return out

    def _next(self) -> str:
        if self._iter is None:
            self._iter = iter(self._source)
        try:
            return next(self._iter)
        except StopIteration:
            raise ValueError(f"prompts: the iterable ran out after {self.consumed} prompts; pass a list to cycle "
                             "through it") from None

    def state(self) -> dict:
        return {"consumed": self.consumed}

    def load_state(self, state: dict) -> None:
        consumed = int(state["consumed"])
        if self.items is None:  # replay the one-shot iterable up to where the checkpoint was
            self.consumed = 0
            for _ in range(consumed):
                self._next()
                self.consumed += 1
        self.consumed = consumed
