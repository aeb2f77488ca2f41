"""The metric schema is the single source of metric names and thresholds: the trainer logs exactly its names, the
thresholds are the standard PPO debugging bands. That no other module types a metric name or a threshold is a lint
rule (``tools/lint_rules.py``, PPK001-PPK003), run by CI."""

from __future__ import annotations

from ppokit.core import schema as S
from ppokit.core.schema import METRICS, THRESHOLDS


def test_every_logged_metric_is_in_the_schema(tmp_path):
    from ppokit.config.ppo_config import PPOConfig
    from ppokit.training.trainer import PERF_PHASES, train

    cfg = PPOConfig(env_id="CartPole-v1", total_timesteps=2 * 512, tensorboard=False, eval_every=1,
                    eval_episodes=1, eval_threshold=1e9, run_dir=str(tmp_path / "run"))
    run = train(cfg, console_enabled=False)
    logged = set(run.metrics[0])
    perf = {f(p) for p in PERF_PHASES for f in (S.perf_time, S.perf_frac)}
    assert logged - perf <= set(METRICS), sorted(logged - perf - set(METRICS))
    # ... and the schema names nothing the trainer does not log (but the CSV's own step column; the policy lag
    # comes with a source whose actors may lag, test_rollout_source.py; the Atari metrics with an ALE game).
    assert set(METRICS) - logged - set(S.LM_METRICS) - set(S.STALE_SOURCE_METRICS) - set(S.ATARI_METRICS) == {
        S.GLOBAL_STEP}
    for m in METRICS.values():
        assert m.meaning, m.name


def test_thresholds_are_the_standard_bands():
    # approx KL should stay in [0, 0.02], past 0.1 lower K or LR; clip fraction 0.1-0.3 healthy, sustained
    # above 0.4 is drift; KL early stop at 1.5 x target_kl; explained variance climbs from 0 towards 1.
    assert (S.KL_WARN, S.KL_ALERT, S.CLIPFRAC_HIGH, S.KL_STOP_FACTOR, S.EV_MIN) == (0.02, 0.1, 0.4, 1.5, 0.0)
    assert S.CLIPFRAC_HEALTHY == (0.1, 0.3)
    assert THRESHOLDS["kl_warn"] == S.KL_WARN and THRESHOLDS["kl_alert"] == S.KL_ALERT
    assert THRESHOLDS["clipfrac_high"] == S.CLIPFRAC_HIGH and THRESHOLDS["ev_min"] == S.EV_MIN


def test_modules_share_one_copy_of_each_threshold():
    from ppokit.analysis import experiments
    from ppokit.config import planner
    from ppokit.diagnostics import monitor, plots
    from ppokit.update import epochs

    assert monitor.THRESHOLDS is THRESHOLDS and planner.THRESHOLDS is THRESHOLDS
    assert (plots.KL_WARN, plots.KL_ALARM, plots.CLIPFRAC_BAND) == (S.KL_WARN, S.KL_ALERT, S.CLIPFRAC_HEALTHY)
    assert (experiments.KL_WARN, experiments.KL_EXPLODED) == (S.KL_WARN, S.KL_ALERT)
    # The epoch loop's early-stop factor is the schema's number (one definition once epochs.py imports it).
    assert epochs.KL_STOP_FACTOR == S.KL_STOP_FACTOR


def test_a_changed_threshold_reaches_the_diagnostics_plan(monkeypatch):
    # The planner's table is read from THRESHOLDS, not typed: change the number, the text follows.
    from ppokit.config.planner import diagnostics_plan

    monkeypatch.setitem(THRESHOLDS, "kl_alert", 0.123)
    kl_row = next(r for r in diagnostics_plan() if r["metric"] == S.APPROX_KL)
    assert "0.123" in kl_row["alert"] and "0.1," not in kl_row["alert"]
