"""What the doctor's parts share: a run directory parsed (``RunData``), one finding (``Finding``), the result
(``Diagnosis``), and the verdicts every rule set ends with (healthy, too short to judge, an unreadable checkpoint).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ppokit.core import schema as S

__all__ = ["MIN_UPDATES_TO_JUDGE", "Finding", "Diagnosis", "RunData", "healthy_note", "checkpoint_finding",
           "too_short"]

MIN_UPDATES_TO_JUDGE = S.MIN_UPDATES_TO_JUDGE  # the schema's threshold (defined there, once)


@dataclass
class Finding:
    """One diagnosed problem (or note): its cause id, the evidence with update numbers, and the fix."""

    cause: str
    title: str
    evidence: list[str]
    fix: str
    updates: list[int] = field(default_factory=list)
    severity: str = "problem"  # problem | note


@dataclass
class Diagnosis:
    """The doctor's result: ranked problems first, then notes, plus the debugging checklist when it applied."""

    run_dir: str
    healthy: bool
    findings: list[Finding]
    checks: list[str]
    summary: str
    verdict: str = ""  # healthy | problem | too_short

    def __post_init__(self) -> None:
        if not self.verdict:
            self.verdict = "healthy" if self.healthy else "problem"

    @property
    def problems(self) -> list[Finding]:
        """Findings of severity ``problem`` in rank order."""
        return [f for f in self.findings if f.severity == "problem"]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (``ppokit doctor --json``)."""
        return {"run_dir": self.run_dir, "healthy": self.healthy, "verdict": self.verdict, "summary": self.summary,
                "checks": self.checks, "findings": [asdict(f) for f in self.findings]}

    def to_text(self) -> str:
        """Plain-text report: summary, the debugging checklist, then each finding with evidence and fix."""
        out = [f"ppokit doctor: {self.run_dir}", self.summary, ""]
        if self.checks:
            out.append("Clip fraction ~0 and return flat: checked in this order (docs/diagnostics.md)")
            out += [f"  {c}" for c in self.checks] + [""]
        for i, f in enumerate(self.findings, 1):
            tag = "PROBLEM" if f.severity == "problem" else "note"
            out.append(f"{i}. [{tag}] {f.title} ({f.cause})")
            out += [f"   - {e}" for e in f.evidence]
            out.append(f"   fix: {f.fix}")
            out.append("")
        return "\n".join(out).rstrip() + "\n"


@dataclass
class RunData:
    """What a run directory holds, parsed."""

    run_dir: Path
    cols: dict[str, list[float]]
    alerts: list[dict]
    config: dict[str, Any]
    action_kind: str | None
    action_dim: int
    unsafe: bool
    checkpoint_error: str | None = None  # one line naming the file and why: it exists but cannot be read

    def col(self, name: str) -> list[float]:
        """A metrics column (NaN-filled when absent)."""
        return self.cols.get(name) or [math.nan] * len(self.updates)

    @property
    def updates(self) -> list[int]:
        """Update numbers of the rows (1-based as logged)."""
        u = self.cols.get(S.UPDATE) or []
        return [int(x) if math.isfinite(x) else i + 1 for i, x in enumerate(u)]


def healthy_note(trend_text: str, checkpoint_ok: bool = True) -> Finding:
    """The note of a run the rules found nothing wrong with (its metrics only, when the checkpoint is not ok)."""
    return Finding("healthy", "healthy run" if checkpoint_ok else "the metrics show a healthy run", [trend_text],
                   "nothing to fix" if checkpoint_ok else "nothing to fix in the training", severity="note")


def checkpoint_finding(run: RunData) -> Finding | None:
    """The run's checkpoint exists but cannot be read (truncated, flipped bytes, not a checkpoint): one line."""
    if run.checkpoint_error is None:
        return None
    return Finding("checkpoint_unreadable", "the checkpoint cannot be read", [run.checkpoint_error],
                   "resume, eval and load need it: restore it from a copy or retrain; the metrics above are "
                   "still read from metrics.csv")


def too_short(diagnosis: Diagnosis, n: int, unit: str) -> Diagnosis:
    """``diagnosis`` of a run with fewer than ``MIN_UPDATES_TO_JUDGE`` updates: no verdict, its findings notes."""
    if n >= MIN_UPDATES_TO_JUDGE:
        return diagnosis
    notes = [Finding(f.cause, f.title, f.evidence, f.fix, f.updates, severity="note")
             for f in diagnosis.findings if f.cause != "healthy"]
    head = Finding("too_short", "too short to judge",
                   [f"{n} {unit}(s) logged; the doctor judges a run from {MIN_UPDATES_TO_JUDGE} {unit}s on"],
                   f"train for at least {MIN_UPDATES_TO_JUDGE} {unit}s, then run the doctor again", severity="note")
    summary = (f"TOO SHORT TO JUDGE: {n} {unit}(s), fewer than the {MIN_UPDATES_TO_JUDGE} the doctor needs; "
               "the notes below are what they show, not a verdict")
    return Diagnosis(diagnosis.run_dir, False, [head, *notes], [], summary, "too_short")
