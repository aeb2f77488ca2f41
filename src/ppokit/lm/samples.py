"""What was generated: a few of each iteration's completions in ``RUN_DIR/completions.jsonl`` and TensorBoard.

Reward hacking shows in the text long before the curves give it away, so every iteration that samples writes
``SAMPLES_PER_ITERATION`` rows: ``iteration``, ``prompt``, ``completion`` (decoded with special tokens kept, so an
EOS, or its absence, is visible) and ``reward`` (before the missing-EOS penalty), and one field per function when the reward is a weighted list of them
(named by the function). The file is appended one line a
row and trimmed to the checkpoint on resume like ``metrics.csv`` (``runtime.rundir.trim_to_checkpoint``);
``ppokit report`` shows the last rows as a table (``read_samples``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ppokit.runtime.rundir import COMPLETIONS_FILE

__all__ = ["COMPLETIONS_FILE", "SAMPLES_PER_ITERATION", "sample_rows", "append_samples", "read_samples",
           "samples_markdown"]

SAMPLES_PER_ITERATION = 4  # rows a sampling iteration writes (its first completions: every prompt group's first)


def sample_rows(sampled: Any, tokenizer: Any, iteration: int, k: int = SAMPLES_PER_ITERATION) -> list[dict]:
    """Up to ``k`` rows of a ``rollout.Sampled``, spread over its prompts (GRPO's groups are consecutive rows)."""
    b = sampled.batch
    n = len(sampled.completions)
    rows_at = sorted({round(i * n / min(k, n)) for i in range(min(k, n))})
    response = b.input_ids[:, -b.n_response:]
    out = []
    for i in rows_at:
        ids = response[i][b.response_mask[i]].tolist()
        out.append({"iteration": int(iteration), "prompt": str(sampled.prompts[i]),
                    "completion": tokenizer.decode(ids, skip_special_tokens=False),
                    "reward": float(sampled.raw_scores[i]),
                    **{name: float(v[i]) for name, v in (getattr(sampled, "reward_terms", None) or {}).items()}})
    return out


def append_samples(run_dir: Path, rows: list[dict]) -> None:
    """Append ``rows`` to ``run_dir/completions.jsonl`` (one JSON object a line, written and flushed at once)."""
    with open(Path(run_dir) / COMPLETIONS_FILE, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def read_samples(run_dir: str | Path, last: int | None = None) -> list[dict]:
    """The rows of ``run_dir/completions.jsonl`` (a half-written last line skipped); the last ``last`` of them."""
    path = Path(run_dir) / COMPLETIONS_FILE
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows if last is None else rows[-last:]


def samples_markdown(rows: list[dict]) -> str:
    """A Markdown table of ``rows`` (TensorBoard's text plugin renders it)."""
    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|").replace("\n", "\\n")

    lines = ["| prompt | completion | reward |", "|---|---|---|"]
    lines += [f"| {cell(r['prompt'])} | {cell(r['completion'])} | {r['reward']:.4g} |" for r in rows]
    return "\n".join(lines)
