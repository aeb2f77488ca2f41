"""``ppokit tune``: a real Optuna study in SQLite over tiny CartPole trials; it resumes, prunes and writes a best
config that ``ppokit train --config`` runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ppokit.cli import main
from ppokit.config.ppo_config import PPOConfig

optuna = pytest.importorskip("optuna", reason="ppokit tune needs Optuna: pip install -e '.[tune]'")

from ppokit.analysis.tune import SPACE, TuneSettings, _base_config, n_steps_range, planner_params  # noqa: E402

# 2,048 steps per trial: 8 envs x 32-64 steps, 4-8 updates, a few seconds each.
TINY = ["--env", "CartPole-v1", "--total-timesteps", "2048", "--evaluations", "2", "--eval-episodes", "2"]


def _study(url: str, name: str = "CartPole-v1-ppo"):
    return optuna.load_study(study_name=name, storage=url)


def test_study_resumes_from_sqlite_and_best_toml_trains(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    tune = ["tune", *TINY, "--storage", url, "--out", str(tmp_path / "td")]
    # Two trials in two worker processes, then one more in this process: the same study, grown.
    assert main([*tune, "--trials", "2", "--jobs", "2"]) == 0
    study = _study(url)
    assert len(study.trials) == 2 and (tmp_path / "study.db").stat().st_size > 0
    # The first trial is the planner's config, projected onto the search space.
    base = _base_config(TuneSettings("CartPole-v1", total_timesteps=2048))
    first = min(study.trials, key=lambda t: t.number)
    assert first.params == planner_params(base, n_steps_range(base.num_envs, 2048))
    assert main([*tune, "--trials", "1"]) == 0
    study = _study(url)
    assert len(study.trials) == 3 and all(t.state.name == "COMPLETE" for t in study.trials)
    assert all(len(t.intermediate_values) == 2 for t in study.trials)  # every evaluation reported
    out = capsys.readouterr().out
    assert "3 trials (3 complete)" in out

    best = tmp_path / "td" / "best.toml"
    config = PPOConfig.from_toml(best)
    assert config.env_id == "CartPole-v1" and config.eval_every == 0 and config.run_dir is None
    assert config.learning_rate == study.best_trial.params["learning_rate"]
    assert (tmp_path / "td" / "importance.png").stat().st_size > 5_000
    run_dir = tmp_path / "best_run"
    assert main(["train", "--config", str(best), "--total-timesteps", "512", "--run-dir", str(run_dir),
                 "--quiet", "--no-tensorboard"]) == 0
    assert (run_dir / "checkpoint.pt").is_file()


def test_a_trial_below_the_median_is_pruned(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    name = "prune-me"
    # Five finished trials that returned 10,000 at every evaluation (CartPole's best is 500): the median
    # pruner, past its 5 start-up trials, must stop the next real trial at its first evaluation.
    study = optuna.create_study(study_name=name, storage=url, direction="maximize")
    for key, value in (("env_id", "CartPole-v1"), ("total_timesteps", 8192), ("evaluations", 3)):
        study.set_user_attr(key, value)
    for _ in range(5):
        study.add_trial(optuna.trial.create_trial(value=1e4, intermediate_values={1: 1e4, 2: 1e4, 3: 1e4}))
    assert main(["tune", "--env", "CartPole-v1", "--total-timesteps", "8192", "--evaluations", "3",
                 "--eval-episodes", "2", "--trials", "1", "--storage", url, "--study-name", name,
                 "--out", str(tmp_path / "td")]) == 1  # no real trial completed: no best.toml
    trial = _study(url, name).trials[-1]
    assert trial.state.name == "PRUNED" and list(trial.intermediate_values) == [1]
    # Its run dir is kept, with the checkpoint of the update it was stopped at (before the end of its budget).
    run_dir = tmp_path / "td" / "trials" / f"trial_{trial.number}"
    assert (run_dir / "checkpoint.pt").is_file()
    rows = (run_dir / "metrics.csv").read_text().splitlines()[1:]
    assert 0 < len(rows) < PPOConfig.from_toml(run_dir / "config.toml").num_updates


@pytest.mark.parametrize("argv, flag", [
    (["--trials", "0"], "--trials"),
    (["--jobs", "0"], "--jobs"),
    (["--storage", "nosuchdb://x/y"], "--storage"),
    (["--env", "NoSuchEnv-v9"], "--env"),
    (["--total-timesteps", "100"], "--total-timesteps"),
])
def test_bad_input_is_one_line_naming_the_flag(tmp_path, capsys, argv, flag):
    base = {"--env": "CartPole-v1", "--trials": "1", "--total-timesteps": "2048", "--out": str(tmp_path / "td")}
    base.update(dict(zip(argv[::2], argv[1::2])))
    assert main(["tune", *[x for kv in base.items() for x in kv]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {flag}:") and "\n" not in err and "Traceback" not in err


def test_resuming_with_another_env_is_refused(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="s", storage=url)
    study.set_user_attr("env_id", "Acrobot-v1")
    study.set_user_attr("total_timesteps", 2048)
    study.set_user_attr("evaluations", 2)
    assert main(["tune", *TINY, "--trials", "1", "--storage", url, "--study-name", "s",
                 "--out", str(tmp_path / "td")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --env:") and "Acrobot-v1" in err
    assert len(_study(url, "s").trials) == 0  # nothing ran, nothing added


def test_the_search_space_keeps_inside_the_guard_rails():
    assert max(SPACE["clip_range"][1]) <= 0.3 and max(SPACE["n_epochs"][1]) <= 30
    assert n_steps_range(8, 2048) == (5, 6) and n_steps_range(1, 10**9) == (5, 12)


def test_import_ppokit_does_not_import_optuna():
    code = ("import sys, ppokit, ppokit.cli.app as a; a.build_parser(); "
            "assert 'optuna' not in sys.modules, 'optuna imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def _children(pid: int) -> set[int]:
    try:
        return {int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()}
    except OSError:
        return set()


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; the workers' parent-death signal is Linux's")
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM", "SIGINT"])
def test_trial_workers_end_with_tune(tmp_path, sig):
    import os
    import signal
    import time

    url = f"sqlite:///{tmp_path / 'study.db'}"
    proc = subprocess.Popen([sys.executable, "-m", "ppokit", "tune", "--env", "CartPole-v1", "--total-timesteps",
                             "200000", "--evaluations", "2", "--trials", "2", "--jobs", "2", "--storage", url,
                             "--out", str(tmp_path / "td")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        deadline = time.monotonic() + 240  # spawning two interpreters that import torch, under load
        workers: set[int] = set()
        while len(workers) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "the trial workers did not start"
            workers = {c for c in _children(proc.pid)
                       if "multiprocessing" in open(f"/proc/{c}/cmdline").read() and _alive(c)}
            time.sleep(0.2)
        os.kill(proc.pid, getattr(signal, sig))
        proc.wait(timeout=120)
        deadline = time.monotonic() + 60
        while any(_alive(w) for w in workers):
            assert time.monotonic() < deadline, f"trial workers outlived tune after {sig}: {workers}"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
