"""Refactorings change nothing a run computes: tiny fixed-seed trainings reproduce the golden runs.

``tests/golden/`` holds, for each case of ``tests/golden/make_golden.py`` (CartPole, Pendulum and the GridWorld;
fused and ``--no-fused-update``; ppo, and ppo-kl and a2c on the GridWorld; KL early stopping firing on CartPole),
the run's ``metrics.csv`` without the timing columns ``perf/*`` and a summary of the final policy parameters
(``make_golden.params_summary``). Every golden column must come back (a column added since is not compared) with
each cell within ``RTOL`` of the column's largest magnitude, and every parameter statistic within ``RTOL_PARAMS`` of
its tensor's norm (both plus ``ATOL``, float32's resolution, for values that are rounding noise). A tolerance, not bit
equality: another CPU of the same kind runs other float kernels (an AMD EPYC gave ``-0.0024728442076593637`` where
this Intel Xeon gives ``-0.0024728511925786734``, 2.8e-6 relative), while a real change of the arithmetic (a sign,
a coefficient, a dropped term) moves the values by far more.

Bit equality is checked where it holds on any CPU: two runs made in this process (``test_fixed_seed_run_repeats
_bit_for_bit`` here; the one-env loop against the general one in ``test_single_env_fastpath.py``; a resumed run
against the uninterrupted one in ``test_trainer.py``).

The golden files are regenerated ONLY when a change of what a run computes is intended, with the commit saying
so::

    python3 tests/golden/make_golden.py
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import math
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parent / "golden"

_spec = importlib.util.spec_from_file_location("ppokit_make_golden", GOLDEN / "make_golden.py")
make_golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_golden)

# Relative to the column's (or the tensor's) magnitude. Measured on these 5-update runs: the other CPU kernels
# (ATEN_CPU_CAPABILITY=default against the AVX512 golden; its first Pendulum policy loss is off by 3.9e-6, as the
# AMD EPYC's by 2.8e-6) move a metrics cell by at most 5.8e-5 of its column's largest magnitude (approx_kl_k1, a
# mean of small terms of both signs) and a parameter statistic by at most 1.4e-6 of its tensor's norm. Real changes:
# the policy loss's sign flipped moves the policy columns by ~1e-1; the discrete fused backward's entropy
# coefficient 5% low (a term near 0 at a near-uniform policy) moves the CartPole metrics by 8e-5..3.7e-4 and
# parameters by 1.6e-4..3.8e-4. So the metrics get a margin of ~9x over the noise and the parameters, where a
# change accumulates, the tight check (~14x over the noise).
RTOL = 5e-4
RTOL_PARAMS = 2e-5
# Float32's resolution of an O(1) quantity (2**-23 = 1.2e-7): a value that is 0 in exact arithmetic (a2c's policy
# loss with normalized advantages, its approx KL at ratio 1) comes out as rounding noise of this size, 0.0 on one
# CPU and 5.6e-16 or 2.6e-8 on another; and a parameter that went back and forth (Pendulum's log_std, 9e-6 after
# 60 Adam steps of ~1e-4) keeps the absolute error of its steps (1.2e-9), not one relative to its small value.
ATOL = 1e-7


def _columns(csv_text: str) -> dict[str, list[str]]:
    rows = list(csv.reader(io.StringIO(csv_text)))
    return {col: [row[i] for row in rows[1:]] for i, col in enumerate(rows[0])}


def _number(cell: str) -> float | None:
    try:
        return float(cell)
    except ValueError:
        return None


def column_mismatches(want: list[str], got: list[str]) -> list[str]:
    """The cells of one column that differ: ``row i: got X, golden Y`` (empty when the column matches).

    Numbers match within ``RTOL`` times the golden column's largest magnitude plus ``ATOL`` (a cell near zero,
    such as an explained variance of -0.0007 beside 0.06, carries the absolute error of its inputs); other cells
    (empty, nan, inf) must be the same text."""
    if len(got) != len(want):
        return [f"{len(got)} rows, golden {len(want)}"]
    numbers = [abs(x) for x in map(_number, want) if x is not None and math.isfinite(x)]
    tol = RTOL * max(numbers, default=0.0) + ATOL
    bad = []
    for i, (w, g) in enumerate(zip(want, got)):
        wf, gf = _number(w), _number(g)
        if wf is not None and gf is not None and math.isfinite(wf) and math.isfinite(gf):
            same = abs(gf - wf) <= tol
        else:  # text, an empty cell, nan or inf: the same text (the logger spells each one way)
            same = w == g
        if not same:
            bad.append(f"row {i + 1}: got {g}, golden {w}")
    return bad


def params_mismatches(want: dict[str, dict], got: dict[str, dict]) -> list[str]:
    """Parameter statistics that differ: shapes exactly; sum, wsum and l1 within ``RTOL_PARAMS`` of the golden L1
    norm (``|sum| <= l1``, and each entry's error scales with its magnitude); l2 within it of the golden L2; both
    plus ``ATOL``."""
    if list(got) != list(want):
        return [f"state dict keys {list(got)}, golden {list(want)}"]
    bad = []
    for key, w in want.items():
        g = got[key]
        if g["shape"] != w["shape"]:
            bad.append(f"{key}: shape {g['shape']}, golden {w['shape']}")
            continue
        for stat, scale in (("sum", w["l1"]), ("wsum", w["l1"]), ("l1", w["l1"]), ("l2", w["l2"])):
            if not abs(g[stat] - w[stat]) <= RTOL_PARAMS * scale + ATOL:
                bad.append(f"{key} {stat}: got {g[stat]!r}, golden {w[stat]!r}")
    return bad


@pytest.mark.parametrize("name", sorted(make_golden.CASES))
def test_run_matches_golden(name, tmp_path):
    table, summary, _ = make_golden.run_case(name, tmp_path)
    want, got = _columns((GOLDEN / f"{name}.csv").read_text()), _columns(table)
    missing = [col for col in want if col not in got]
    assert not missing, f"{name}: columns gone from metrics.csv: {missing}"
    differ = {col: bad for col, cells in want.items() if (bad := column_mismatches(cells, got[col]))}
    assert not differ, f"{name}: columns differ from the golden run beyond {RTOL:g} of their scale: {differ}"
    bad = params_mismatches(json.loads((GOLDEN / f"{name}.params.json").read_text()), summary)
    assert not bad, f"{name}: final parameters differ from the golden run: {bad}"


# One case per code path of the update: the fused MLP update with the KL early stop, autograd with observation and
# reward normalization, and a2c (the one-env runs of test_single_env_fastpath.py repeat fused and autograd too).
REPEATED = ("cartpole_ppo_kl_stop_fused", "pendulum_ppo_autograd", "gridworld_a2c")


@pytest.mark.parametrize("name", REPEATED)
def test_fixed_seed_run_repeats_bit_for_bit(name, tmp_path):
    """The same fixed-seed run twice in one process: the same metrics text and the same parameter bytes (the
    tolerance above is for other CPUs, not for a run that is not reproducible on this one)."""
    first = make_golden.run_case(name, tmp_path / "a")
    second = make_golden.run_case(name, tmp_path / "b")
    assert first[0] == second[0], f"{name}: metrics.csv differs between two runs in one process"
    assert first[2] == second[2], f"{name}: final parameters differ between two runs in one process"


def test_tolerance_catches_a_real_change_but_not_kernel_noise():
    """The comparison itself: a 3e-6 relative change (the two CPUs above) and rounding noise of an exact zero
    pass; a flipped sign, a 1% change, a number where there was none, a lost row or a changed shape fail."""
    col = ["-0.0024728511925786734", "-0.0011315254184106986", "nan", ""]
    assert column_mismatches(col, ["-0.0024728442076593637", "-0.0011315254184106986", "nan", ""]) == []
    assert column_mismatches(col, ["0.0024728511925786734", *col[1:]])
    assert column_mismatches(col, ["-0.0024975797", *col[1:]])
    assert column_mismatches(col, [col[0], col[1], "0.0", ""])
    assert column_mismatches(col, col[:3])
    assert column_mismatches(["0.0", "0.0"], ["5.551115123125783e-16", "2.6e-08"]) == []
    want = {"w": {"shape": [2], "sum": 1.0, "l1": 3.0, "l2": 2.2, "wsum": -0.5}}
    assert params_mismatches(want, {"w": {**want["w"], "sum": 1.0 + 1e-6}}) == []
    assert params_mismatches(want, {"w": {**want["w"], "wsum": -0.5 + 3e-4}})
    assert params_mismatches(want, {"w": {**want["w"], "shape": [1, 2]}})


def test_golden_cases_exercise_the_guards():
    """The golden set is only a witness if it covers what the epoch loop decides: KL early stopping fires in the
    target_kl cases (fewer minibatches than scheduled) and every applied case ran some minibatches."""
    for name in make_golden.CASES:
        cols = _columns((GOLDEN / f"{name}.csv").read_text())
        assert all(float(x) > 0 for x in cols["diag/minibatches"]), name
        stopped = any(float(x) == 1.0 for x in cols["diag/early_stopped"])
        assert stopped == ("kl_stop" in name), name
