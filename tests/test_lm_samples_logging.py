"""The sample completions of an LM run in TensorBoard's text tab and, under ``track``, as a W&B table: read back
from the event file (tensorboard's EventAccumulator) and from the offline W&B run, row for row what
completions.jsonl holds."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")

from ppokit.lm.config import LMConfig  # noqa: E402

ITERATIONS = 2


def _reward(prompts, completions):
    return [float(len(c)) for c in completions]


def _run(tmp_path, **kw):
    from ppokit.lm import GRPOTrainer
    from ppokit.lm.tiny import build_tiny

    model, tok = build_tiny("ABX:", seed=0)
    cfg = LMConfig(batch_prompts=2, group_size=2, max_new_tokens=4, update_epochs=1, num_minibatches=1, beta=0.0,
                   console=False, log_every=1, **kw)
    t = GRPOTrainer(model, tok, reward=_reward, prompts=["AB:", "X:"], config=cfg, run_dir=tmp_path / "run")
    t.train(ITERATIONS)
    t.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == ITERATIONS * 4 and {r["iteration"] for r in rows} == {1, 2}
    return t, rows


def _cell(text) -> str:  # samples_markdown's escaping
    return str(text).replace("|", "\\|").replace("\n", "\\n")


def test_tensorboard_text_tab_holds_each_iterations_sample_completions(tmp_path):
    pytest.importorskip("tensorboard", reason="needs pip install -e '.[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator

    t, rows = _run(tmp_path, tensorboard=True)
    acc = EventAccumulator(str(tmp_path / "run" / "tb"), size_guidance={TENSORS: 0})
    acc.Reload()
    events = acc.Tensors("samples/text_summary")
    # One text entry per iteration at its completion count, a Markdown table of that iteration's rows.
    assert [e.step for e in events] == [4, 8]
    for e, it in zip(events, (1, 2)):
        text = e.tensor_proto.string_val[0].decode()
        lines = text.splitlines()
        assert lines[0] == "| prompt | completion | reward |"
        mine = [r for r in rows if r["iteration"] == it]
        assert lines[2:] == [f"| {_cell(r['prompt'])} | {_cell(r['completion'])} | {r['reward']:.4g} |" for r in mine]


def test_wandb_offline_run_holds_a_table_of_the_sample_completions(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="needs pip install -e '.[wandb]'")
    from ppokit.core import schema as S
    from test_wandb import _history

    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    t, rows = _run(tmp_path, tensorboard=False, track=True, wandb_project="ppokit-test")
    (offline,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    history = _history(next(offline.glob("run-*.wandb")))
    # The metrics, one row per iteration at its completion count, as for the Gymnasium trainer.
    scores = [h for h in history if S.SCORE_MEAN in h]
    assert [h["global_step"] for h in scores] == [4, 8]
    assert [h[S.SCORE_MEAN] for h in scores] == [m[S.SCORE_MEAN] for m in t.history]
    # The samples: a table per iteration, whose file holds completions.jsonl's rows of that iteration.
    # (The history record names the table file by nested keys, read here as "samples/<key>".)
    tables = [h for h in history if "samples/_type" in h]
    assert [h["global_step"] for h in tables] == [4, 8]
    for h, it in zip(tables, (1, 2)):
        assert h["samples/_type"] == "table-file" and h["samples/nrows"] == 4
        data = json.loads((offline / "files" / h["samples/path"]).read_text())
        assert data["columns"] == ["iteration", "prompt", "completion", "reward"]
        assert data["data"] == [[r[c] for c in data["columns"]] for r in rows if r["iteration"] == it]


def test_track_without_a_valid_project_name_is_refused_before_anything_is_built():
    from ppokit.core.errors import ConfigError

    with pytest.raises(ConfigError, match="wandb_project"):
        LMConfig(track=True, wandb_project="a/b").validate()
