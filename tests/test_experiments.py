"""Sweeps and comparisons: statistics against hand computations, --set parsing, and real (tiny) multi-process
grids through the CLI, including the skip-finished-runs resume."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest

from ppokit.analysis import experiments as ex
from ppokit.cli import main
from ppokit.config.ppo_config import ConfigError, PPOConfig, load_preset


# ---------------------------------------------------------------------------- statistics
@pytest.mark.parametrize("df, value", [(1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622), (29, 2.0452),
                                       (30, 2.0423), (40, 2.0211), (100, 1.9840), (10_000, 1.9602)])
def test_t_quantile_matches_tables(df, value):
    assert ex.t_quantile_975(df) == pytest.approx(value, abs=2e-4)


def test_mean_ci_by_hand():
    mean, half = ex.mean_ci([1.0, 2.0, 3.0, 4.0, 5.0])
    # s = sqrt(2.5), t(0.975, 4) = 2.7764
    assert mean == 3.0
    assert half == pytest.approx(2.7764 * math.sqrt(2.5) / math.sqrt(5), rel=1e-4)
    m1, h1 = ex.mean_ci([0.7, float("nan")])
    assert m1 == 0.7 and math.isnan(h1)
    assert all(math.isnan(v) for v in ex.mean_ci([]))


def test_steps_to_threshold_window_and_weights():
    steps = [100, 200, 300, 400, 500, 600, 700]
    # a lucky first update alone does not count: the 5-update window must be full
    rets = [0.96, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    assert ex.steps_to_threshold(steps, rets, [1] * 7, 0.93) is None
    # episode weighting: one 0.0 update with 16 episodes outweighs four 1.0 updates with one episode each
    steps = steps + [800]
    rets = [1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    eps = [1, 1, 16, 1, 1, 1, 1, 1]
    # windows ending at 500, 600, 700 hold the 16-episode zero: 4/20 each; at 800 it has left: 5/5
    assert ex.steps_to_threshold(steps, rets, eps, 0.93) == 800
    # unweighted, the window ending at 500 already averages 4/5 = 0.8
    assert ex.steps_to_threshold(steps, rets, None, 0.8) == 500
    # updates with no finished episode (NaN return) are skipped, not counted as zero
    rets = [1.0, float("nan"), 1.0, float("nan"), 1.0]
    assert ex.steps_to_threshold(steps[:5], rets, [1, 0, 1, 0, 1], 0.99) == 500


def test_interpolate_curves_common_grid():
    a = ([0, 10, 20], [0.0, 1.0, 2.0])
    b = ([5, 15, 25], [10.0, 20.0, float("nan")])
    grid, rows = ex.interpolate_curves([a, b], points=3)
    # the grid spans what every curve covers: [max(first), min(last)] = [5, 15] (b's NaN point dropped)
    np.testing.assert_allclose(grid, [5, 10, 15])
    np.testing.assert_allclose(rows[0], [0.5, 1.0, 1.5])
    np.testing.assert_allclose(rows[1], [10.0, 15.0, 20.0])


def test_summarize_by_hand():
    n = 20
    steps = [float(256 * (i + 1)) for i in range(n)]
    ret1 = [0.0] * 16 + [0.8, 0.9, 1.0, 1.0]  # last 10% = last 2 updates; last 20% = last 4
    ret2 = [0.0] * 16 + [1.0, 1.0, 0.5, 0.7]
    kl1 = [0.01] * n
    kl2 = [0.01] * 10 + [0.3] + [0.01] * 9
    clip1 = [0.0] * 5 + [0.2] * 15
    clip2 = [0.0] * 10 + [0.2] * 10
    res = ex.SettingResult("K=4", {"update_epochs": 4}, "ppo", [
        ex.SeedCurves(1, steps, ret1, [1.0] * n, kl1, clip1, [1.0] * n),
        ex.SeedCurves(2, steps, ret2, [1.0] * n, kl2, clip2, [1.0] * n)])
    (row,) = ex.summarize([res], threshold=0.9)
    finals = [1.0, 0.6]
    assert row["final_return_mean"] == pytest.approx(0.8)
    assert row["final_return_ci95"] == pytest.approx(12.7062 * np.std(finals, ddof=1) / math.sqrt(2), rel=1e-4)
    assert row["max_kl"] == pytest.approx(0.3)
    assert row["kl_exploded"] is True and row["kl_exploded_seeds"] == 1
    assert row["stability_std_mean"] == pytest.approx((np.std([0.8, 0.9, 1.0, 1.0]) + np.std([1, 1, .5, .7])) / 2)
    assert row["no_clip_update_frac"] == pytest.approx((5 / 20 + 10 / 20) / 2)
    # seed 1: windows ending at update 20 average (0,.8,.9,1,1)=0.74... -> never; seed 2: never  -> "never"
    assert row["steps_to_threshold_median"] == "never" and row["reached_seeds"] == 0
    (row_low,) = ex.summarize([res], threshold=0.5)
    # the window of updates 15-19 (0-based) averages (0+0+.8+.9+1)/5 = .54 for seed 1 and (0+0+1+1+.5)/5 = .5 for
    # seed 2; the window before it .34 and .4: both reach at steps[18]
    assert row_low["reached_seeds"] == 2
    assert row_low["steps_to_threshold_median"] == pytest.approx(steps[18])
    (row_mid,) = ex.summarize([res], threshold=0.7)
    # seed 1 reaches at steps[19] (.74), seed 2 never (.64): median of {steps[19], inf} is inf -> "never"
    assert row_mid["reached_seeds"] == 1 and row_mid["steps_to_threshold_median"] == "never"


def test_default_threshold():
    assert ex.default_threshold("CartPole-v1") == 475.0
    assert ex.default_threshold("ppokit/GridWorld-v0") == pytest.approx(0.93)


# ---------------------------------------------------------------------------- --set and the grid
def test_parse_set_uses_config_coercion():
    assert ex.parse_set("update_epochs=1,4,10,30") == ("update_epochs", [1, 4, 10, 30])
    assert ex.parse_set("learning-rate=1e-3, 3e-4") == ("learning_rate", [1e-3, 3e-4])
    assert ex.parse_set("anneal_lr=true,off") == ("anneal_lr", [True, False])
    assert ex.parse_set("hidden_sizes=64,64;32") == ("hidden_sizes", [[64, 64], [32]])
    assert ex.parse_set("target_kl=none,0.02") == ("target_kl", [None, 0.02])


@pytest.mark.parametrize("spec, field", [("update_epoch=1,4", "update_epoch"), ("update_epochs=1,x", "update_epochs"),
                                         ("seed=1,2", "seed"), ("clip_coef=0.1,0.1", "clip_coef"),
                                         ("update_epochs", "set"), ("num_envs=4,", "num_envs")])
def test_parse_set_errors_name_the_field(spec, field):
    with pytest.raises(ConfigError) as info:
        ex.parse_set(spec)
    assert info.value.field == field


def test_build_grid_validates_and_refuses_unsafe(tmp_path):
    base = load_preset("gridworld")
    with pytest.raises(ConfigError) as info:
        ex.build_grid(base, [ex.parse_set("update_epochs=4,31")], 2, tmp_path)
    assert info.value.field == "update_epochs"
    base.unsafe = True
    specs = ex.build_grid(base, [ex.parse_set("update_epochs=4,31"), ex.parse_set("clip_coef=0.1,0.2")], 2,
                          tmp_path)
    assert len(specs) == 8
    assert specs[0].run_dir == tmp_path / "update_epochs=4__clip_coef=0.1" / "seed1"
    assert [s.seed for s in specs[:2]] == [1, 2]
    assert specs[-1].config.update_epochs == 31 and specs[-1].config.clip_coef == 0.2
    assert all(s.config.torch_threads == 1 for s in specs)
    with pytest.raises(ConfigError) as info:
        ex.build_grid(base, [ex.parse_set("algo=ppo,sarsa")], 1, tmp_path)
    assert info.value.field == "algo"


def test_finished_run_of_another_config_is_an_error(tmp_path):
    base = load_preset("gridworld")
    (spec,) = ex.build_grid(base, [ex.parse_set("update_epochs=4")], 1, tmp_path)
    spec.run_dir.mkdir(parents=True)
    other = PPOConfig.from_dict({"total_timesteps": 999}, spec.config)
    other.save_toml(spec.run_dir / "config.toml")
    assert not ex.is_finished(spec)  # no DONE marker: unfinished
    (spec.run_dir / ex.DONE_NAME).write_text("{}")
    with pytest.raises(ConfigError) as info:
        ex.is_finished(spec)
    assert info.value.field == "out" and "total_timesteps" in str(info.value)


def test_cli_errors(tmp_path, capsys):
    assert main(["sweep", "--preset", "gridworld", "--set", "update_epoch=1,4", "--out", str(tmp_path)]) == 2
    assert "update_epoch" in capsys.readouterr().err
    assert main(["sweep", "--preset", "gridworld", "--set", "update_epochs=1,31", "--out", str(tmp_path)]) == 2
    assert "update_epochs" in capsys.readouterr().err
    assert main(["compare", "--algos", "ppo,sarsa", "--env", "ppokit/GridWorld-v0", "--out", str(tmp_path)]) == 2
    assert "algo" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing trained


# ---------------------------------------------------------------------------- real grids
def _read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _mtimes(root: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in sorted(root.glob("*/seed*/*")) if p.is_file()}


def _png_ok(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    assert len(data) < 150_000, (path, len(data))


@pytest.mark.slow
def test_sweep_writes_everything_and_resumes(tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["sweep", "--preset", "gridworld", "--set", "update_epochs=1,4", "--seeds", "2", "--total-timesteps",
            "1024", "--out", str(out), "--workers", "2", "--no-tensorboard"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    for name in ("returns.png", "kl.png", "clipfrac.png"):
        _png_ok(out / name)
    rows = _read_csv(out / "summary.csv")
    assert [r["setting"] for r in rows] == ["update_epochs=1", "update_epochs=4"]
    assert [r["update_epochs"] for r in rows] == ["1", "4"]
    assert all(r["n_seeds"] == "2" for r in rows)
    for col in ("final_return_mean", "final_return_ci95", "steps_to_threshold_median", "max_kl", "kl_exploded"):
        assert col in rows[0]
    for setting in ("update_epochs=1", "update_epochs=4"):
        for seed in (1, 2):
            run = out / setting / f"seed{seed}"
            assert (run / "DONE").is_file()
            metrics = _read_csv(run / "metrics.csv")
            assert [int(m["global_step"]) for m in metrics] == [256, 512, 768, 1024]
            cfg = PPOConfig.from_toml(run / "config.toml")
            assert cfg.seed == seed and cfg.update_epochs == int(setting.split("=")[1])
    # the K=1 runs really ran one epoch, the K=4 runs four
    assert {m["diag/epochs_run"] for m in _read_csv(out / "update_epochs=1/seed1/metrics.csv")} == {"1.0"}
    assert {m["diag/epochs_run"] for m in _read_csv(out / "update_epochs=4/seed2/metrics.csv")} == {"4.0"}
    assert "final return" in first

    # re-run: every run is finished, nothing trains again
    before = _mtimes(out)
    assert main(argv) == 0
    assert "skipping 4 finished run(s)" in capsys.readouterr().out
    assert _mtimes(out) == before
    assert len(_read_csv(out / "summary.csv")) == 2

    # an unfinished run (no DONE) is redone from scratch; the others are untouched
    (out / "update_epochs=4" / "seed2" / "DONE").unlink()
    assert main(argv) == 0
    after = _mtimes(out)
    changed = {p for p in after if after[p] != before.get(p)}
    assert changed and all("update_epochs=4/seed2" in p for p in changed)
    assert len(_read_csv(out / "update_epochs=4/seed2/metrics.csv")) == 4  # restarted, not appended


@pytest.mark.slow
def test_compare_writes_stability_and_beta(tmp_path):
    out = tmp_path / "cmp"
    assert main(["compare", "--algos", "ppo,a2c,ppo-kl", "--preset", "gridworld", "--seeds", "2",
                 "--total-timesteps", "1024", "--out", str(out), "--workers", "2", "--no-tensorboard"]) == 0
    for name in ("returns.png", "kl.png", "clipfrac.png", "stability.png", "beta.png"):
        _png_ok(out / name)
    rows = {r["setting"]: r for r in _read_csv(out / "summary.csv")}
    assert list(rows) == ["ppo", "a2c", "ppo-kl"]
    assert {r["algo"] for r in rows.values()} == {"ppo", "a2c", "ppo-kl"}
    for r in rows.values():
        assert r["stability_std_mean"] != "" and r["no_clip_update_frac"] != ""
    # a2c's single step is taken at ratio == 1, so no sample is ever outside the clip range
    assert float(rows["a2c"]["no_clip_update_frac"]) == 1.0
    # equal env steps for every algorithm
    for algo in rows:
        metrics = _read_csv(out / algo / "seed1" / "metrics.csv")
        assert int(metrics[-1]["global_step"]) == 1024
    betas = [float(m["charts/kl_beta"]) for m in _read_csv(out / "ppo-kl" / "seed1" / "metrics.csv")]
    assert all(b2 / b1 in (0.5, 1.0, 2.0) for b1, b2 in zip([1.0] + betas, betas))


def test_clear_partial_takes_a_run_dir_killed_before_its_config_but_keeps_a_foreign_dir(tmp_path):
    from ppokit.analysis.experiments import _clear_partial
    from ppokit.config.ppo_config import ConfigError

    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / ".lock").write_text("pid 1")
    _clear_partial(killed)
    assert not killed.exists()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / ".lock").write_text("pid 1")
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a ppokit run dir"):
        _clear_partial(foreign)
    assert (foreign / "notes.txt").exists()
