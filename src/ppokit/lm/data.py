"""Datasets in TRL's conventions: where rows come from, and how a row becomes a prompt, a preference pair or an
SFT example.

Rows come from a list, a ``datasets.Dataset`` / ``DatasetDict`` (its ``train`` split), a directory that
``save_to_disk`` wrote, a ``.jsonl`` file (one JSON object, or one string, a line) or a text file (one prompt a
line) (``read_rows``). Reading never runs code and never downloads.

A row's ``prompt`` (and a pair's ``chosen``/``rejected``, an SFT row's ``completion``) is a string, or, in TRL's
conversational format, a list of ``{"role": ..., "content": ...}`` messages, rendered with the tokenizer's chat
template (``add_generation_prompt=True`` for a prompt, so the completion is the assistant's turn). Every other
column of a prompt row travels with it (``Prompt.extra``) and reaches the reward functions as a keyword list
aligned with the completions, TRL's ``reward(prompts, completions, answer=[...], **kw)``.
Bad data is one ``ValueError`` line naming the file (or the source), the row and the column.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

__all__ = ["Prompt", "RESERVED_COLUMNS", "read_rows", "to_prompt", "to_pair", "to_sft_example", "extra_columns",
           "is_dataset_dir", "numbered_rows"]

# The keyword arguments the rollout itself gives a reward function (rollout.sample): a column may not shadow them.
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids", "eos", "input_ids", "attention_mask")
# What ``save_to_disk`` writes at the top of a Dataset's (state.json) or a DatasetDict's directory.
_DATASET_MARKERS = ("state.json", "dataset_dict.json")


class Prompt(str):
    """A prompt's text (the chat template applied when it was conversational) with its row's other columns."""

    extra: dict[str, Any]

    def __new__(cls, text: str, extra: dict[str, Any] | None = None) -> "Prompt":
        obj = super().__new__(cls, text)
        obj.extra = dict(extra or {})
        return obj


def is_dataset_dir(path: str | os.PathLike) -> bool:
    p = Path(path)
    return p.is_dir() and any((p / name).is_file() for name in _DATASET_MARKERS)


def _from_dataset(ds: Any, where: str) -> list[Any]:
    if type(ds).__name__ == "DatasetDict":
        names = list(ds.keys())
        if "train" in names:
            ds = ds["train"]
        elif len(names) == 1:
            ds = ds[names[0]]
        else:
            raise ValueError(f"{where}: a DatasetDict with splits {', '.join(names)} and no 'train'; pass the split "
                             "to train on")
    return [dict(row) for row in ds]


def read_rows(source: Any, where: str = "data") -> list[Any]:
    """The rows of ``source`` (module docstring): dicts, or strings for a text file / a list of strings."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir():
            if not is_dataset_dir(path):
                raise ValueError(f"{where}: {path} is a directory but not one save_to_disk wrote (no "
                                 f"{' or '.join(_DATASET_MARKERS)})")
            try:
                import datasets
            except ImportError:
                raise ValueError(f"{where}: {path} is a datasets directory; reading it needs the datasets package "
                                 "(pip install -e '.[data]')") from None
            return _from_dataset(datasets.load_from_disk(str(path)), f"{where} {path}")
        if not path.is_file():
            raise ValueError(f"{where}: no such file {path}")
        rows: list[Any] = []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if path.suffix == ".jsonl":
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{where}: {path} line {n} is not JSON ({exc.msg})") from None
                else:
                    rows.append(line.rstrip("\r\n"))
        if not rows:
            raise ValueError(f"{where}: {path} holds no {where.split()[0]}")
        return rows
    if hasattr(source, "column_names") or type(source).__name__ == "DatasetDict":
        return _from_dataset(source, where)
    if isinstance(source, (list, tuple)):
        return list(source)
    raise ValueError(f"{where}: expected a list, a datasets.Dataset, a save_to_disk directory or a .jsonl/.txt "
                     f"file, got {type(source).__name__}")


def _messages(value: Any, where: str) -> list[dict[str, str]] | None:
    """``value`` as a list of chat messages, None when it is not a list (a plain string), ValueError when it is a
    malformed one."""
    if not isinstance(value, list):
        return None
    for k, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: message {k} must be a {{\"role\": str, \"content\": str}} object")
    if not value:
        raise ValueError(f"{where}: an empty list of messages")
    return value


def _template(tokenizer: Any, messages: list[dict], where: str, *, generation_prompt: bool) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"{where}: is conversational (a list of messages) but the tokenizer has no chat_template; "
                         "set tokenizer.chat_template or give plain strings")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as exc:  # noqa: BLE001 - a user's Jinja template raises anything
        raise ValueError(f"{where}: the chat template failed ({type(exc).__name__}: {exc})") from None


def _text(tokenizer: Any, value: Any, where: str, *, generation_prompt: bool = True) -> str:
    msgs = _messages(value, where)
    if msgs is not None:
        return _template(tokenizer, msgs, where, generation_prompt=generation_prompt)
    if not isinstance(value, str):
        raise ValueError(f"{where}: must be a string or a list of chat messages, got {type(value).__name__}")
    return value


def _response(tokenizer: Any, prompt_value: Any, prompt_text: str, value: Any, where: str) -> str:
    """A response column as the text that follows the rendered prompt: a string as is; messages rendered after
    the prompt's with the chat template, the prompt's rendering cut off (the template's end-of-turn included)."""
    msgs = _messages(value, where)
    if msgs is None:
        return _text(tokenizer, value, where)
    history = _messages(prompt_value, where) or [{"role": "user", "content": prompt_text}]
    full = _template(tokenizer, history + msgs, where, generation_prompt=False)
    if full.startswith(prompt_text):
        return full[len(prompt_text):]
    return "".join(m["content"] for m in msgs)  # a template that renders a prefix differently: the contents


