"""``ppokit report``: one self-contained HTML page per run (no JavaScript, images embedded as base64 PNG).

Sections: an UNSAFE banner when the run is stamped, a note when its checkpoint cannot be read, the doctor's
verdict (healthy, problem or too short to judge) and findings, the training curves (return, approx KL with its
warn/alert lines, clip fraction with its healthy band and drift line, explained variance, entropy, learning rate,
SPS; thresholds from ``schema.py``), the alerts on a timeline plus their table, and the config table.
"""

from __future__ import annotations

import base64
import html
import io
import math
from pathlib import Path

from ppokit.analysis.doctor import Diagnosis, diagnose, load_run
from ppokit.analysis.doctor_lm import is_lm_run, lm_curves
from ppokit.core import schema as S
from ppokit.diagnostics.plots import CLIPFRAC_BAND, KL_ALARM, KL_WARN, PLAIN_TEXT, _new_figure

__all__ = ["build_report", "write_report", "CURVES"]

# (column, title, y label)
CURVES = (
    (S.EPISODIC_RETURN, "Episodic return", "return"),
    (S.APPROX_KL, "Approx KL (k3)", "KL"),
    (S.CLIPFRAC, "Clip fraction", "fraction"),
    (S.EXPLAINED_VARIANCE, "Explained variance", "EV"),
    (S.ENTROPY, "Policy entropy", "nats"),
    (S.LEARNING_RATE, "Learning rate", "LR"),
    (S.SPS, "Steps per second", "SPS"),
)
_LEVEL_COLORS = {"alert": "tab:red", "warn": "tab:orange"}

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1200px;
color:#222;background:#fff}
h1{font-size:1.5em;margin-bottom:4px}h2{border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:28px}
.unsafe-banner{background:#b00020;color:#fff;font-weight:bold;padding:12px 16px;font-size:1.2em;border-radius:4px}
.verdict{padding:10px 14px;border-radius:4px;font-weight:bold}
.healthy{background:#e6f4ea;color:#1e6b2f}.problem{background:#fdecea;color:#8a1c12}
.too_short{background:#fff4e0;color:#7a4b00}
.ckpt-note{background:#fff4e0;color:#7a4b00;font-weight:bold;padding:10px 14px;border-radius:4px;margin:8px 0}
.plots{display:grid;grid-template-columns:repeat(2,1fr);gap:12px}
.plots figure{margin:0;border:1px solid #eee;padding:6px}.plots img{width:100%;height:auto}
figcaption{font-size:.85em;color:#555}
table{border-collapse:collapse;font-size:.9em}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
th{background:#f6f6f6}.finding{margin-bottom:12px}.fix{color:#1a4d8f}
"""


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _curve(steps: list[float], ys: list[float], column: str, title: str, ylabel: str, alerts: list[dict],
           xlabel: str = "environment steps") -> str:
    fig = _new_figure(figsize=(6.0, 3.2), layout="constrained")
    ax = fig.subplots()
    pts = [(x, y) for x, y in zip(steps, ys) if math.isfinite(x) and math.isfinite(y)]
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color="tab:blue", lw=1.4,
                marker="." if len(pts) < 30 else None)
    else:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="0.5")
    if column == S.APPROX_KL:
        ax.axhline(KL_WARN, color="tab:orange", ls="--", lw=1, label=f"warn {KL_WARN:g}")
        ax.axhline(KL_ALARM, color="tab:red", ls="--", lw=1, label=f"alert {KL_ALARM:g}")
        if pts and max(p[1] for p in pts) > 10 * KL_ALARM:
            ax.set_yscale("symlog", linthresh=KL_WARN)
            ax.set_ylim(bottom=0)
        ax.legend(fontsize=8, loc="best")
    elif column == S.CLIPFRAC:
        ax.axhspan(*CLIPFRAC_BAND, color="tab:green", alpha=0.15, lw=0,
                   label=f"healthy {CLIPFRAC_BAND[0]:g}-{CLIPFRAC_BAND[1]:g}")
        ax.axhline(S.CLIPFRAC_HIGH, color="tab:red", ls="--", lw=1, label=f"drift {S.CLIPFRAC_HIGH:g}")
        ax.legend(fontsize=8, loc="best")
    elif column == S.EXPLAINED_VARIANCE:
        ax.axhline(1.0, color="0.6", ls=":", lw=0.8)
        ax.axhline(0.0, color="0.6", ls=":", lw=0.8)
    for a in alerts:
        if a.get("level") == "alert":
            ax.axvline(float(a.get("step", 0)), color="tab:red", alpha=0.25, lw=0.8)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.25)
    return _png(fig)


def _timeline(alerts: list[dict], max_step: float) -> str:
    fig = _new_figure(figsize=(12.0, 1.2 + 0.3 * max(1, len({a.get('name') for a in alerts}))), layout="constrained")
    ax = fig.subplots()
    names = sorted({str(a.get("name")) for a in alerts})
    for a in alerts:
        ax.scatter([float(a.get("step", 0))], [names.index(str(a.get("name")))], marker="v", s=50,
                   color=_LEVEL_COLORS.get(a.get("level"), "tab:purple"))
    # Alert names come from the run's files: plain text, so a "$...$" in one is shown rather than parsed.
    ax.set_yticks(range(len(names)), names, **PLAIN_TEXT) if names else ax.set_yticks([])
    if not names:
        ax.text(0.5, 0.5, "no alerts", transform=ax.transAxes, ha="center", va="center", color="0.4")
    ax.set_xlim(0, max(max_step, 1.0))
    ax.set_ylim(-0.7, max(len(names), 1) - 0.3)
    ax.set_xlabel("environment steps")
    ax.set_title("alerts (red: alert, orange: warn)")
    ax.grid(alpha=0.25, axis="x")
    return _png(fig)


def _esc(x) -> str:
    return html.escape(str(x))


def _clean_alerts(alerts: list) -> list[dict]:
    """The alert records fit to draw: objects whose step is a finite number (a hand-edited or damaged
    alerts.jsonl may hold lists, strings, or steps like "abc"; those are left out rather than crash the report)."""
    clean = []
    for a in alerts:
        if not isinstance(a, dict):
            continue
        try:
            step = float(a.get("step", 0))
        except (TypeError, ValueError):
            continue
        if math.isfinite(step):
            clean.append({**a, "step": step})
    return clean


REPORT_SAMPLES = 12  # the last rows of completions.jsonl the report shows


def _samples_section(run_dir: Path) -> list[str]:
    """A LM run's last sample completions (``completions.jsonl``) as a table: reward hacking shows in the text."""
    from ppokit.lm.samples import read_samples

    rows = read_samples(run_dir, last=REPORT_SAMPLES)
    out = ['<h2 id="completions">Sample completions (completions.jsonl)</h2>']
    if not rows:
        return out + ["<p>No completions were recorded (a DPO, SFT or reward-model run samples none).</p>"]
    keys = [k for k in rows[0] if k not in ("iteration", "prompt", "completion")]
    out.append("<table><tr><th>iteration</th><th>prompt</th><th>completion</th>"
               + "".join(f"<th>{_esc(k)}</th>" for k in keys) + "</tr>")
    for r in rows:
        cells = "".join(f"<td>{_esc(r.get(k))}</td>" for k in keys)
        out.append(f"<tr><td>{_esc(r.get('iteration'))}</td><td><code>{_esc(r.get('prompt'))}</code></td>"
                   f"<td><code>{_esc(r.get('completion'))}</code></td>{cells}</tr>")
    out.append("</table>")
    return out


def build_report(run_dir: str | Path, diagnosis: Diagnosis | None = None) -> str:
    """The report of ``run_dir`` as one HTML string (no scripts, no external resources)."""
    run = load_run(run_dir)
    diag = diagnosis or diagnose(run_dir)
    alerts = _clean_alerts(run.alerts)
    # A language-model run (ppokit.lm) is plotted per iteration, with the LM curves it logged (doctor_lm).
    lm = is_lm_run(run)
    curves, xlabel = (lm_curves(run), "iteration") if lm else (CURVES, "environment steps")
    steps = run.col(S.UPDATE if lm else S.GLOBAL_STEP)
    max_step = max([s for s in steps if math.isfinite(s)] or [0.0])
    env_id = run.config.get("env_id", "language model" if lm else "?")
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>ppokit report: {_esc(env_id)} ({_esc(Path(run_dir).name)})</title>",
             f"<style>{_CSS}</style></head><body>"]
    if run.unsafe:
        reasons = ""
        if (run.run_dir / "UNSAFE").is_file():
            reasons = "<br>" + "<br>".join(_esc(x) for x in (run.run_dir / "UNSAFE").read_text().splitlines()[1:] if x)
        parts.append(f'<div class="unsafe-banner" id="unsafe">UNSAFE run: started with --unsafe, outside the '
                     f"trust-region guard rails; treat it as an ablation.{reasons}</div>")
    parts.append(f"<h1>{'UNSAFE run: ' if run.unsafe else ''}{_esc(env_id)}</h1>")
    size = f"{len(run.updates)} iterations" if lm else (f"{len(run.updates)} updates, {int(max_step):,} "
                                                         "environment steps")
    parts.append(f"<p>Run directory <code>{_esc(run.run_dir)}</code>: {size}, "
                 f"algo {_esc(run.config.get('algo', '?'))}.</p>")
    if run.checkpoint_error is not None:
        parts.append(f'<div class="ckpt-note" id="checkpoint-unreadable">Checkpoint unreadable: '
                     f"{_esc(run.checkpoint_error)}. The curves and the diagnosis below are read from metrics.csv."
                     "</div>")

    # Doctor
    cls = diag.verdict
    parts.append('<h2 id="doctor">Diagnosis (ppokit doctor)</h2>')
    parts.append(f'<div class="verdict {cls}">{_esc(diag.summary)}</div>')
    if diag.checks:
        parts.append("<p>Clip fraction ~0 and return flat: checked in this order (docs/diagnostics.md)</p><ul>"
                     + "".join(f"<li>{_esc(c)}</li>" for c in diag.checks) + "</ul>")
    parts.append("<ol>")
    for f in diag.findings:
        tag = "PROBLEM" if f.severity == "problem" else "note"
        parts.append(f'<li class="finding"><b>[{tag}] {_esc(f.title)}</b> <code>{_esc(f.cause)}</code><ul>'
                     + "".join(f"<li>{_esc(e)}</li>" for e in f.evidence)
                     + f'</ul><span class="fix">fix: {_esc(f.fix)}</span></li>')
    parts.append("</ol>")

    # Curves
    parts.append('<h2 id="curves">Training curves</h2><div class="plots">')
    for column, title, ylabel in curves:
        img = _curve(steps, run.col(column), column, title, ylabel, alerts, xlabel)
        slug = column.replace("/", "-")
        parts.append(f'<figure class="plot" id="plot-{slug}"><img alt="{_esc(title)}" '
                     f'src="data:image/png;base64,{img}"><figcaption>{_esc(title)} ({_esc(column)})</figcaption></figure>')
    parts.append("</div>")

    if lm:
        parts += _samples_section(run.run_dir)

    # Alerts
    parts.append('<h2 id="alerts">Alerts</h2>')
    parts.append(f'<figure class="plot" id="plot-alerts"><img alt="alert timeline" style="width:100%" '
                 f'src="data:image/png;base64,{_timeline(alerts, max_step)}"></figure>')
    if alerts:
        parts.append("<table><tr><th>step</th><th>level</th><th>name</th><th>message</th></tr>"
                     + "".join(f"<tr><td>{int(a.get('step', 0)):,}</td><td>{_esc(a.get('level'))}</td>"
                               f"<td>{_esc(a.get('name'))}</td><td>{_esc(a.get('message'))}</td></tr>"
                               for a in alerts) + "</table>")
    else:
        parts.append("<p>No alerts were raised.</p>")

    # Config
    parts.append('<h2 id="config">Config</h2><table><tr><th>field</th><th>value</th></tr>')
    parts += [f"<tr><td>{_esc(k)}</td><td>{_esc(v)}</td></tr>" for k, v in run.config.items()]
    parts.append("</table></body></html>")
    return "\n".join(parts) + "\n"


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the report (default ``RUN_DIR/report.html``); returns its path."""
    out = Path(out) if out else Path(run_dir) / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(build_report(run_dir), encoding="utf-8")
    return out
