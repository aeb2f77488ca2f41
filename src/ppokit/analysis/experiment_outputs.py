"""The outputs of a multi-seed experiment: the figures (returns, KL, clip fraction, beta, stability), the summary CSV
and the console table, drawn from ``experiment_stats.SettingResult``s and ``experiments.summarize`` rows.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ppokit.analysis.experiment_stats import SettingResult, interpolate_curves, t_quantile_975
from ppokit.core import schema as S
from ppokit.core.algos import ALGOS

KL_WARN = S.KL_WARN  # approx KL above this: large policy steps for eps = 0.2
KL_EXPLODED = S.KL_ALERT  # above this the update has left the trust region ("KL blew up")

__all__ = ["plot_returns", "plot_kl", "plot_clipfrac", "plot_beta", "plot_stability", "adapts_kl_beta",
           "write_summary_csv", "summary_table"]

_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray",
           "tab:olive", "tab:cyan")


def _figure(title: str, ylabel: str, xlabel: str = "environment steps"):
    from ppokit.diagnostics.plots import _new_figure

    fig = _new_figure(figsize=(7.0, 4.2), dpi=100, layout="constrained")
    ax = fig.subplots()
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.25)
    return fig, ax


def _band(ax, grid: np.ndarray, rows: np.ndarray, color: str, label: str, log: bool = False) -> None:
    n = np.sum(np.isfinite(rows), axis=0)
    mean = np.nanmean(rows, axis=0) if rows.size else rows
    ax.plot(grid, mean, color=color, lw=1.6, label=label)
    if rows.shape[0] > 1:
        std = np.nanstd(rows, axis=0, ddof=1)
        t = np.array([t_quantile_975(int(k) - 1) if k > 1 else np.nan for k in n])
        half = t * std / np.sqrt(np.maximum(n, 1))
        lo = mean - half
        if log:
            lo = np.maximum(lo, mean * 0.05)
        ax.fill_between(grid, lo, mean + half, color=color, alpha=0.18, lw=0)


def plot_returns(results: Sequence[SettingResult], path: Path, title: str, threshold: float | None = None) -> Path:
    """Mean episodic return vs env steps per setting, shaded 95% CI over seeds (common interpolated step grid)."""
    fig, ax = _figure(title, "episodic return")
    lo, hi = math.inf, -math.inf
    for i, res in enumerate(results):
        if not res.seeds:
            continue
        grid, rows = interpolate_curves([(s.steps, s.returns) for s in res.seeds])
        if grid.size:
            _band(ax, grid, rows, _COLORS[i % len(_COLORS)], f"{res.setting} (n={len(res.seeds)})")
            if np.isfinite(rows).any():
                lo, hi = min(lo, float(np.nanmin(rows))), max(hi, float(np.nanmax(rows)))
    if threshold is not None and math.isfinite(lo):
        lo, hi = min(lo, threshold), max(hi, threshold)
    if math.isfinite(lo) and hi > lo:
        # Axis limits follow the seeds' own range: with few seeds the t-based band can be much wider.
        pad = 0.05 * (hi - lo)
        ax.set_ylim(lo - pad, hi + pad)
    if threshold is not None:
        ax.axhline(threshold, color="0.3", ls=":", lw=1.0, label=f"threshold {threshold:g}")
    ax.legend(fontsize=8, loc="best")
    fig.savefig(path, format="png")
    return path


def _per_update(results: Sequence[SettingResult], attr: str, path: Path, title: str, ylabel: str,
                log: bool, hlines: Sequence[tuple[float, str, str]] = ()) -> Path:
    fig, ax = _figure(title, ylabel)
    for i, res in enumerate(results):
        if not res.seeds:
            continue
        n = min(len(s.steps) for s in res.seeds)
        grid = np.asarray(res.seeds[0].steps[:n], dtype=np.float64)
        rows = np.vstack([np.asarray(getattr(s, attr)[:n], dtype=np.float64) for s in res.seeds])
        if log:
            rows = np.where(rows > 0, rows, np.nan)
        if np.isfinite(rows).any():
            _band(ax, grid, rows, _COLORS[i % len(_COLORS)], res.setting, log=log)
    for y, color, label in hlines:
        ax.axhline(y, color=color, ls="--", lw=1.0, label=label)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=8, loc="best")
    fig.savefig(path, format="png")
    return path


def plot_kl(results: Sequence[SettingResult], path: Path, title: str) -> Path:
    """Mean KL of each update (k3, after the update vs before, whole batch; log scale, 95% CI band), lines at
    0.02 and 0.1."""
    return _per_update(results, "kl", path, title, "KL moved per update (k3 after vs before, log scale)", True,
                       [(KL_WARN, "tab:orange", f"{KL_WARN:g} (large step)"),
                        (KL_EXPLODED, "tab:red", f"{KL_EXPLODED:g} (blown up)")])


def plot_clipfrac(results: Sequence[SettingResult], path: Path, title: str) -> Path:
    """Mean clip fraction (share of samples with |r-1| > eps) per update per setting."""
    return _per_update(results, "clipfrac", path, title, "clip fraction per update", False)


def adapts_kl_beta(algo: str) -> bool:
    """True for an algo whose penalty beta moves between updates (ppo-kl): only its runs have a beta curve. A
    sweep read back from disk may name an algo this process has not registered; it has no curve."""
    registered = ALGOS.get(algo)
    return registered is not None and registered.adapts_kl_beta


def plot_beta(results: Sequence[SettingResult], path: Path, title: str) -> Path:
    """PPO-KL's adaptive penalty coefficient beta per update (log scale), ppo-kl settings only."""
    kl_only = [r for r in results if adapts_kl_beta(r.algo)]
    return _per_update(kl_only, "kl_beta", path, title, "KL penalty beta (log scale)", True)


