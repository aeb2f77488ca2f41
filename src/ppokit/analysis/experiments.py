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
import json
import math
import multiprocessing
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ppokit.analysis.experiment_outputs import (
    KL_EXPLODED,
    KL_WARN,
    adapts_kl_beta,
    plot_beta,
    plot_clipfrac,
    plot_kl,
    plot_returns,
    plot_stability,
    summary_table,
    write_summary_csv,
)
from ppokit.analysis.experiment_stats import (
    REACH_WINDOW,
    SeedCurves,
    SettingResult,
    interpolate_curves,
    mean_ci,
    steps_to_threshold,
    t_quantile_975,
)
from ppokit.analysis.experiment_stats import tail_mean as _tail_mean
from ppokit.analysis.experiment_stats import tail_std as _tail_std
from ppokit.config.ppo_config import ConfigError, PPOConfig, _coerce
from ppokit.core import schema as S

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
FINAL_FRACTION = 0.10
STABILITY_FRACTION = 0.20
# Fields that identify a run rather than configure it; sweeping them makes no sense.
_NOT_SWEEPABLE = ("seed", "run_dir")



def default_threshold(env_id: str) -> float | None:
    """The return a run must reach: the env spec's ``reward_threshold``; GridWorld: 0.02 below its optimum."""
    import gymnasium as gym

    from ppokit import envs  # noqa: F401  (registers ppokit/GridWorld-v0)

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
    from ppokit.training.trainer import train

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
        ctx.set_forkserver_preload(["ppokit.training.trainer"])
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
def load_results(specs: Sequence[RunSpec]) -> list[SettingResult]:
    """Read each finished run's ``metrics.csv``, grouped by setting in grid order (unfinished runs are left out)."""
    from ppokit.diagnostics.plots import read_metrics

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
        if any(adapts_kl_beta(r.algo) for r in results):
            plot_beta(results, out / "beta.png", f"PPO-KL penalty beta per update ({tag})")
    write_summary_csv(rows, out / "summary.csv")
    if console is not None:
        thr = f"threshold {threshold:g}" if threshold is not None else "no threshold"
        console.print(summary_table(rows, f"{tag}, {thr}", compare=compare))
        console.print(f"wrote {out / 'summary.csv'} and figures to {out}", highlight=False)
    return rows
