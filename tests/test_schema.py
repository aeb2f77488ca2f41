"""The metric schema is the single source of metric names and thresholds: the trainer logs exactly its names, the
thresholds are the standard PPO debugging bands, and no other module types a metric name the schema does not define."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

from ppokit.core import schema as S
from ppokit.core.schema import METRICS, THRESHOLDS

SRC = Path(S.__file__).resolve().parents[1]  # the ppokit package
PREFIXES = ("charts/", "losses/", "diag/", "perf/")
# Modules whose metric names and thresholds all come from the schema (no literal at all).
FROM_SCHEMA_ONLY = ("diagnostics/monitor.py", "analysis/doctor.py", "diagnostics/plots.py", "analysis/report.py",
                    "analysis/experiments.py", "config/planner.py")


def _metric_literals(path: Path) -> list[tuple[int, str]]:
    """String constants of ``path`` that look like a metric name (``diag/...`` etc.)."""
    tree = ast.parse(path.read_text())
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(PREFIXES)
            and " " not in node.value]


def test_every_logged_metric_is_in_the_schema(tmp_path):
    from ppokit.config.ppo_config import PPOConfig
    from ppokit.training.trainer import PERF_PHASES, train

    cfg = PPOConfig(env_id="CartPole-v1", total_timesteps=2 * 512, tensorboard=False, eval_every=1,
                    eval_episodes=1, eval_threshold=1e9, run_dir=str(tmp_path / "run"))
    run = train(cfg, console_enabled=False)
    logged = set(run.metrics[0])
    perf = {f(p) for p in PERF_PHASES for f in (S.perf_time, S.perf_frac)}
    assert logged - perf <= set(METRICS), sorted(logged - perf - set(METRICS))
    # ... and the schema names nothing the trainer does not log (but the CSV's own step column).
    assert set(METRICS) - logged - set(S.LM_METRICS) - set(S.ATARI_METRICS) == {S.GLOBAL_STEP}
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


@pytest.mark.parametrize("module", sorted(p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")))
def test_no_module_invents_a_metric_name(module):
    path = SRC / module
    if module == "core/schema.py":
        return
    found = _metric_literals(path)
    if module in FROM_SCHEMA_ONLY:
        assert found == [], f"{module} types metric names; import them from ppokit.core.schema: {found}"
    elif module != "runtime/logger.py":  # the console also accepts other trainers' spellings (aliases)
        unknown = [(line, name) for line, name in found if name not in METRICS]
        assert unknown == [], f"{module} logs or reads names the schema does not define: {unknown}"


def test_from_schema_only_modules_type_no_threshold():
    # The thresholds (0.02, 0.1, 0.4, 1.5) are the schema's; a literal of them elsewhere is a second copy.
    thresholds = {S.KL_WARN, S.KL_ALERT, S.CLIPFRAC_HIGH, S.KL_STOP_FACTOR}
    for name in ("diagnostics/monitor.py", "analysis/doctor.py", "analysis/report.py"):
        tree = ast.parse((SRC / name).read_text())
        nums = [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant)
                and isinstance(n.value, float) and not isinstance(n.value, bool)
                and any(math.isclose(n.value, x) for x in thresholds)]
        assert nums == [], f"{name}: {nums}"
