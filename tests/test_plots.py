"""Figures and the ``ppokit objective`` command: PNGs are written and valid, the worked cases are printed."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

import ppokit.cli
from ppokit.diagnostics.plots import _alert_marks, objective_figure, plot_curves, read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _assert_png(path) -> None:
    assert os.path.isfile(path)
    with open(path, "rb") as fh:
        head = fh.read(8)
    assert head == PNG_SIGNATURE
    assert os.path.getsize(path) > 5_000  # a drawn figure, not an empty canvas


def test_plots_module_imports_cheaply():
    code = "import sys, ppokit.diagnostics.plots; sys.exit(int(any(m in sys.modules for m in ('matplotlib', 'torch'))))"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


@pytest.mark.parametrize("eps", [0.1, 0.2, 0.3])
def test_objective_figure_writes_png(tmp_path, eps):
    out = tmp_path / "sub" / f"obj_{eps}.png"
    assert objective_figure(eps=eps, path=out) == str(out)
    _assert_png(out)


def test_objective_figure_rejects_eps_outside_plot_range(tmp_path):
    with pytest.raises(ValueError, match="eps"):
        objective_figure(eps=0.7, path=tmp_path / "x.png")


def test_objective_command_in_process(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")  # rich sizes its table to the terminal; keep every cell on one line
    out = tmp_path / "fig.png"
    assert ppokit.cli.main(["objective", "--out", str(out)]) == 0
    _assert_png(out)
    printed = capsys.readouterr().out
    for value in ("2.4", "-1.6", "-2.8"):  # the worked cases at eps = 0.2
        assert value in printed
    for column in ("ratio", "advantage", "r*A", "clip(r)*A", "objective", "gradient"):
        assert column in printed
    assert printed.count("zero (clipped)") == 2  # cases 1 and 2; case 3 keeps its gradient


def test_objective_command_other_eps(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    # eps = 0.1: min(2.8, 1.1*2) = 2.2; min(-1.2, 0.9*-2) = -1.8; min(-2.8, 1.1*-2) = -2.8
    assert ppokit.cli.main(["objective", "--eps", "0.1", "--out", str(tmp_path / "f.png")]) == 0
    printed = capsys.readouterr().out
    for value in ("2.2", "-1.8", "-2.8"):
        assert value in printed


@pytest.mark.slow
def test_objective_command_subprocess(tmp_path):
    out = tmp_path / "fig.png"
    env = dict(os.environ, MPLBACKEND="Agg", OMP_NUM_THREADS="1", COLUMNS="120")
    proc = subprocess.run(
        [sys.executable, "-m", "ppokit.cli", "objective", "--out", str(out)],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    _assert_png(out)
    for value in ("2.4", "-1.6", "-2.8"):
        assert value in proc.stdout


METRICS_CSV = """\
global_step,charts/episodic_return,diag/approx_kl,diag/clipfrac,diag/explained_variance,losses/policy,note
512,,0.004,0.02,-0.3,0.01,
1024,12.5,0.011,0.08,0.1,0.02,warmup
1536,,0.025,0.15,0.35,-0.01,
2048,30.0,nan,0.22,0.5,0.0,
2560,55.5,0.15,0.41,,0.03,
3072,80.0,0.018,0.19,0.8,-0.02,
"""


def _write_metrics(tmp_path, text=METRICS_CSV):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    path = run_dir / "metrics.csv"
    path.write_text(text)
    return path


def test_read_metrics_turns_empty_cells_into_nan(tmp_path):
    cols = read_metrics(_write_metrics(tmp_path))
    assert cols["global_step"] == [512.0, 1024.0, 1536.0, 2048.0, 2560.0, 3072.0]
    ret = cols["charts/episodic_return"]
    assert math.isnan(ret[0]) and ret[1] == 12.5 and math.isnan(ret[2]) and ret[5] == 80.0
    assert math.isnan(cols["diag/approx_kl"][3])  # "nan" literal
    assert math.isnan(cols["diag/explained_variance"][4])  # empty
    assert math.isnan(cols["note"][1])  # non-numeric text


def test_plot_curves_writes_png(tmp_path):
    out = tmp_path / "curves.png"
    assert plot_curves(_write_metrics(tmp_path), out) == str(out)
    _assert_png(out)


def test_plot_curves_with_alerts_and_missing_columns(tmp_path):
    csv_path = _write_metrics(tmp_path, "global_step,diag/approx_kl\n100,0.01\n200,\n300,0.2\n")
    alerts = [
        (300, "approx KL 0.2 > 0.1"),
        {"global_step": 200, "message": "clip fraction high"},
        {"step": 150, "kind": "ev"},
        {"message": "no step: skipped"},
    ]
    out = tmp_path / "curves.png"
    plot_curves(csv_path, out, alerts=alerts)
    _assert_png(out)


def test_plot_curves_needs_global_step(tmp_path):
    with pytest.raises(ValueError, match="global_step"):
        plot_curves(_write_metrics(tmp_path, "step,diag/approx_kl\n1,0.1\n"), tmp_path / "x.png")


def test_alert_marks_normalization():
    class Alert:
        global_step = 42
        message = "kl spike"

    logger_record = {"step": 30, "level": "alert", "name": "kl_blowup", "message": "approx KL 0.2 > 0.1", "data": {}}
    marks = _alert_marks([(10, "a"), {"step": 20, "name": "b"}, logger_record, Alert(), {"message": "no step"}])
    assert marks == [(10.0, "a"), (20.0, "b"), (30.0, "kl_blowup"), (42.0, "kl spike")]
    assert _alert_marks(None) == []
