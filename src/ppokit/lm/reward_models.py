"""Scoring completions with a sequence-classification reward model that has its own tokenizer.

The policy's token ids are never handed to the reward model: the completion is decoded to text (``rollout``), and
prompt + completion are tokenized again with the reward model's tokenizer, through its chat template when it has
one (a user turn and an assistant turn), as TRL does. So a reward model with another vocabulary than the policy's
works, and one whose tokenizer produces ids its embedding does not have is refused in one line up front.

Batch invariance: the rows are RIGHT-padded, so every real token sits at its own position (0, 1, ...) and attends
to real tokens only, and transformers' sequence-classification heads read the score at the rightmost token that is
not ``config.pad_token_id``. A left-padded call without ``position_ids`` shifts every position by the row's
padding, so a row's score depended on the longest row beside it (measured on a GPT-2 reward model: 4.505 alone,
1.638 beside a longer prompt). Where that rule cannot find the last real token (no ``pad_token_id`` in the
model's config, or a row whose last token is the pad id), those rows are scored in groups of equal length, with
no padding at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["RewardModel", "load_reward_model"]


def _pad_id(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    pad = getattr(text, "pad_token_id", None)
    return None if pad is None else int(pad)


def _vocab_rows(model: nn.Module) -> int | None:
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    return None if emb is None else int(emb.num_embeddings)


class RewardModel:
    """``RewardModel(model, tokenizer)`` is a reward ``fn(prompts, completions, info) -> Tensor [B]``: the
    scalar output of ``model`` (``[B]`` or ``[B, 1]`` logits) on each prompt + completion, tokenized by
    ``tokenizer``. ``ValueError`` (one line) when the tokenizer's vocabulary does not fit the model's embedding."""

    def __init__(self, model: nn.Module, tokenizer: Any, name: str | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name or type(model).__name__
        rows = _vocab_rows(model)
        if rows is not None and len(tokenizer) > rows:
            raise ValueError(f"reward model {self.name}: its tokenizer has {len(tokenizer):,} tokens but the model's "
                             f"embedding has {rows:,} rows; give the reward model's own tokenizer (reward=(model, "
                             "tokenizer), or a --reward-model directory that holds it)")
        self.pad_id = _pad_id(model)
        self.templated = bool(getattr(tokenizer, "chat_template", None))

    def texts(self, prompts: list[str], completions: list[str]) -> list[str]:
        """What the reward model reads: the chat template over a user and an assistant turn, or the plain
        concatenation prompt + completion."""
        if not self.templated:
            return [p + c for p, c in zip(prompts, completions)]
        return [self.tokenizer.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                                                   tokenize=False) for p, c in zip(prompts, completions)]

    def encode(self, prompts: list[str], completions: list[str]) -> list[list[int]]:
        # A chat template writes its own special tokens; a plain text gets the tokenizer's (e.g. a BOS).
        ids = self.tokenizer(self.texts(prompts, completions), add_special_tokens=not self.templated)["input_ids"]
        return [list(row) or [self.pad_id or 0] for row in ids]

    def __call__(self, prompts: list[str], completions: list[str], info: dict[str, Any] | None = None) -> Tensor:
        ids = self.encode(list(prompts), list(completions))
        out = torch.empty(len(ids), dtype=torch.float32)
        padded = [i for i, row in enumerate(ids) if self.pad_id is not None and row[-1] != self.pad_id]
        rest = [i for i in range(len(ids)) if i not in set(padded)]
        if padded:
            out[padded] = self._score([ids[i] for i in padded])
        by_length: dict[int, list[int]] = {}
        for i in rest:
            by_length.setdefault(len(ids[i]), []).append(i)
        for group in by_length.values():
            out[group] = self._score([ids[i] for i in group])
        return out

    def _score(self, rows: list[list[int]]) -> Tensor:
        """``[n]`` scores of right-padded ``rows`` (equal lengths when the model has no pad id)."""
        device = next(iter(self.model.parameters()), torch.empty(0)).device
        L = max(len(r) for r in rows)
        pad = self.pad_id if self.pad_id is not None else 0
        input_ids = torch.tensor([r + [pad] * (L - len(r)) for r in rows], dtype=torch.long, device=device)
        mask = torch.tensor([[1] * len(r) + [0] * (L - len(r)) for r in rows], dtype=torch.long, device=device)
        positions = torch.arange(L, device=device).expand(len(rows), L)
        with torch.no_grad():
            try:
                out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions)
            except TypeError:  # a plain module without position_ids: right padding leaves its positions right
                out = self.model(input_ids=input_ids, attention_mask=mask)
        logits = out.logits if hasattr(out, "logits") else out
        if not isinstance(logits, Tensor) or logits.dim() not in (1, 2) or (logits.dim() == 2 and logits.shape[1] != 1):
            shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise ValueError(f"reward model {self.name} must return [B] or [B, 1] scores, got {shape}")
        return logits.reshape(-1).float().cpu()


def load_reward_model(directory: str | Path, device: str = "cpu") -> RewardModel:
    """A ``RewardModel`` from a local directory ``save_pretrained`` wrote (an ``AutoModelForSequenceClassification``
    with one label and its tokenizer); ``ValueError`` (one line) when it is not one. Nothing is downloaded."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    d = Path(directory)
    if not (d / "config.json").is_file():
        raise ValueError(f"--reward-model {directory}: not a model directory (no config.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(d, local_files_only=True)
        model = AutoModelForSequenceClassification.from_pretrained(d, local_files_only=True).to(device)
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError, ... for bad dirs
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"--reward-model {directory}: cannot be loaded: {type(exc).__name__}: {text}") from None
    labels = getattr(model.config, "num_labels", 1)
    if labels != 1:
        raise ValueError(f"--reward-model {directory}: has {labels} labels; a reward model has one (num_labels=1)")
    return RewardModel(model, tokenizer, name=d.name)
