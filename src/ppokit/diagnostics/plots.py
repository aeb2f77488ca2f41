"""Figures: the clipped PPO objective (Schulman et al. 2017, figure 1) and the training-diagnostics panel of a run.

matplotlib is imported inside the functions, and figures are drawn on an Agg canvas without ``pyplot``, so
importing this module is cheap, nothing depends on a display, and the caller's global backend is left alone.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

from ppokit.core import schema as S

__all__ = ["objective_figure", "plot_curves", "read_metrics", "run_title", "PLAIN_TEXT"]

# Text properties for every string that comes from a run (env ids, alert names and messages, titles): drawn as
# plain text, never parsed as mathtext or LaTeX, so "$\undefinedmacro{x$" in an alert is shown, not a crash.
PLAIN_TEXT = {"parse_math": False, "usetex": False}

# Thresholds drawn on the diagnostics panel (see README, "The math"), the monitor's own (schema.py): approx KL
# above ~0.02 means large policy steps for the usual clip of 0.2, above ~0.1 the update is off the trust region;
# a clip fraction of 0.1-0.3 is the usual healthy band.
KL_WARN = S.KL_WARN
KL_ALARM = S.KL_ALERT
CLIPFRAC_BAND = S.CLIPFRAC_HEALTHY

_PANELS = (
    (S.EPISODIC_RETURN, "episodic return"),
    (S.APPROX_KL, "approx KL (k3)"),
    (S.CLIPFRAC, "clip fraction"),
    (S.EXPLAINED_VARIANCE, "explained variance"),
)


def _new_figure(**kwargs: Any):
    """A matplotlib Figure on its own Agg canvas (no pyplot state, no GUI)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str | os.PathLike) -> str:
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def objective_figure(eps: float = 0.2, path: str | os.PathLike = "objective.png") -> str:
    """Draw the clipped surrogate ``min(r*A, clip(r, 1-eps, 1+eps)*A)`` over ``r`` in [0.5, 1.5]; return the path.

    Two panels, A = +1 and A = -1. Each shows the objective (solid), the unclipped ``r*A`` (dashed), the clip
    boundaries ``1 +- eps`` (vertical lines) and, shaded, the region where the objective is flat in ``r`` and
    so gives ``logp_new`` no gradient: ``r > 1+eps`` for A > 0, ``r < 1-eps`` for A < 0.
    """
    if not 0.0 < eps < 0.5:
        raise ValueError(f"eps must be in (0, 0.5) to fit the plotted ratio range [0.5, 1.5], got {eps}")
    from ppokit.core.objectives import ppo_objective

    lo, hi, n = 0.5, 1.5, 401
    ratios = [lo + (hi - lo) * i / (n - 1) for i in range(n)]
    fig = _new_figure(figsize=(9.0, 3.8), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for ax, advantage in zip(axes, (1.0, -1.0)):
        objective = [ppo_objective(math.log(r), 0.0, advantage, eps) for r in ratios]
        if advantage > 0:
            flat, flat_label = (1.0 + eps, hi), f"zero gradient (r > 1+{eps:g})"
        else:
            flat, flat_label = (lo, 1.0 - eps), f"zero gradient (r < 1-{eps:g})"
        ax.axvspan(*flat, color="tab:red", alpha=0.12, lw=0, label=flat_label)
        ax.plot(ratios, [r * advantage for r in ratios], ls="--", color="0.45", lw=1.2, label="unclipped r·A")
        ax.plot(ratios, objective, color="tab:blue", lw=2.2, label="min(r·A, clip(r)·A)")
        for x, name in ((1.0 - eps, "1−ε"), (1.0 + eps, "1+ε")):
            ax.axvline(x, color="0.2", ls=":", lw=1.0)
            ax.annotate(name, (x, 0.02), xycoords=("data", "axes fraction"), ha="center", fontsize=8,
                        backgroundcolor="white")
        ax.axvline(1.0, color="0.75", lw=0.8)
        ax.axhline(0.0, color="0.75", lw=0.8)
        ax.set_xlim(lo, hi)
        ax.set_xlabel(r"probability ratio $r = \pi_\theta(a|s)\,/\,\pi_{\mathrm{old}}(a|s)$")
        ax.set_title(f"A {'> 0' if advantage > 0 else '< 0'} (A = {advantage:+g})")
        ax.legend(loc="center right", fontsize=8, framealpha=0.9, edgecolor="none")
        ax.grid(alpha=0.25)
    axes[0].set_ylabel("surrogate objective (maximized)")
    fig.suptitle(f"PPO clipped surrogate, ε = {eps:g} (clip range [{1 - eps:g}, {1 + eps:g}])")
    return _save(fig, path)


def _to_float(text: str | None) -> float:
    """A CSV cell as a float; empty or unparsable cells (no episode finished, a string column) become NaN."""
    if text is None:
        return math.nan
    text = text.strip()
    if not text:
        return math.nan
    try:
        return float(text)
    except ValueError:
        return math.nan


def read_metrics(metrics_csv_path: str | os.PathLike) -> dict[str, list[float]]:
    """Read a run's ``metrics.csv`` into ``{column: [float, ...]}`` (every column, NaN for missing cells)."""
    with open(metrics_csv_path, newline="") as fh:
        reader = csv.DictReader(fh)
        columns: dict[str, list[float]] = {name: [] for name in (reader.fieldnames or [])}
        for row in reader:
            for name in columns:
                columns[name].append(_to_float(row.get(name)))
    return columns


def _finite_xy(xs: list[float], ys: list[float]) -> tuple[list[float], list[float]]:
    pairs = [(x, y) for x, y in zip(xs, ys) if math.isfinite(x) and math.isfinite(y)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _alert_marks(alerts: Iterable[Any] | None) -> list[tuple[float, str]]:
    """Normalize alerts to ``(global_step, label)``.

    An alert is a ``(step, label)`` pair, or a mapping / object with ``global_step`` (or ``step``) and a label
    taken from ``name``, else ``kind``, else ``message`` (the short rule name reads best on a plot), such as the
    records of ``ppokit.runtime.logger`` (``{"step", "level", "name", "message", ...}``). Alerts without a step are skipped.
    """
    marks: list[tuple[float, str]] = []
    for alert in alerts or ():
        if isinstance(alert, (tuple, list)) and len(alert) >= 2:
            step, label = alert[0], alert[1]
        else:
            get = alert.get if isinstance(alert, Mapping) else (lambda key, a=alert: getattr(a, key, None))
            step = get(S.GLOBAL_STEP)
            if step is None:
                step = get("step")
            label = next((get(k) for k in ("name", "kind", "message") if get(k) is not None), "")
        try:
            marks.append((float(step), str(label)))
        except (TypeError, ValueError):
            continue
    return marks


def run_title(run_dir: str | os.PathLike) -> str:
    """``CartPole-v1 · ppo · seed 1 · <run dir name>`` from the run's ``config.toml`` (prefixed ``UNSAFE run:``
    when the run is stamped unsafe); just the directory's name when there is no readable config."""
    import tomllib

    run_dir = os.path.abspath(os.fspath(run_dir))
    name = os.path.basename(run_dir) or "training run"
    config: dict[str, Any] = {}
    try:
        with open(os.path.join(run_dir, "config.toml"), "rb") as fh:
            config = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        pass
    parts = [str(config[k]) if k != "seed" else f"seed {config[k]}" for k in ("env_id", "algo", "seed")
             if k in config]
    unsafe = bool(config.get("unsafe")) or os.path.exists(os.path.join(run_dir, "UNSAFE"))
    return ("UNSAFE run: " if unsafe else "") + " · ".join(parts + [name])


def plot_curves(
    metrics_csv_path: str | os.PathLike,
    out_png: str | os.PathLike,
    alerts: Iterable[Any] | None = None,
    title: str | None = None,
) -> str:
    """A 2x2 diagnostics figure from a training run's ``metrics.csv``; returns the PNG path.

    Panels, each against ``global_step`` (environment steps): episodic return, approx KL (lines at 0.02 and
    0.1), clip fraction (healthy band 0.1-0.3 shaded) and explained variance. Empty or NaN cells are skipped,
    a missing column leaves its panel with a "no data" note. ``alerts`` (see ``_alert_marks``) are drawn as
    vertical lines on every panel. ``title`` (default: ``run_title`` of the directory holding the CSV: env id,
    algo, seed, run dir name) heads the figure. Every run-supplied string is drawn as plain text (``PLAIN_TEXT``).
    """
    columns = read_metrics(metrics_csv_path)
    if S.GLOBAL_STEP not in columns:
        raise ValueError(f"{os.fspath(metrics_csv_path)}: no '{S.GLOBAL_STEP}' column (got {sorted(columns)})")
    steps = columns[S.GLOBAL_STEP]
    marks = _alert_marks(alerts)

    fig = _new_figure(figsize=(10.0, 7.0), layout="constrained")
    axes = fig.subplots(2, 2, sharex=True)
    # (The panel names are not ``title``: reusing that name once made the figure's title "explained variance".)
    for ax, (column, panel) in zip(axes.flat, _PANELS):
        xs, ys = _finite_xy(steps, columns.get(column, []))
        if xs:
            ax.plot(xs, ys, color="tab:blue", lw=1.4, marker="." if len(xs) < 30 else None)
        else:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="0.5")
        if column == S.APPROX_KL:
            ax.axhline(KL_WARN, color="tab:orange", ls="--", lw=1.0, label=f"{KL_WARN:g}")
            ax.axhline(KL_ALARM, color="tab:red", ls="--", lw=1.0, label=f"{KL_ALARM:g}")
            ax.legend(loc="best", fontsize=8, framealpha=0.9, edgecolor="none")
        elif column == S.CLIPFRAC:
            ax.axhspan(*CLIPFRAC_BAND, color="tab:green", alpha=0.12, lw=0,
                       label=f"healthy {CLIPFRAC_BAND[0]:g}–{CLIPFRAC_BAND[1]:g}")
            ax.legend(loc="best", fontsize=8, framealpha=0.9, edgecolor="none")
        elif column == S.EXPLAINED_VARIANCE:
            ax.axhline(1.0, color="0.6", ls=":", lw=0.8)
            ax.axhline(0.0, color="0.6", ls=":", lw=0.8)
        for step, label in marks:
            ax.axvline(step, color="tab:red", alpha=0.5, lw=0.9)
            if label and column == _PANELS[0][0]:
                ax.annotate(label, (step, 1.0), xycoords=("data", "axes fraction"), rotation=90,
                            va="top", ha="right", fontsize=7, color="tab:red", **PLAIN_TEXT)
        ax.set_title(panel)
        ax.set_ylabel(column)
        ax.grid(alpha=0.25)
    for ax in axes[1]:
        ax.set_xlabel("environment steps")
    if title is None:
        title = run_title(os.path.dirname(os.path.abspath(metrics_csv_path)))
    fig.suptitle(title, **PLAIN_TEXT)
    return _save(fig, out_png)
