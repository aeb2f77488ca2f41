"""benchmarks/returns.py end to end on a tiny budget: the worker pool, the frozen-statistics evaluation, the JSON
record beside its published reference, the figure, and one-line refusals of bad arguments."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "returns.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # two spawned workers importing torch, ~8 s alone, ~20 s on a loaded machine
def test_two_seeds_in_two_workers_write_the_record_and_the_figure(tmp_path):
    proc = _run("pendulum", "--seeds", "2", "--budget", "2048", "--eval-episodes", "2", "--nice", "0",
                "--out", str(tmp_path), "--set", "num_minibatches=4")
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "pendulum.json").read_text())
    assert record["seeds_done"] == 2 and record["steps_reached"] == [2048, 2048]
    assert [r["seed"] for r in record["runs"]] == [1, 2]
    evals = [r["eval_mean"] for r in record["runs"]]
    assert record["eval_mean"] == pytest.approx(sum(evals) / 2)
    assert all(len(r["eval_returns"]) == 2 for r in record["runs"])
    assert record["reference"]["mean"] == -169.887 and "RL-Zoo" in record["reference"]["source"]
    assert (tmp_path / "pendulum.png").stat().st_size > 1000
    assert "published -169.887" in proc.stdout


def test_bad_arguments_are_one_line():
    proc = _run("nosuchtask")
    assert proc.returncode == 2 and "unknown task 'nosuchtask'" in proc.stderr
    proc = _run("cartpole", "--set", "gamma=2")
    assert proc.returncode == 2 and "'gamma'" in proc.stderr and "(0, 1]" in proc.stderr and "Traceback" not in proc.stderr
    proc = _run("cartpole", "--set", "gamma")
    assert proc.returncode == 2 and "expected FIELD=VALUE, got 'gamma'" in proc.stderr
