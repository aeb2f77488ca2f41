"""Run-supplied text in figures is plain text: an alert or env id that matplotlib's mathtext cannot parse
(``$\\undefinedmacro{x$``) is drawn as it is, and ``ppokit report`` exits 0 with the HTML escaped. curves.png is
titled by the run (env id, algo, seed, run dir name), not by its last panel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ppokit.cli import main
from ppokit.diagnostics import plots

BAD_TEXT = r"$\undefinedmacro{x$"


def make_run(root: Path, unsafe: bool = False) -> Path:
    """A run dir named with a ``$``, an env id with mathtext in it, and alerts.jsonl holding unparsable text
    (plus lines a hand edit might leave: a list, a step that is not a number)."""
    run_dir = root / "run$dollar"
    run_dir.mkdir()
    (run_dir / "metrics.csv").write_text(
        "global_step,update,charts/episodic_return,diag/approx_kl,diag/clipfrac,diag/explained_variance\n"
        "128,1,10.0,0.01,0.1,0.2\n256,2,12.0,0.02,0.15,0.4\n384,3,15.0,0.015,0.12,0.5\n")
    (run_dir / "config.toml").write_text(
        f'env_id = {json.dumps("Cart$Pole-" + BAD_TEXT)}\nalgo = "ppo"\nseed = 3\nunsafe = {str(unsafe).lower()}\n')
    alerts = [{"step": 256, "level": "alert", "name": "kl_" + BAD_TEXT, "message": "spike " + BAD_TEXT + " <b>x</b>"},
              {"step": 300, "level": "warn", "name": BAD_TEXT, "message": BAD_TEXT}]
    lines = [json.dumps(a) for a in alerts] + ["[1, 2]", json.dumps({"step": "abc", "name": "odd"})]
    (run_dir / "alerts.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def test_report_renders_unparsable_mathtext_as_plain_text(tmp_path, capsys):
    run_dir = make_run(tmp_path)
    code = main(["report", str(run_dir)])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "Traceback" not in out.out + out.err
    page = (run_dir / "report.html").read_text(encoding="utf-8")
    # The alert message and env id arrive verbatim, HTML-escaped (the tag is text, not markup).
    assert "spike " + BAD_TEXT + " &lt;b&gt;x&lt;/b&gt;" in page
    assert "<b>x</b>" not in page
    assert "Cart$Pole-" + BAD_TEXT in page


def test_report_of_unreadable_metrics_is_one_line(tmp_path, capsys):
    run_dir = make_run(tmp_path)
    (run_dir / "metrics.csv").write_bytes(b"\xff\xfe\x00binary\x00")
    code = main(["report", str(run_dir)])
    out = capsys.readouterr()
    assert code == 2
    assert "Traceback" not in out.err
    assert out.err.startswith(f"error: cannot read the run in {run_dir}")


@pytest.fixture
def captured(monkeypatch):
    """Every Figure matplotlib saves, saved for real (so text must render) and kept for inspection."""
    from matplotlib.figure import Figure

    figures = []
    savefig = Figure.savefig

    def keep(fig, *args, **kwargs):
        figures.append(fig)
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return figures


@pytest.mark.parametrize("unsafe", [False, True])
def test_curves_title_names_the_run(tmp_path, captured, unsafe):
    run_dir = make_run(tmp_path, unsafe=unsafe)
    alerts = [json.loads(x) for x in (run_dir / "alerts.jsonl").read_text().splitlines()[:2]]
    out = plots.plot_curves(run_dir / "metrics.csv", run_dir / "curves.png", alerts=alerts)
    assert Path(out).stat().st_size > 0
    title = captured[0]._suptitle.get_text()
    expected = f"Cart$Pole-{BAD_TEXT} · ppo · seed 3 · run$dollar"
    assert title == ("UNSAFE run: " if unsafe else "") + expected
    assert plots.run_title(run_dir) == title
    # Alert labels are annotated verbatim on the return panel.
    texts = {t.get_text() for t in captured[0].axes[0].texts}
    assert "kl_" + BAD_TEXT in texts


def test_curves_title_without_config_is_the_dir_name(tmp_path, captured):
    run_dir = make_run(tmp_path)
    (run_dir / "config.toml").unlink()
    plots.plot_curves(run_dir / "metrics.csv", run_dir / "curves.png")
    assert captured[0]._suptitle.get_text() == "run$dollar"
    plots.plot_curves(run_dir / "metrics.csv", run_dir / "curves2.png", title="given $\\x$ title")
    assert captured[1]._suptitle.get_text() == "given $\\x$ title"
