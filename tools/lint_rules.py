"""ppokit's own lint rules: what ruff and import-linter cannot say about this code base.

Each rule keeps one thing defined in one place (the guide's "a thing is defined once"):

* PPK001  a string that looks like a metric name (``charts/...``, ``losses/...``, ``diag/...``, ``perf/...``,
          ``lm/...``, ``dpo/...``) that the metric schema (``ppokit.core.schema``) does not define: a typo, or a
          metric logged without its meaning;
* PPK002  a metric name typed at all in a module that reads every name from the schema (the monitor, the
          doctor, the plots, the report, the experiments, the planner);
* PPK003  a number equal to one of the schema's thresholds (0.02, 0.1, 0.4, 1.5) typed in a module that judges
          runs with them (the monitor, the doctor, the report): a second copy that would drift;
* PPK004  ``algo`` compared with a string outside the algorithm registry (``core/algos.py``): branch on the
          registry's fields instead, so a new algorithm is one registration.

Run from the repository root (CI does, beside ruff and lint-imports)::

    python3 tools/lint_rules.py src/ppokit

It prints ``path:line: CODE message`` per finding and exits 1 when there is one. A line may opt out of one rule
with a trailing ``# lint: allow PPKnnn (why)``.
"""

from __future__ import annotations

import ast
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from ppokit.core import schema as S  # noqa: E402  (after the path: the checkout's schema, not an installed one)

PREFIXES = ("charts/", "losses/", "diag/", "perf/", "lm/", "dpo/")
# Paths relative to the package root.
SCHEMA_MODULE = "core/schema.py"
ALIASES_ALLOWED = ("runtime/logger.py",)  # the console also accepts other trainers' spellings of a metric
SCHEMA_ONLY = ("diagnostics/monitor.py", "analysis/doctor.py", "diagnostics/plots.py", "analysis/report.py",
               "analysis/experiments.py", "config/planner.py")
THRESHOLD_FREE = ("diagnostics/monitor.py", "analysis/doctor.py", "analysis/report.py")
ALGO_REGISTRY = "core/algos.py"
THRESHOLDS = (S.KL_WARN, S.KL_ALERT, S.CLIPFRAC_HIGH, S.KL_STOP_FACTOR)

_ALGO_COMPARE = (
    re.compile(r"""\balgo\w*\s*(==|!=)\s*[rbuf]?["']"""),            # algo == "ppo"
    re.compile(r"""["'][\w-]*["']\s*(==|!=)\s*[\w.]*\balgo\w*\b"""),  # "ppo" == cfg.algo
    re.compile(r"""\balgo\w*\s+(not\s+)?in\s+[(\[{]\s*["']"""),     # algo in ("ppo", "a2c")
)


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    code: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.code} {self.message}"


def known_metrics() -> set[str]:
    return set(S.METRICS) | set(S.LM_METRICS) | {f(p) for p in S.PERF_PHASES for f in (S.perf_time, S.perf_frac)}


def check_source(text: str, module: str, metrics: set[str] | None = None) -> list[Finding]:
    """The findings of every rule in ``text``, the source of package module ``module`` (e.g. ``"core/x.py"``)."""
    metrics = known_metrics() if metrics is None else metrics
    lines = text.splitlines()
    found: list[Finding] = []

    def add(line: int, code: str, message: str) -> None:
        if f"lint: allow {code}" not in (lines[line - 1] if 0 < line <= len(lines) else ""):
            found.append(Finding(module, line, code, message))

    if module != SCHEMA_MODULE:
        for node in ast.walk(ast.parse(text)):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            name = node.value
            if not name.startswith(PREFIXES) or " " in name or name.endswith("/"):
                continue
            if module in SCHEMA_ONLY:
                add(node.lineno, "PPK002", f"metric name {name!r} typed here: import it from ppokit.core.schema")
            elif name not in metrics and module not in ALIASES_ALLOWED:
                add(node.lineno, "PPK001", f"{name!r} is not a metric of ppokit.core.schema: define it there")
    if module in THRESHOLD_FREE:
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Constant) and isinstance(node.value, float)
                    and any(math.isclose(node.value, t) for t in THRESHOLDS)):
                add(node.lineno, "PPK003", f"threshold {node.value} typed here: use the schema's constant")
    if module != ALGO_REGISTRY:
        for n, line in enumerate(lines, 1):
            if any(p.search(line) for p in _ALGO_COMPARE):
                add(n, "PPK004", "algo compared with a string: branch on a field of core.algos.ALGOS instead")
    return found


def check_tree(package: Path) -> list[Finding]:
    metrics = known_metrics()
    out: list[Finding] = []
    for path in sorted(package.rglob("*.py")):
        out += check_source(path.read_text(), path.relative_to(package).as_posix(), metrics)
    return out


def main(argv: list[str]) -> int:
    package = Path(argv[0]) if argv else ROOT / "src" / "ppokit"
    findings = check_tree(package)
    for f in findings:
        print(f"{package}/{f}")
    if findings:
        print(f"{len(findings)} finding(s)", file=sys.stderr)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