def plot_stability(rows: Sequence[dict[str, Any]], path: Path, title: str) -> Path:
    """Bar per setting of the mean stability (std of return over the last 20%), seeds drawn as points."""
    fig, ax = _figure(title, "std of episodic return, last 20% of updates", xlabel="")
    rng = np.random.default_rng(0)
    for i, row in enumerate(rows):
        vals = [v for v in row["per_seed_stability"] if math.isfinite(v)]
        color = _COLORS[i % len(_COLORS)]
        ax.bar(i, np.mean(vals) if vals else 0.0, color=color, alpha=0.45, width=0.6)
        ax.scatter(i + rng.uniform(-0.12, 0.12, len(vals)), vals, color=color, edgecolor="black", s=22, zorder=3)
    ax.set_xticks(range(len(rows)), [r["setting"] for r in rows])
    fig.savefig(path, format="png")
    return path


# ====================================================================== outputs
_CSV_SKIP = ("per_seed_final", "per_seed_steps", "per_seed_stability")


def write_summary_csv(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """``summary.csv``: one row per setting (swept values as columns, per-seed lists left out)."""
    cols: list[str] = []
    for row in rows:
        for k in row:
            if k not in cols and k not in _CSV_SKIP:
                cols.append(k)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        for row in rows:
            w.writerow([_csv_cell(row.get(c, "")) for c in cols])
    return path


def _csv_cell(v: Any) -> str:
    if isinstance(v, float):
        return "" if math.isnan(v) else repr(v)
    if isinstance(v, list):
        return ",".join(map(str, v))
    return str(v)


def _pm(mean: float, ci: float, fmt: str = ".3g") -> str:
    if not math.isfinite(mean):
        return "–"
    return f"{mean:{fmt}}" + (f" ± {ci:{fmt}}" if math.isfinite(ci) else "")


def summary_table(rows: Sequence[dict[str, Any]], title: str, compare: bool = False):
    """The rich table printed at the end of a sweep / compare."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("setting")
    table.add_column("final return\n(mean ± 95% CI)", justify="right")
    table.add_column("steps to threshold\n(median; reached)", justify="right")
    table.add_column("max KL", justify="right")
    table.add_column(f"KL > {KL_EXPLODED:g}\n(seeds)", justify="right")
    if compare:
        table.add_column("stability\n(std, last 20%)", justify="right")
        table.add_column("no clipping\nneeded (updates)", justify="right")
    for r in rows:
        med = r["steps_to_threshold_median"]
        steps = med if isinstance(med, str) else f"{med:,.0f}"
        cells = [r["setting"], _pm(r["final_return_mean"], r["final_return_ci95"]),
                 f"{steps} ({r['reached_seeds']}/{r['n_seeds']})", f"{r['max_kl']:.3g}",
                 f"{'yes' if r['kl_exploded'] else 'no'} ({r['kl_exploded_seeds']}/{r['n_seeds']})"]
        if compare:
            cells += [_pm(r["stability_std_mean"], r["stability_std_ci95"]), f"{r['no_clip_update_frac']:.0%}"]
        table.add_row(*cells)
    return table
