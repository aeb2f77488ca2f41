"""The evaluation gate keeps best.pt (``ppokit eval RUN --best``); ``--progress`` draws a bar with an ETA on any
terminal width; ``ppokit eval`` reports progress on long evaluations."""

from __future__ import annotations

import csv
import io
import math
import re
import subprocess
import sys

import pytest
from rich.console import Console

import ppokit
from ppokit.cli import main
from ppokit.cli.evaluate import EvalProgress
from ppokit.core import schema as S
from ppokit.runtime import checkpoint as ckpt
from ppokit.runtime.logger import ConsoleSink

GATED = dict(env_id="CartPole-v1", num_envs=2, num_steps=64, num_minibatches=2, update_epochs=2,
             total_timesteps=768, eval_every=1, eval_threshold=1e9, eval_episodes=2, tensorboard=False, seed=3)  # seed 3: the best evaluation is the first


@pytest.fixture(scope="module")
def gated_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("best") / "run"
    ppokit.train(ppokit.PPOConfig(**GATED), run_dir=run_dir, console_enabled=False)
    return run_dir


def test_best_pt_holds_the_best_evaluation(gated_run):
    with open(gated_run / "metrics.csv") as f:
        rows = [(int(float(r["global_step"])), float(r[S.EVAL_RETURN])) for r in csv.DictReader(f)]
    assert len(rows) == 6 and all(math.isfinite(v) for _, v in rows)
    best_step, best_return = max(rows, key=lambda r: r[1])  # max keeps the first of equal returns, as the gate
    state = ckpt.load_checkpoint(gated_run / "best.pt")
    assert state["best_eval_return"] == pytest.approx(best_return)
    assert state["global_step"] == best_step


def test_eval_best_evaluates_best_pt(gated_run, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ppokit", "eval", str(gated_run), "--best", "--episodes", "1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "mean return" in proc.stdout, proc.stderr
    ungated = tmp_path / "ungated"
    ppokit.train(ppokit.PPOConfig(**{**GATED, "eval_every": 0, "eval_threshold": None, "total_timesteps": 128}),
                 run_dir=ungated, console_enabled=False)
    assert not (ungated / "best.pt").exists()
    proc = subprocess.run([sys.executable, "-m", "ppokit", "eval", str(ungated), "--best"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "has no best.pt" in proc.stderr and proc.stderr.count("\n") == 1


def test_resume_keeps_the_best_of_the_whole_run(gated_run):
    before = ckpt.load_checkpoint(gated_run / "best.pt")["best_eval_return"]
    ppokit.resume(gated_run, total_timesteps=1024, console_enabled=False)
    with open(gated_run / "metrics.csv") as f:
        returns = [float(r[S.EVAL_RETURN]) for r in csv.DictReader(f)]
    after = ckpt.load_checkpoint(gated_run / "best.pt")["best_eval_return"]
    assert after == pytest.approx(max(returns)) and after >= before


def _terminal(width: int) -> Console:
    return Console(file=io.StringIO(), force_terminal=True, width=width, color_system=None)


@pytest.mark.parametrize("width", [40, 80, 160])
def test_progress_bar_on_any_width(monkeypatch, width):
    monkeypatch.setattr(ConsoleSink, "PROGRESS", True)
    sink = ConsoleSink(1000, log_every=1, console=_terminal(width))
    try:
        assert sink.live
        sink.write(100, {S.EPISODIC_RETURN: 10.0})
        sink.write(200, {S.EPISODIC_RETURN: 12.0})
        assert "eta" in sink.update_line() and "eta -" not in sink.update_line()
    finally:
        sink.close()
    drawn = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", sink.console.file.getvalue())  # cursor and erase codes
    assert "eta" in drawn
    bars = [line for line in drawn.splitlines() if "%" in line]  # the plain lines soft-wrap by design
    assert bars and all(len(line) <= width for line in bars), bars


def test_without_progress_a_narrow_terminal_gets_no_bar():
    sink = ConsoleSink(1000, console=_terminal(60))
    assert not sink.live and "eta" not in sink.update_line()
    sink.close()


def test_eta_counts_from_the_first_logged_update(monkeypatch):
    monkeypatch.setattr(ConsoleSink, "PROGRESS", True)
    clock = iter([100.0, 110.0, 110.0])
    monkeypatch.setattr("ppokit.runtime.logger.time.perf_counter", lambda: next(clock))
    sink = ConsoleSink(10_000, log_every=1000, console=Console(file=io.StringIO()))
    sink.write(1000, {})  # t=100
    sink.write(2000, {})  # 1000 steps in 10 s: 8000 left -> 80 s
    assert sink.eta() == "1m20s"


def test_long_evaluation_prints_progress(gated_run, monkeypatch, capsys):
    monkeypatch.setattr(EvalProgress, "AFTER_S", 0.0)
    monkeypatch.setattr(EvalProgress, "EVERY_S", 0.0)
    assert main(["eval", str(gated_run), "--episodes", "3"]) == 0
    err = capsys.readouterr().err
    assert "eval: 1/3 episodes, mean return so far" in err and "eval: 2/3" in err and "3/3" not in err


def test_short_evaluation_prints_only_its_result(gated_run, capsys):
    assert main(["eval", str(gated_run), "--episodes", "2"]) == 0
    assert "eval:" not in capsys.readouterr().err
