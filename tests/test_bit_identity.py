"""Refactorings change nothing a run computes: tiny fixed-seed trainings reproduce the golden runs bit for bit.

``tests/golden/`` holds, for each case of ``tests/golden/make_golden.py`` (CartPole, Pendulum and the GridWorld;
fused and ``--no-fused-update``; ppo, and ppo-kl and a2c on the GridWorld; KL early stopping firing on CartPole),
the run's ``metrics.csv`` without the timing columns ``perf/*`` and a sha256 of the final policy parameters. Every
golden column must come back with the same text in every cell (a column added since is not compared), and the
parameters must hash the same.

The golden files are regenerated ONLY when a change of what a run computes is intended, with the commit saying
so::

    python3 tests/golden/make_golden.py
"""

from __future__ import annotations

import csv
import importlib.util
import io
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parent / "golden"

_spec = importlib.util.spec_from_file_location("ppokit_make_golden", GOLDEN / "make_golden.py")
make_golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_golden)


def _columns(csv_text: str) -> dict[str, list[str]]:
    rows = list(csv.reader(io.StringIO(csv_text)))
    return {col: [row[i] for row in rows[1:]] for i, col in enumerate(rows[0])}


@pytest.mark.parametrize("name", sorted(make_golden.CASES))
def test_run_matches_golden(name, tmp_path):
    table, digest = make_golden.run_case(name, tmp_path)
    want, got = _columns((GOLDEN / f"{name}.csv").read_text()), _columns(table)
    missing = [col for col in want if col not in got]
    assert not missing, f"{name}: columns gone from metrics.csv: {missing}"
    for col, cells in want.items():
        assert got[col] == cells, f"{name}: column {col!r} differs from the golden run"
    assert digest == (GOLDEN / f"{name}.sha256").read_text().strip(), f"{name}: final parameters differ"


def test_golden_cases_exercise_the_guards():
    """The golden set is only a witness if it covers what the epoch loop decides: KL early stopping fires in the
    target_kl cases (fewer minibatches than scheduled) and every applied case ran some minibatches."""
    for name in make_golden.CASES:
        cols = _columns((GOLDEN / f"{name}.csv").read_text())
        assert all(float(x) > 0 for x in cols["diag/minibatches"]), name
        stopped = any(float(x) == 1.0 for x in cols["diag/early_stopped"])
        assert stopped == ("kl_stop" in name), name
