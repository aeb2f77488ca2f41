"""Multi-seed experiments: a grid of settings x seeds trained in worker processes, then aggregate plots and a table.

``ppokit sweep`` and ``ppokit compare`` are thin layers over this module. A grid is a list of ``RunSpec``s (one
normal run dir per setting and seed, ``OUT/<setting>/seed<k>/``); ``run_grid`` trains the unfinished ones in a
process pool (finished ones, marked by a ``DONE`` file, are skipped so an interrupted sweep resumes);
``load_results`` reads every run's ``metrics.csv`` back; ``summarize`` and the ``plot_*`` functions aggregate.

Statistics (the rules the table and figures use):

* 95% confidence interval over seeds: ``mean +- t(0.975, n-1) * s / sqrt(n)``, ``s`` the sample standard
  deviation (ddof 1) of the n per-seed values; undefined (NaN, no band) for a single seed.
* Curves: each seed's episodic-return curve (updates with no finished episode dropped) is linearly interpolated
  onto a common grid of env steps spanning the range every seed covers; the mean and CI are taken per grid point.
* "final return" of a seed: mean per-update episodic return over the last 10% of its updates (at least one).
* "steps to threshold" of a seed: the env step of the first update at which the episode-weighted mean return of
  the trailing ``REACH_WINDOW`` updates is >= the threshold (the window must be full, so one lucky short episode
  in the first rollout cannot count); the table reports the median over seeds, a seed that never reaches
  counting as infinitely slow ("never" when the median is).
* "stability" of a seed: the standard deviation (ddof 0) of its per-update episodic return over the last 20% of
  updates. "no clipping needed": the fraction of updates whose ``diag/clipfrac`` is exactly 0.
* "max KL": the largest per-update ``diag/approx_kl_after`` of any seed (k3 KL of the policy after the update vs
  the rollout's policy, on the whole batch); ``kl_exploded``: some seed crossed 0.1. The per-minibatch
  ``diag/approx_kl`` is measured before each step, so it understates the update's move and is always 0 for
  A2C's single step; runs written before ``approx_kl_after`` existed fall back to it.
"""

from __future__ import annotations

import concurrent.futures as cf
import csv
import json
import math
import multiprocessing
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from . import schema as S
from .algos import ALGOS
from .config import ConfigError, PPOConfig, _coerce

__all__ = [
    "RunSpec",
    "RunResult",
    "parse_set",
    "build_grid",
    "is_finished",
    "run_grid",
    "load_results",
    "summarize",
    "steps_to_threshold",
    "t_quantile_975",
    "mean_ci",
    "interpolate_curves",
    "default_threshold",
    "write_outputs",
    "KL_WARN",
    "KL_EXPLODED",
    "REACH_WINDOW",
]

DONE_NAME = "DONE"
KL_WARN = S.KL_WARN  # approx KL above this: large policy steps for eps = 0.2
KL_EXPLODED = S.KL_ALERT  # above this the update has left the trust region ("KL blew up")
REACH_WINDOW = 5  # updates averaged when deciding that a run reached the return threshold
FINAL_FRACTION = 0.10
STABILITY_FRACTION = 0.20
# Fields that identify a run rather than configure it; sweeping them makes no sense.
_NOT_SWEEPABLE = ("seed", "run_dir")

# t(0.975, df) for df = 1..30 (standard two-sided 95% table values).
_T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281, 2.2010, 2.1788, 2.1604,
         2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860, 2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555,
         2.0518, 2.0484, 2.0452, 2.0423)


# ====================================================================== statistics
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


def _tail_mean(values: Sequence[float], fraction: float) -> float:
    k = max(1, math.ceil(fraction * len(values)))
    tail = [v for v in values[-k:] if math.isfinite(v)]
    return float(np.mean(tail)) if tail else math.nan


def _tail_std(values: Sequence[float], fraction: float) -> float:
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


