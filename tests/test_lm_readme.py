"""The README's language-model example (its ``py`` block: it needs the lm extra, so the README test, which runs the
``python`` blocks on a machine with only the test extra, leaves it to this file) runs as written and does what its
comments say: a trained run with metrics, an evaluation, a saved policy that from_pretrained reads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_lm_example_runs_as_written(tmp_path, monkeypatch):
    blocks = re.findall(r"^```py\n(.*?)^```", README.read_text(encoding="utf-8"), re.S | re.M)
    assert len(blocks) == 1 and "GRPOTrainer" in blocks[0]
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__readme__"}
    exec(compile(blocks[0], "README.md py block", "exec"), namespace)
    namespace["trainer"].close()
    from transformers import AutoModelForCausalLM

    from ppokit.core import schema as S

    assert len(namespace["history"]) == 3 and S.SCORE_MEAN in namespace["history"][-1]
    assert (tmp_path / "runs" / "lm" / "metrics.csv").is_file()
    AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "lm" / "ckpt" / "policy")
    assert (tmp_path / "runs" / "lm" / "ckpt" / "trainer_state.pt").is_file()
