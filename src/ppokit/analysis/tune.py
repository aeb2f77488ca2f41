"""``ppokit tune``: an Optuna study over RL-Zoo's PPO search space, kept in a database so that it resumes.

Each trial trains one run with the planner's config for the env as its base and the sampled values over it
(``SPACE``; ranges as RL-Zoo's ``sample_ppo_params``, documented in docs/tune.md). The evaluation gate
(``eval_every``) evaluates the deterministic policy ``evaluations`` times per trial, at the same fractions of the
budget in every trial; each evaluation is reported to the trial (step = its index), so that the median pruner
compares trials at the same point, and the last one is the trial's value. A pruned trial stops through the
training callbacks (``on_update`` returning False: the run ends as a finished one, checkpoint written), then
the objective raises ``optuna.TrialPruned``; its run dir is kept, under ``TUNE_DIR/trials/trial_<n>``, with the
curves that got it pruned.

Parallel trials (``jobs``) are processes, not threads: a training run holds the GIL in its Python loop, so
Optuna's thread ``n_jobs`` would serialize them. Each worker process loads the same study from the storage, has
its own TPE sampler (seed + worker index, so the workers do not propose the same values) and trains with
``torch_threads = 1``.

Optuna is imported only here and only when a study runs: ``import ppokit`` does not import it.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppokit.config.ppo_config import ConfigError, PPOConfig

__all__ = ["TuneSettings", "TuneResult", "TuneError", "SPACE", "NET_ARCHS", "run_tune", "trial_fields",
           "planner_params", "n_steps_range"]

# RL-Zoo's PPO search space (rl_zoo3/hyperparams_opt.py, sample_ppo_params): name -> (kind, low/choices, high, log).
# clip_range drops RL-Zoo's 0.4: ppokit's guard rail refuses clip_coef > 0.3 (SAFE_LIMITS) without --unsafe.
SPACE: dict[str, tuple] = {
    "n_steps_pow": ("int", 5, 12, False),  # num_steps = 2**pow per env (upper end: n_steps_range)
    "batch_size_pow": ("int", 2, 10, False),  # SB3's minibatch size 2**pow -> num_minibatches
    "one_minus_gamma": ("float", 1e-4, 0.03, True),
    "one_minus_gae_lambda": ("float", 1e-4, 0.1, True),
    "learning_rate": ("float", 1e-5, 2e-3, True),  # constant, as RL-Zoo samples it
    "ent_coef": ("float", 1e-8, 0.1, True),
    "clip_range": ("cat", (0.1, 0.2, 0.3)),
    "n_epochs": ("cat", (1, 5, 10, 20)),
    "max_grad_norm": ("float", 0.3, 2.0, False),
    "net_arch": ("cat", ("tiny", "small", "medium")),
    "activation_fn": ("cat", ("tanh", "relu")),
}
NET_ARCHS = {"tiny": [64], "small": [64, 64], "medium": [256, 256]}
# Updates a trial gets at the least: the largest rollout the space may sample is capped to budget / this.
MIN_TRIAL_UPDATES = 4
# The evaluation gate's threshold in a trial: out of reach, so that the gate evaluates but never ends the run.
_NEVER = sys.float_info.max


class TuneError(ValueError):
    """A bad ``ppokit tune`` input; the message starts with the flag it is about."""

    def __init__(self, flag: str, reason: str):
        self.flag = flag
        super().__init__(f"{flag}: {reason}")


@dataclass
class TuneSettings:
    env_id: str
    trials: int = 20
    total_timesteps: int = 100_000  # per trial
    storage: str | None = None  # default: sqlite:///TUNE_DIR/study.db
    study_name: str | None = None  # default: <env>-ppo
    jobs: int = 1
    seed: int = 0
    evaluations: int = 5  # per trial
    eval_episodes: int = 8
    out_dir: str | None = None  # default: tunes/<study name>

    @property
    def name(self) -> str:
        return self.study_name or f"{self.env_id.replace('/', '-').replace(':', '-')}-ppo"

    @property
    def tune_dir(self) -> Path:
        return Path(self.out_dir) if self.out_dir else Path("tunes") / self.name

    @property
    def storage_url(self) -> str:
        return self.storage or f"sqlite:///{self.tune_dir / 'study.db'}"


@dataclass
class TuneResult:
    study_name: str
    storage: str
    tune_dir: Path
    counts: dict[str, int]  # state name (COMPLETE, PRUNED, FAIL, ...) -> trials
    best_value: float | None
    best_number: int | None
    best_toml: Path | None
    importance_plot: Path | None
    notes: list[str]


def n_steps_range(num_envs: int, total_timesteps: int) -> tuple[int, int]:
    """``(low, high)`` of ``n_steps_pow``: RL-Zoo's 5..12, the top cut so that a trial has MIN_TRIAL_UPDATES."""
    low, high = SPACE["n_steps_pow"][1:3]
    fit = int(math.floor(math.log2(max(1, total_timesteps // (num_envs * MIN_TRIAL_UPDATES)))))
    return low, min(high, fit)


def trial_fields(params: dict[str, Any], base: PPOConfig) -> dict[str, Any]:
    """The ``PPOConfig`` fields of a trial's sampled ``params`` (SPACE's names) over ``base``'s rollout width."""
    num_steps = 2 ** int(params["n_steps_pow"])
    batch = base.num_envs * num_steps
    minibatch = 2 ** int(params["batch_size_pow"])
    # SB3 with batch_size >= the rollout takes it as one minibatch; powers of two divide the rollout otherwise
    # when num_envs does (else the nearest divisor below).
    nmb = max(1, batch // minibatch)
    while batch % nmb:
        nmb -= 1
    return {"num_steps": num_steps, "num_minibatches": nmb, "gamma": 1.0 - params["one_minus_gamma"],
            "gae_lambda": 1.0 - params["one_minus_gae_lambda"], "learning_rate": params["learning_rate"],
            "anneal_lr": False, "ent_coef": params["ent_coef"], "clip_coef": params["clip_range"],
            "update_epochs": params["n_epochs"], "max_grad_norm": params["max_grad_norm"],
            "hidden_sizes": list(NET_ARCHS[params["net_arch"]]), "activation": params["activation_fn"]}


def _clamp(x: float, low: float, high: float) -> float:
    return min(high, max(low, x))


def _nearest(x: float, choices: tuple) -> Any:
    return min(choices, key=lambda c: abs(c - x))


def planner_params(config: PPOConfig, n_steps_bounds: tuple[int, int]) -> dict[str, Any]:
    """The planner's ``config`` in SPACE's names, clamped into the space: the study's first (enqueued) trial."""
    f = {name: spec for name, spec in SPACE.items()}
    arch = next((k for k, v in NET_ARCHS.items() if v == list(config.hidden_sizes)), "small")
    return {
        "n_steps_pow": int(_clamp(round(math.log2(config.num_steps)), *n_steps_bounds)),
        "batch_size_pow": int(_clamp(round(math.log2(config.minibatch_size)), *f["batch_size_pow"][1:3])),
        "one_minus_gamma": _clamp(1.0 - config.gamma, *f["one_minus_gamma"][1:3]),
        "one_minus_gae_lambda": _clamp(1.0 - config.gae_lambda, *f["one_minus_gae_lambda"][1:3]),
        "learning_rate": _clamp(config.learning_rate, *f["learning_rate"][1:3]),
        "ent_coef": _clamp(config.ent_coef, *f["ent_coef"][1:3]),
        "clip_range": _nearest(config.clip_coef, f["clip_range"][1]),
        "n_epochs": _nearest(config.update_epochs, f["n_epochs"][1]),
        "max_grad_norm": _clamp(config.max_grad_norm, *f["max_grad_norm"][1:3]),
        "net_arch": arch,
        "activation_fn": config.activation,
    }


def _suggest(trial, n_steps_bounds: tuple[int, int]) -> dict[str, Any]:
    out = {}
    for name, spec in SPACE.items():
        if name == "n_steps_pow":
            out[name] = trial.suggest_int(name, *n_steps_bounds)
        elif spec[0] == "int":
            out[name] = trial.suggest_int(name, spec[1], spec[2])
        elif spec[0] == "float":
            out[name] = trial.suggest_float(name, spec[1], spec[2], log=spec[3])
        else:
            out[name] = trial.suggest_categorical(name, list(spec[1]))
    return out


def _base_config(s: TuneSettings) -> PPOConfig:
    """The planner's config for the env (what ``ppokit train --env X`` trains), at the trial budget."""
    from ppokit.config.planner import planned_config

    return planned_config({"env_id": s.env_id, "total_timesteps": s.total_timesteps})[0]


def trial_config(params: dict[str, Any], base: PPOConfig, s: TuneSettings, run_dir: Path | None) -> PPOConfig:
    """The config a trial trains: base < sampled fields < the gate that evaluates ``s.evaluations`` times."""
    config = PPOConfig.from_dict(trial_fields(params, base), base)
    every = max(1, config.num_updates // max(1, s.evaluations))
    return PPOConfig.from_dict({"eval_every": every, "eval_threshold": _NEVER, "eval_episodes": s.eval_episodes,
                                "torch_threads": 1, "tensorboard": False, "seed": s.seed,
                                "run_dir": str(run_dir) if run_dir else None}, config)


class _ReportEvaluations:
    """Training callback: each evaluation of the gate reported to the trial; False (stop) once it is pruned."""

    def __init__(self, trial):
        self.trial = trial
        self.step = 0
        self.last: float | None = None
        self.pruned = False

    def on_update(self, info) -> bool | None:
        from ppokit.core import schema as S

        value = info.metrics.get(S.EVAL_RETURN, math.nan)
        if math.isnan(value):
            return None
        self.step += 1
        self.last = float(value)
        self.trial.report(self.last, self.step)
        if self.trial.should_prune():
            self.pruned = True
            return False
        return None


def _objective(s: TuneSettings, base: PPOConfig, bounds: tuple[int, int]):
    import optuna

    from ppokit.training.trainer import train

    def objective(trial) -> float:
        params = _suggest(trial, bounds)
        run_dir = s.tune_dir / "trials" / f"trial_{trial.number}"
        config = trial_config(params, base, s, run_dir)
        trial.set_user_attr("run_dir", str(run_dir))
        reporter = _ReportEvaluations(trial)
        result = train(config, console_enabled=False, overwrite=True, callbacks=[reporter])
        if result.interrupted:
            raise KeyboardInterrupt
        if reporter.pruned:
            raise optuna.TrialPruned(f"evaluation {reporter.step}: return {reporter.last:g} below the median")
        if reporter.last is None:
            raise RuntimeError(f"trial {trial.number} made no evaluation")
        return reporter.last

    return objective


def _make_study(s: TuneSettings, seed: int):
    import optuna

    # RL-Zoo's choices (rl_zoo3/exp_manager.py): TPE after 10 random trials; median pruning after 5 trials,
    # not in the first third of a trial's evaluations.
    sampler = optuna.samplers.TPESampler(n_startup_trials=10, seed=seed, multivariate=True)
    pruner = optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=s.evaluations // 3)
    return optuna.create_study(study_name=s.name, storage=s.storage_url, sampler=sampler, pruner=pruner,
                               direction="maximize", load_if_exists=True)


def _worker(s: TuneSettings, worker: int, n_trials: int, worker_of: int | None = None) -> None:
    """One process of ``jobs``: its own sampler seed, the shared study, ``n_trials`` trials."""
    import optuna
    import torch

    from ppokit.envs.watchdog import die_with_parent

    if worker_of is not None:
        die_with_parent(worker_of)  # a worker process ends with `ppokit tune`, even a kill -9 of it

    torch.set_num_threads(1)  # each trial trains with torch_threads = 1 too; the workers share the cores
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    base = _base_config(s)
    bounds = n_steps_range(base.num_envs, s.total_timesteps)
    study = _make_study(s, s.seed + worker)
    if worker:
        _wait_for_queue(study)
    # A trial whose run fails (an env error, a refused config) is recorded as FAIL and the study goes on.
    study.optimize(_objective(s, base, bounds), n_trials=n_trials, catch=(ValueError, RuntimeError))


def _wait_for_queue(study, bound_s: float = 120.0) -> None:
    """Let worker 0 claim the enqueued trials (the planner's config) before this worker asks for one.

    Optuna claims a WAITING trial with an update that SQLite cannot lock (no ``SELECT ... FOR UPDATE``), so two
    workers starting together both ran the enqueued trial 0 (seen under load: the second found its run dir locked
    and the study recorded one failed trial). A bound, not a wait: past it the worker goes on as before.
    """
    import time

    from optuna.trial import TrialState

    deadline = time.monotonic() + bound_s
    while study.get_trials(deepcopy=False, states=(TrialState.WAITING,)) and time.monotonic() < deadline:
        time.sleep(0.05)


def _check(s: TuneSettings) -> tuple[PPOConfig, tuple[int, int]]:
    """Every bad input as one ``TuneError`` naming its flag, before any trial runs."""
    from ppokit.envs import check_env_id

    for flag, value, low in (("--trials", s.trials, 1), ("--jobs", s.jobs, 1), ("--evaluations", s.evaluations, 1),
                             ("--eval-episodes", s.eval_episodes, 1), ("--total-timesteps", s.total_timesteps, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise TuneError(flag, f"must be an integer >= {low}, got {value!r}")
    try:
        check_env_id(s.env_id)
    except ValueError as exc:
        raise TuneError("--env", str(exc)) from exc
    try:
        base = _base_config(s)
    except ConfigError as exc:
        raise TuneError("--env", f"the planner could not plan {s.env_id}: {exc}") from exc
    bounds = n_steps_range(base.num_envs, s.total_timesteps)
    if bounds[1] < bounds[0]:
        need = base.num_envs * 2 ** bounds[0] * MIN_TRIAL_UPDATES
        raise TuneError("--total-timesteps", f"{s.total_timesteps:,} steps per trial is too short for RL-Zoo's "
                                             f"smallest rollout ({base.num_envs} envs x {2 ** bounds[0]} steps, "
                                             f"{MIN_TRIAL_UPDATES} updates): give at least {need:,}")
    return base, bounds


def _open_storage(s: TuneSettings):
    import optuna

    if s.storage is None:
        s.tune_dir.mkdir(parents=True, exist_ok=True)
    try:
        return optuna.storages.RDBStorage(s.storage_url)
    except Exception as exc:  # noqa: BLE001 - SQLAlchemy's many URL and driver errors: one line naming the flag
        reason = " ".join(str(exc).split())[:200]
        raise TuneError("--storage", f"cannot open {s.storage_url!r} as an Optuna database ({reason})") from exc


def _check_resume(study, s: TuneSettings) -> bool:
    """Record what the study tunes, or refuse a resume with another env or budget; True for a new study."""
    attrs = study.user_attrs
    if not attrs:
        study.set_user_attr("env_id", s.env_id)
        study.set_user_attr("total_timesteps", s.total_timesteps)
        study.set_user_attr("evaluations", s.evaluations)
        return True
    for flag, key, value in (("--env", "env_id", s.env_id), ("--total-timesteps", "total_timesteps",
                                                              s.total_timesteps),
                             ("--evaluations", "evaluations", s.evaluations)):
        if attrs.get(key) != value:
            raise TuneError(flag, f"study {s.name!r} in {s.storage_url} tunes {key} = {attrs.get(key)!r}, not "
                                  f"{value!r}: give the same value to resume it, or another --study-name")
    return False


def run_tune(s: TuneSettings) -> TuneResult:
    """Run ``s.trials`` more trials of the study (created, or resumed from ``s.storage``), then write the best
    config as ``best.toml`` and the parameter importances as ``importance.png`` in the tune dir."""
    import optuna

    base, bounds = _check(s)
    _open_storage(s)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = _make_study(s, s.seed)
    if _check_resume(study, s) and not study.trials:
        study.enqueue_trial(planner_params(base, bounds))  # the planner's config, clamped into the space
    s.tune_dir.mkdir(parents=True, exist_ok=True)
    if s.jobs == 1:
        _worker(s, 0, s.trials)
    else:
        shares = [s.trials // s.jobs + (i < s.trials % s.jobs) for i in range(s.jobs)]
        ctx = multiprocessing.get_context("spawn")  # no forked torch or sqlite state in the workers
        procs = [ctx.Process(target=_worker, args=(s, i, n, os.getpid())) for i, n in enumerate(shares) if n]
        for p in procs:
            p.start()
        try:
            for p in procs:
                p.join()
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                    p.join()
    study = optuna.load_study(study_name=s.name, storage=s.storage_url)
    return _finish(study, s, base)


def _finish(study, s: TuneSettings, base: PPOConfig) -> TuneResult:
    import optuna

    counts: dict[str, int] = {}
    for t in study.trials:
        counts[t.state.name] = counts.get(t.state.name, 0) + 1
    notes: list[str] = []
    # Trials with every SPACE parameter: a trial added to the study by hand may have none.
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE and set(SPACE) <= set(t.params)]
    best_toml = plot = None
    best = max(complete, key=lambda t: t.value) if complete else None
    if best is not None:
        best_toml = s.tune_dir / "best.toml"
        config = PPOConfig.from_dict({**trial_fields(best.params, base), "seed": s.seed, "run_dir": None}, base)
        head = (f"# ppokit tune: best of study {s.name!r} ({s.storage_url}): trial {best.number}, last evaluation "
                f"return {best.value:g} after {s.total_timesteps:,} steps\n")
        best_toml.write_text(head + config.to_toml())
    else:
        notes.append("no trial completed: no best.toml")
    if len(complete) >= 2:
        plot = _importance_plot(study, s.tune_dir / "importance.png", notes)
    else:
        notes.append("the importance plot needs 2 completed trials")
    return TuneResult(s.name, s.storage_url, s.tune_dir, counts, best.value if best else None,
                      best.number if best else None, best_toml, plot, notes)


def _importance_plot(study, path: Path, notes: list[str]) -> Path | None:
    import warnings

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization.matplotlib import plot_param_importances

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # optuna's ExperimentalWarning for the matplotlib backend
            ax = plot_param_importances(study)
        ax.figure.tight_layout()
        ax.figure.savefig(path, dpi=100)
        plt.close(ax.figure)
    except (ValueError, RuntimeError, ZeroDivisionError) as exc:  # e.g. every completed trial had the same values
        notes.append(f"no importance plot: {exc}")
        return None
    return path