def default_threshold(env_id: str) -> float | None:
    """The return a run must reach: the env spec's ``reward_threshold``; GridWorld: 0.02 below its optimum."""
    import gymnasium as gym

    from . import envs  # noqa: F401  (registers ppokit/GridWorld-v0)

    try:
        spec = gym.spec(env_id)
    except Exception:
        return None
    if spec.reward_threshold is not None:
        return float(spec.reward_threshold)
    if env_id == envs.GRIDWORLD_ID:
        return round(envs.GridWorldEnv.optimal_return(4) - 0.02, 10)
    return None


# ====================================================================== the grid
@dataclass
class RunSpec:
    """One run of the grid: its setting label, swept values, seed, run dir and full config."""

    setting: str
    overrides: dict[str, Any]
    seed: int
    run_dir: Path
    config: PPOConfig


def parse_set(spec: str) -> tuple[str, list[Any]]:
    """``"field=v1,v2"`` -> (field, coerced values); ``;`` separates values instead when any is a list.

    Values go through the config's own coercion; an unknown field or a bad value raises ``ConfigError``.
    """
    if "=" not in spec:
        raise ConfigError("set", f"expected FIELD=V1,V2,... got {spec!r}")
    name, _, raw = spec.partition("=")
    name = name.strip().replace("-", "_")
    if name == "env":
        name = "env_id"
    if name not in PPOConfig.field_names():
        PPOConfig.from_dict({name: None})  # raises ConfigError naming the field, with a did-you-mean hint
    if name in _NOT_SWEEPABLE:
        raise ConfigError(name, "cannot be swept with --set; use --seeds (seed) or --out (run_dir)")
    parts = [p.strip() for p in raw.split(";" if ";" in raw else ",")]
    if not parts or any(p == "" for p in parts):
        raise ConfigError(name, f"empty value in --set {spec!r}")
    values = [_coerce(name, p) for p in parts]
    if len({repr(v) for v in values}) != len(values):
        raise ConfigError(name, f"duplicate values in --set {spec!r}")
    return name, values


def _fmt_value(value: Any) -> str:
    if isinstance(value, list):
        return "x".join(map(str, value))
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"{value:g}" if isinstance(value, float) else str(value)


def setting_label(overrides: dict[str, Any], bare: bool = False) -> str:
    """``update_epochs=4__clip_coef=0.1`` (also the setting's directory name); ``bare``: just the values."""
    if bare:
        return "__".join(_fmt_value(v) for v in overrides.values())
    return "__".join(f"{k}={_fmt_value(v)}" for k, v in overrides.items())


def build_grid(base: PPOConfig, sets: Sequence[tuple[str, list[Any]]], seeds: int, out: str | Path,
               bare_labels: bool = False) -> list[RunSpec]:
    """The cartesian product of ``sets`` x ``seeds`` seeds (``base.seed``, ``base.seed + 1``, ...), validated.

    Every config is validated before anything trains, so an unsafe value (refused unless ``base.unsafe``) or a bad
    combination fails fast with a ``ConfigError`` naming the field.
    """
    import itertools

    if not isinstance(seeds, int) or seeds < 1:
        raise ConfigError("seeds", f"must be a positive integer, got {seeds!r}")
    names = [n for n, _ in sets]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ConfigError(dup, "given twice in --set; put all its values in one --set")
    out = Path(out)
    specs: list[RunSpec] = []
    for combo in itertools.product(*[values for _, values in sets]):
        overrides = dict(zip(names, combo))
        label = setting_label(overrides, bare=bare_labels)
        for i in range(seeds):
            seed = base.seed + i
            run_dir = out / label / f"seed{seed}"
            config = PPOConfig.from_dict({**overrides, "seed": seed, "run_dir": str(run_dir), "torch_threads": 1},
                                         base)
            config.validate()
            specs.append(RunSpec(label, overrides, seed, run_dir, config))
    return specs


def _comparable(config_dict: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config_dict.items() if k != "run_dir"}


