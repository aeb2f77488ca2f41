"""The project's own lint rules (``tools/lint_rules.py``, run by CI beside ruff and lint-imports): each rule flags
the forms it names and leaves correct code alone."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "lint_rules.py"
_spec = importlib.util.spec_from_file_location("lint_rules", TOOL)
lint = sys.modules["lint_rules"] = importlib.util.module_from_spec(_spec)  # a dataclass looks its module up
_spec.loader.exec_module(lint)


def codes(text: str, module: str = "training/x.py") -> list[str]:
    return [f.code for f in lint.check_source(text, module)]


def test_an_undefined_metric_name_is_flagged_and_a_defined_one_is_not():
    assert codes('log["diag/aproxkl"] = 1.0') == ["PPK001"]
    assert codes('log["diag/approx_kl"] = 1.0\nlog[S.perf_time("env")] = 0.0') == []
    assert codes('print("charts/ is the namespace")') == []  # prose, not a name
    # The schema defines the names; the logger's console accepts aliases.
    assert codes('X = "diag/new_thing"', "core/schema.py") == []
    assert codes('X = "diag/other_trainers_alias"', "runtime/logger.py") == []


def test_a_schema_only_module_types_no_metric_name_at_all():
    assert codes('row["diag/approx_kl"]', "diagnostics/monitor.py") == ["PPK002"]
    assert codes("row[S.APPROX_KL]", "diagnostics/monitor.py") == []


@pytest.mark.parametrize("value", ["0.02", "0.1", "0.4", "1.5"])
def test_a_threshold_typed_in_a_judging_module_is_flagged(value):
    assert codes(f"if kl > {value}:\n    pass", "analysis/doctor.py") == ["PPK003"]
    assert codes(f"if kl > {value}:\n    pass", "training/x.py") == []  # elsewhere a number is just a number
    assert codes("if kl > S.KL_ALERT:\n    pass", "analysis/doctor.py") == []


@pytest.mark.parametrize("line", ['if s.algo == "ppo":', "if cfg.algo != 'a2c':", 'if "ppo-kl" == r.algo:',
                                  'if algo in ("ppo", "a2c"):', 'if self.algo_name not in ["a2c"]:'])
def test_an_algo_string_comparison_is_flagged_outside_the_registry(line):
    text = line + "\n    pass"
    assert codes(text) == ["PPK004"]
    assert codes(text, "core/algos.py") == []


def test_registry_lookups_are_not_algo_comparisons():
    assert codes('unsupported_reason(policy, "ppo")\nif get_algo(cfg.algo).uses_kl_penalty:\n    pass') == []


def test_a_line_can_opt_out_of_one_rule_with_its_reason():
    assert codes('if algo == "ppo":  # lint: allow PPK004 (the CLI spelling)\n    pass') == []
    assert codes('if algo == "ppo":  # lint: allow PPK001 (wrong rule)\n    pass') == ["PPK004"]


def test_the_command_exits_1_and_names_the_place(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "training").mkdir(parents=True)
    (pkg / "training" / "bad.py").write_text('\n\nif cfg.algo == "ppo":\n    pass\n')
    (pkg / "training" / "good.py").write_text("x = 1\n")
    out = subprocess.run([sys.executable, str(TOOL), str(pkg)], capture_output=True, text=True)
    assert out.returncode == 1
    assert "training/bad.py:3: PPK004" in out.stdout and "good.py" not in out.stdout
    (pkg / "training" / "bad.py").unlink()
    clean = subprocess.run([sys.executable, str(TOOL), str(pkg)], capture_output=True, text=True)
    assert clean.returncode == 0, clean.stdout