def label(i: Any) -> str:
    """How a message names a row: ``row 3`` for an index, or the label ``numbered_rows`` gave (``line 4``)."""
    return i if isinstance(i, str) else f"row {i}"


def numbered_rows(source: Any, where: str = "data") -> list[tuple[str, Any]]:
    """``read_rows`` with each row's label for messages: ``line N`` in a JSONL/text file, ``row i`` otherwise."""
    rows = read_rows(source, where)
    if isinstance(source, (str, os.PathLike)) and Path(source).is_file():
        with open(source, encoding="utf-8") as f:
            lines = [n for n, line in enumerate(f, 1) if line.strip()]
        return [(f"line {n}", row) for n, row in zip(lines, rows)]
    return [(f"row {i}", row) for i, row in enumerate(rows)]


def _row(row: Any, i: int | str, where: str) -> dict:
    if not isinstance(row, dict):
        raise ValueError(f"{where} {label(i)}: must be an object (a dict / JSON object), got {type(row).__name__}")
    return row


def to_prompt(row: Any, i: int | str, tokenizer: Any, where: str = "prompts", columns: Sequence[str] | None = None) -> str:
    """Row ``i`` as a prompt: a string stays one; a ``{"prompt": ..., **columns}`` row becomes a ``Prompt`` with
    the other columns in ``extra``. ``columns``: the extra columns every row must have (the first row's)."""
    if isinstance(row, str):
        if columns:
            raise ValueError(f"{where} {label(i)}: a plain string, but the rows before it have columns "
                             f"{', '.join(columns)}")
        return row
    row = _row(row, i, where)
    if "prompt" not in row:
        raise ValueError(f"{where} {label(i)}: has no \"prompt\" column (columns: {', '.join(map(str, row)) or 'none'})")
    text = _text(tokenizer, row["prompt"], f"{where} {label(i)} column prompt")
    extra = {k: v for k, v in row.items() if k != "prompt"}
    for k in extra:
        if k in RESERVED_COLUMNS:
            raise ValueError(f"{where} {label(i)} column {k}: the name is one the rollout passes to the reward "
                             "itself; rename the column")
    if columns is not None and sorted(extra) != sorted(columns):
        missing = sorted(set(columns) - set(extra)) or sorted(set(extra) - set(columns))
        raise ValueError(f"{where} {label(i)} column {missing[0]}: the rows do not share their columns (row 0 has "
                         f"{', '.join(columns) or 'only prompt'})")
    return Prompt(text, extra)


def to_pair(row: Any, i: int | str, tokenizer: Any, where: str = "pairs") -> tuple[str, str, str]:
    """Row ``i`` as ``(prompt, chosen, rejected)`` text: a triple, or a dict with those columns, each a string or
    conversational."""
    if isinstance(row, (tuple, list)) and len(row) == 3:
        row = dict(zip(("prompt", "chosen", "rejected"), row))
    row = _row(row, i, where)
    for k in ("prompt", "chosen", "rejected"):
        if k not in row:
            raise ValueError(f"{where} {label(i)}: has no \"{k}\" column (a pair needs prompt, chosen and rejected)")
    prompt = _text(tokenizer, row["prompt"], f"{where} {label(i)} column prompt")
    return (prompt,
            _response(tokenizer, row["prompt"], prompt, row["chosen"], f"{where} {label(i)} column chosen"),
            _response(tokenizer, row["prompt"], prompt, row["rejected"], f"{where} {label(i)} column rejected"))


def to_sft_example(row: Any, i: int | str, tokenizer: Any, where: str = "data") -> tuple[str, str]:
    """Row ``i`` as ``(prompt, completion)`` text: ``{"prompt", "completion"}`` (strings or conversational), or
    ``{"messages": [...]}`` whose last message is the completion (the assistant's turn) and the rest its prompt."""
    row = _row(row, i, where)
    if "messages" in row and "prompt" not in row:
        msgs = _messages(row["messages"], f"{where} {label(i)} column messages")
        if msgs is None or len(msgs) < 2:
            raise ValueError(f"{where} {label(i)} column messages: needs at least two messages (a prompt and the "
                             "completion to learn)")
        prompt = _template(tokenizer, msgs[:-1], f"{where} {label(i)} column messages", generation_prompt=True)
        return prompt, _response(tokenizer, msgs[:-1], prompt, msgs[-1:], f"{where} {label(i)} column messages")
    for k in ("prompt", "completion"):
        if k not in row:
            raise ValueError(f"{where} {label(i)}: has no \"{k}\" column (an SFT row is prompt + completion, or "
                             "messages)")
    prompt = _text(tokenizer, row["prompt"], f"{where} {label(i)} column prompt")
    return prompt, _response(tokenizer, row["prompt"], prompt, row["completion"], f"{where} {label(i)} column completion")


def extra_columns(prompts: Sequence[str]) -> dict[str, list[Any]]:
    """The extra columns of a batch of prompts, one list each aligned with the prompts (``{}`` for plain ones)."""
    first = getattr(prompts[0], "extra", None) if prompts else None
    if not first:
        return {}
    return {k: [getattr(p, "extra", {}).get(k) for p in prompts] for k in first}