def is_finished(spec: RunSpec) -> bool:
    """True when ``spec.run_dir`` holds a finished run of the same config (``DONE`` marker present).

    A finished run of a *different* config raises ``ConfigError`` rather than silently mixing two experiments.
    """
    if not (spec.run_dir / DONE_NAME).is_file():
        return False
    saved = PPOConfig.from_toml(spec.run_dir / "config.toml").to_dict()
    want = spec.config.to_dict()
    diff = [k for k in _comparable(want) if saved.get(k) != want[k]]
    if diff:
        shown = ", ".join(f"{k}: {saved.get(k)!r} there vs {want[k]!r} now" for k in diff[:4])
        raise ConfigError("out", f"{spec.run_dir} holds a finished run of another config ({shown}); "
                                 "use a new --out directory or delete that run")
    return True


@dataclass
class RunResult:
    """What a worker reports back for one run."""

    setting: str
    seed: int
    run_dir: str
    global_step: int
    wall_s: float
    interrupted: bool
    skipped: bool = False
    error: str | None = None


def _train_worker(config_dict: dict[str, Any], setting: str, seed: int) -> RunResult:
    """Train one run in a worker process: one torch thread, no console; write ``DONE`` when it completes."""
    import torch

    torch.set_num_threads(1)
    from .trainer import train

    config = PPOConfig.from_dict(config_dict)
    run_dir = Path(config.run_dir)
    t0 = time.perf_counter()
    run = train(config, run_dir=run_dir, console_enabled=False)
    wall = time.perf_counter() - t0
    if not run.interrupted:
        (run_dir / DONE_NAME).write_text(json.dumps({"global_step": run.global_step, "wall_s": round(wall, 3),
                                                     "finished": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    return RunResult(setting, seed, str(run_dir), run.global_step, wall, run.interrupted)


def _pool_context():
    # forkserver forks workers from a clean server that preloads the trainer (torch imported once, no inherited
    # threads); spawn is the portable fallback.
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["ppokit.trainer"])
        return ctx
    return multiprocessing.get_context("spawn")


def _clear_partial(run_dir: Path) -> None:
    """Remove an unfinished run dir (its metrics.csv is append-only, so a restart must begin empty)."""
    if not run_dir.exists():
        return
    # A run killed right after taking its lock holds only ppokit's own files (the lock, a checkpoint temp file).
    entries = [e for e in run_dir.iterdir() if e.name != ".lock" and not e.name.startswith(".checkpoint.pt.")]
    if entries and not (run_dir / "config.toml").exists():
        raise ConfigError("out", f"{run_dir} exists and is not a ppokit run dir; refusing to overwrite it")
    shutil.rmtree(run_dir)


def run_grid(specs: Sequence[RunSpec], workers: int | None = None, console: Any = None,
             on_result: Callable[[RunResult], None] | None = None) -> list[RunResult]:
    """Train every unfinished run of ``specs`` in a process pool; finished ones are skipped (resumable).

    Progress is a rich bar per setting plus an overall bar on a terminal, plain lines otherwise. Ctrl-C lets
    running workers finish their current update and save, cancels the rest, and re-raises ``KeyboardInterrupt``.
    """
    from rich.console import Console

    console = console or Console()
    workers = workers or os.cpu_count() or 1
    if workers < 1:
        raise ConfigError("workers", f"must be a positive integer, got {workers}")
    results: list[RunResult] = []
    todo: list[RunSpec] = []
    for spec in specs:
        if is_finished(spec):
            done = json.loads((spec.run_dir / DONE_NAME).read_text() or "{}")
            results.append(RunResult(spec.setting, spec.seed, str(spec.run_dir), int(done.get("global_step", 0)),
                                     0.0, False, skipped=True))
        else:
            todo.append(spec)
    settings = list(dict.fromkeys(s.setting for s in specs))
    per_setting = {s: sum(1 for r in specs if r.setting == s) for s in settings}
    done_count = {s: sum(1 for r in results if r.setting == s) for s in settings}
    total, finished = len(specs), len(results)
    if results:
        console.print(f"skipping {len(results)} finished run(s) of {total} (DONE marker present)")

    fancy = console.is_terminal and not console.is_dumb_terminal
    progress = None
    if fancy:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=console)
        overall = progress.add_task("[bold]all runs", total=total, completed=finished)
        bars = {s: progress.add_task(s, total=per_setting[s], completed=done_count[s]) for s in settings}
        progress.start()

    def report(res: RunResult) -> None:
        nonlocal finished
        finished += 1
        results.append(res)
        if on_result is not None:
            on_result(res)
        if progress is not None:
            progress.advance(overall)
            progress.advance(bars[res.setting])
            if res.error:
                progress.console.print(f"[red]{res.setting} seed {res.seed} failed: {res.error}")
        else:
            state = "FAILED: " + res.error if res.error else ("interrupted" if res.interrupted else
                                                              f"{res.global_step:,} steps in {res.wall_s:.1f} s")
            console.print(f"[{finished}/{total}] {res.setting} seed {res.seed}: {state}", highlight=False)

    try:
        if todo:
            for spec in todo:
                _clear_partial(spec.run_dir)
            with cf.ProcessPoolExecutor(max_workers=min(workers, len(todo)), mp_context=_pool_context()) as pool:
                futures = {pool.submit(_train_worker, s.config.to_dict(), s.setting, s.seed): s for s in todo}
                try:
                    for fut in cf.as_completed(futures):
                        spec = futures[fut]
                        try:
                            report(fut.result())
                        except Exception as exc:  # a crashed run is reported, the rest of the grid goes on
                            report(RunResult(spec.setting, spec.seed, str(spec.run_dir), 0, 0.0, False,
                                             error=f"{type(exc).__name__}: {exc}"))
                except KeyboardInterrupt:
                    pool.shutdown(wait=True, cancel_futures=True)
                    raise
    finally:
        if progress is not None:
            progress.stop()
    return results


# ====================================================================== reading and summarizing
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


def load_results(specs: Sequence[RunSpec]) -> list[SettingResult]:
    """Read each finished run's ``metrics.csv``, grouped by setting in grid order (unfinished runs are left out)."""
    from .plots import read_metrics

    out: dict[str, SettingResult] = {}
    for spec in specs:
        res = out.setdefault(spec.setting, SettingResult(spec.setting, spec.overrides, spec.config.algo))
        path = spec.run_dir / "metrics.csv"
        if not (spec.run_dir / DONE_NAME).is_file() or not path.is_file():
            continue
        cols = read_metrics(path)
        n = len(cols.get(S.GLOBAL_STEP, []))
        nan = [math.nan] * n
        kl = cols.get(S.APPROX_KL_AFTER) or cols.get(S.APPROX_KL, nan)
        res.seeds.append(SeedCurves(spec.seed, cols[S.GLOBAL_STEP], cols.get(S.EPISODIC_RETURN, nan),
                                    cols.get(S.EPISODES, nan), kl,
                                    cols.get(S.CLIPFRAC, nan), cols.get(S.KL_BETA, nan)))
    return list(out.values())


def summarize(results: Sequence[SettingResult], threshold: float | None) -> list[dict[str, Any]]:
    """One row per setting with the statistics described in the module docstring."""
    rows = []
    for res in results:
        finals, reach, max_kls, stab, noclip = [], [], [], [], []
        for s in res.seeds:
            finals.append(_tail_mean(s.returns, FINAL_FRACTION))
            if threshold is not None:
                hit = steps_to_threshold(s.steps, s.returns, s.episodes, threshold)
                reach.append(math.inf if hit is None else hit)
            kls = [k for k in s.kl if math.isfinite(k)]
            max_kls.append(max(kls) if kls else math.nan)
            stab.append(_tail_std(s.returns, STABILITY_FRACTION))
            cf_ = [c for c in s.clipfrac if math.isfinite(c)]
            noclip.append(sum(1 for c in cf_ if c == 0.0) / len(cf_) if cf_ else math.nan)
        f_mean, f_ci = mean_ci(finals)
        s_mean, s_ci = mean_ci(stab)
        finite_kls = [k for k in max_kls if math.isfinite(k)]
        row: dict[str, Any] = {"setting": res.setting, **res.overrides, "n_seeds": len(res.seeds),
                               "final_return_mean": f_mean, "final_return_ci95": f_ci,
                               "threshold": threshold if threshold is not None else math.nan}
        if reach:
            med = float(np.median(reach))
            row["steps_to_threshold_median"] = med if math.isfinite(med) else "never"
            row["reached_seeds"] = sum(1 for r in reach if math.isfinite(r))
        else:
            row["steps_to_threshold_median"] = "n/a"
            row["reached_seeds"] = 0
        row["max_kl"] = max(finite_kls) if finite_kls else math.nan
        row["kl_exploded"] = any(k > KL_EXPLODED for k in finite_kls)
        row["kl_exploded_seeds"] = sum(1 for k in finite_kls if k > KL_EXPLODED)
        row["stability_std_mean"] = s_mean
        row["stability_std_ci95"] = s_ci
        row["no_clip_update_frac"] = float(np.nanmean(noclip)) if any(math.isfinite(v) for v in noclip) else math.nan
        row["per_seed_final"] = finals
        row["per_seed_steps"] = reach
        row["per_seed_stability"] = stab
        rows.append(row)
    return rows


# ====================================================================== figures
_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray",
           "tab:olive", "tab:cyan")


