"""Statistics over seeds for multi-seed experiments: confidence intervals, steps to a threshold, tails, curves.

The per-seed curves they read (``SeedCurves``, ``SettingResult``) and pure functions of numbers (no runs, no files); ``experiments`` documents the rules they implement and uses them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

__all__ = ["REACH_WINDOW", "SeedCurves", "SettingResult", "t_quantile_975", "mean_ci", "steps_to_threshold", "tail_mean", "tail_std",
           "interpolate_curves"]

@dataclass
class SeedCurves:
    """The per-update columns of one run that the aggregates need."""

    seed: int
    steps: list[float]
    returns: list[float]
    episodes: list[float]
    kl: list[float]  # diag/approx_kl_after: the KL each update moved the policy by
    clipfrac: list[float]
    kl_beta: list[float]


@dataclass
class SettingResult:
    """All seeds of one setting."""

    setting: str
    overrides: dict[str, Any]
    algo: str
    seeds: list[SeedCurves] = field(default_factory=list)


REACH_WINDOW = 5  # updates averaged when deciding that a run reached the return threshold

# t(0.975, df) for df = 1..30 (standard two-sided 95% table values).
_T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281, 2.2010, 2.1788, 2.1604,
         2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860, 2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555,
         2.0518, 2.0484, 2.0452, 2.0423)


def t_quantile_975(df: int) -> float:
    """Student-t 0.975 quantile for ``df`` degrees of freedom (table up to 30, Cornish-Fisher expansion above)."""
    if df < 1:
        return math.nan
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959963984540054
    # Fourth-order Cornish-Fisher expansion around the normal quantile; error < 1e-5 for df > 30.
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))


def mean_ci(values: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% CI) of the finite values: ``t(0.975, n-1) * std(ddof=1) / sqrt(n)``."""
    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)
    if x.size == 0:
        return math.nan, math.nan
    if x.size == 1:
        return float(x[0]), math.nan
    return float(x.mean()), float(t_quantile_975(x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))


def steps_to_threshold(steps: Sequence[float], returns: Sequence[float], episodes: Sequence[float] | None,
                       threshold: float, window: int = REACH_WINDOW) -> float | None:
    """Env step of the first update whose trailing ``window``-update mean return is >= ``threshold``, else None.

    The mean weights each update's return by its finished-episode count (``episodes``; equal weights if None) and
    skips updates where no episode finished; the window must hold ``window`` updates.
    """
    n = len(steps)
    eps = [1.0] * n if episodes is None else list(episodes)
    for i in range(window - 1, n):
        num = den = 0.0
        for j in range(i - window + 1, i + 1):
            r, e = returns[j], eps[j]
            if math.isfinite(r) and math.isfinite(e) and e > 0:
                num += r * e
                den += e
        if den > 0 and num / den >= threshold:
            return float(steps[i])
    return None


def tail_mean(values: Sequence[float], fraction: float) -> float:
    k = max(1, math.ceil(fraction * len(values)))
    tail = [v for v in values[-k:] if math.isfinite(v)]
    return float(np.mean(tail)) if tail else math.nan


def tail_std(values: Sequence[float], fraction: float) -> float:
    k = max(1, math.ceil(fraction * len(values)))
    tail = [v for v in values[-k:] if math.isfinite(v)]
    return float(np.std(tail)) if tail else math.nan


def interpolate_curves(curves: Sequence[tuple[Sequence[float], Sequence[float]]], points: int = 200
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Put ``(steps, values)`` curves on one step grid spanning the range all cover; returns (grid, [n, points]).

    Non-finite values are dropped before the linear interpolation. A curve with no finite value gives NaNs.
    """
    clean = []
    for xs, ys in curves:
        pts = [(x, y) for x, y in zip(xs, ys) if math.isfinite(x) and math.isfinite(y)]
        clean.append((np.array([p[0] for p in pts]), np.array([p[1] for p in pts])))
    have = [c for c in clean if c[0].size]
    if not have:
        return np.zeros(0), np.zeros((len(curves), 0))
    lo = max(c[0][0] for c in have)
    hi = min(c[0][-1] for c in have)
    if hi < lo:
        hi = lo
    grid = np.linspace(lo, hi, points if hi > lo else 1)
    rows = [np.interp(grid, xs, ys) if xs.size else np.full(grid.shape, np.nan) for xs, ys in clean]
    return grid, np.vstack(rows)