def _figure(title: str, ylabel: str, xlabel: str = "environment steps"):
    from .plots import _new_figure

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


def _adapts_kl_beta(algo: str) -> bool:
    """True for an algo whose penalty beta moves between updates (ppo-kl): only its runs have a beta curve. A
    sweep read back from disk may name an algo this process has not registered; it has no curve."""
    registered = ALGOS.get(algo)
    return registered is not None and registered.adapts_kl_beta


def plot_beta(results: Sequence[SettingResult], path: Path, title: str) -> Path:
    """PPO-KL's adaptive penalty coefficient beta per update (log scale), ppo-kl settings only."""
    kl_only = [r for r in results if _adapts_kl_beta(r.algo)]
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


def write_outputs(specs: Sequence[RunSpec], out: str | Path, threshold: float | None, compare: bool = False,
                  console: Any = None) -> list[dict[str, Any]]:
    """Aggregate the grid's runs into ``out``: figures, ``summary.csv`` and a printed table; return the rows."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results = load_results(specs)
    env = specs[0].config.env_id if specs else ""
    steps = specs[0].config.total_timesteps if specs else 0
    tag = f"{env}, {steps:,} steps"
    rows = summarize(results, threshold)
    plot_returns(results, out / "returns.png", f"episodic return ({tag}; mean, 95% CI over seeds)", threshold)
    plot_kl(results, out / "kl.png", f"approx KL per update ({tag})")
    plot_clipfrac(results, out / "clipfrac.png", f"clip fraction per update ({tag})")
    if compare:
        plot_stability(rows, out / "stability.png", f"stability: std of return over the last 20% ({tag})")
        if any(_adapts_kl_beta(r.algo) for r in results):
            plot_beta(results, out / "beta.png", f"PPO-KL penalty beta per update ({tag})")
    write_summary_csv(rows, out / "summary.csv")
    if console is not None:
        thr = f"threshold {threshold:g}" if threshold is not None else "no threshold"
        console.print(summary_table(rows, f"{tag}, {thr}", compare=compare))
        console.print(f"wrote {out / 'summary.csv'} and figures to {out}", highlight=False)
    return rows
