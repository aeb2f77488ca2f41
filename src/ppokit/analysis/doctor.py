"""``ppokit doctor``: a ranked diagnosis of a finished (or running) PPO run from the files it wrote.

Reads ``metrics.csv`` (via ``plots.read_metrics``), ``alerts.jsonl`` and ``config.toml`` and applies the rules
below, in this rank order (the first finding is the one to fix first):

1. non-finite values: NaN/Inf losses, advantages or env outputs, skipped minibatches (everything else is
   meaningless until the numbers are finite);
2. signal validity (checklist step 1): rewards all zero, rewards and returns constant, advantages constant;
3. optimization link (checklist step 2): learning rate ~0 (or decayed to ~0 early), gradient norm ~0;
4. KL blow-up (> 0.1), 5. clip fraction sustained > 0.4 (drift);
6. entropy (checklist step 3): collapse while the return is flat, or pinned at its start by a dominant bonus;
7. critic never learning (explained variance never > 0);
8. clip fraction ~0 with a flat return and none of the above: the steps are simply too small.

A run with none of these is reported healthy (exit code 0); otherwise exit code 1. A run with fewer than
``MIN_UPDATES_TO_JUDGE`` updates gets no verdict: "too short to judge" (exit code 0: nothing is wrong with it, there
is too little of it), its findings listed as notes. The return's trend (``doctor_rules.trend``) compares the start
(before the first jump) with the last quarter, against the curve's own noise rather than a fraction of the start.
A checkpoint that exists but cannot be read is a finding of its own; the metrics are still diagnosed.

Each step is a small rule function in ``doctor_rules.RULES`` (in this order) returning a finding or None. Where the live
monitor watches the same problem, the verdict is the monitor's own function (``monitor.reward_signal``,
``kl_level``, ``entropy_collapse``, ``critic_never_learned``, ``nonfinite_counts``, ``longest_run``,
``clip_idle``) with the thresholds of ``schema.py``, applied to the whole run instead of the updates seen so far,
so an alert and the doctor give one verdict; an early signal alert that later updates overturned is named as
such. A run with ``monitor_kl`` / ``monitor_clipfrac`` off (``--unsafe``) gets a note: no live alert of that kind
was raised.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from ppokit.analysis.diagnosis import Diagnosis, RunData, checkpoint_finding, healthy_note, too_short
from ppokit.analysis.doctor_lm import LM_META, diagnose_lm, is_lm_run, lm_run_config
from ppokit.analysis.doctor_rules import (
    MIN_UPDATES_TO_JUDGE,
    NOTES,
    ORDER,
    RULES,
    Finding,
    RuleContext,
    checklist,
    fin,
    quarters,
    trend,
)
from ppokit.core import schema as S
from ppokit.diagnostics.monitor import episode_time_limit

__all__ = ["Finding", "Diagnosis", "diagnose", "RunData", "load_run", "RULES", "MIN_UPDATES_TO_JUDGE",
           "RETURN_RISE_REL", "too_short", "checkpoint_finding"]

# A rise smaller than 1% of the start's magnitude is flat however steady it is (a noise-free curve has noise 0).
RETURN_RISE_REL = 0.01


def load_run(run_dir: str | Path) -> RunData:
    """Parse ``metrics.csv``, ``alerts.jsonl``, ``config.toml`` (and the policy kind from the checkpoint)."""
    from ppokit.diagnostics.plots import read_metrics

    run_dir = Path(run_dir)
    csv_path = run_dir / "metrics.csv"
    if not csv_path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a ppokit run directory: no metrics.csv")
    cols = read_metrics(csv_path)
    alerts = []
    if (run_dir / "alerts.jsonl").is_file():
        for line in (run_dir / "alerts.jsonl").read_text().splitlines():
            if line.strip():
                try:
                    alerts.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    config: dict[str, Any] = {}
    if (run_dir / "config.toml").is_file():
        try:
            config = tomllib.loads((run_dir / "config.toml").read_text())
        except tomllib.TOMLDecodeError:
            config = {}
    kind, dim, ckpt_error = None, 1, None

    if (run_dir / LM_META).is_file():
        from ppokit.lm.durable import CHECKPOINT as ckpt_name
    else:
        from ppokit.training.state import CHECKPOINT_NAME as ckpt_name
    ckpt_path = run_dir / ckpt_name
    if ckpt_path.is_file():
        from ppokit.runtime.checkpoint import CheckpointError, load_checkpoint, one_line

        try:
            state = load_checkpoint(ckpt_path)
            spec = state.get("policy_spec") or {}
            kind = spec.get("kind") if isinstance(spec, dict) else None
            dim = int((spec.get("action_dims") or [1])[0]) if kind == "continuous" else 1
        except Exception as exc:  # noqa: BLE001 - a damaged checkpoint is reported, and the metrics still read
            # CheckpointError's message names the file and the reason; anything else gets the file's name added.
            why = " ".join(str(exc).split()) if isinstance(exc, CheckpointError) else one_line(exc)
            kind, dim, ckpt_error = None, 1, why if str(ckpt_path) in why else f"{ckpt_path}: {why}"
    if not config:  # a language-model run keeps its config in lm_run.json
        config = lm_run_config(run_dir)
    unsafe = bool(config.get("unsafe")) or (run_dir / "UNSAFE").exists()
    return RunData(run_dir, cols, alerts, config, kind, dim, unsafe, ckpt_error)


def return_trend(run: RunData) -> tuple[bool, str]:
    """``(flat, evidence)`` of the per-update return (``doctor_rules.trend``): flat unless the last quarter's mean
    is clearly above the start's, by more than ``TREND_SIGMAS`` noise sigmas and ``RETURN_RISE_REL`` of |start|.

    The first update is left out once the run is long enough to judge: only the episodes shorter than the rollout
    end in it, so its mean is biased low (measured: 15.9 against ~24 for the same fixed random CartPole policy in
    the updates after it, with lr 0 and with ent_coef 5).
    """
    ret = run.col(S.EPISODIC_RETURN)
    first, last = quarters(ret)
    if not first or not last:
        allr = fin(ret)
        if not allr:
            return True, "no episode finished during the run"
        return False, f"too few finished episodes to judge the trend (mean return {statistics.fmean(allr):.4g})"
    skip = 1 if len(fin(ret)) >= MIN_UPDATES_TO_JUDGE else 0
    t = trend(ret[skip:] if fin(ret[skip:]) else ret, lambda start: RETURN_RISE_REL * abs(start))
    where = f"{t.start_len} update(s)" + (" after the first" if skip else "")
    return not t.rose, (f"mean return {t.start:.4g} at the start ({where}) -> {t.end:.4g} in the last quarter "
                        f"(best {t.best:.4g}, noise {t.noise:.2g})")


def diagnose(run_dir: str | Path) -> Diagnosis:
    """Diagnose the run in ``run_dir``: ``RULES`` in order, problems ranked as in the module docstring."""
    run = load_run(run_dir)

    if is_lm_run(run):
        return diagnose_lm(run)
    n = len(run.updates)
    if n == 0:
        f = Finding("no_updates", "the run logged no update", ["metrics.csv has no rows"],
                    "let the run finish at least one update (total_timesteps >= num_envs * num_steps)")
        return Diagnosis(str(run_dir), False, [f], [], "no data")
    flat, trend_text = return_trend(run)
    env_kwargs = run.config.get("env_kwargs")
    c = RuleContext(run, n, flat, trend_text, episode_time_limit(run.config.get("env_id"),
                                                               env_kwargs if isinstance(env_kwargs, dict) else None))
    for rule in RULES:
        finding = rule(c)
        if finding is not None:
            c.findings.append(finding)
    findings = c.findings
    if not flat and not c.problems():
        findings.insert(0, healthy_note(trend_text))
    findings += [f for f in (rule(c) for rule in NOTES) if f is not None]
    problems = c.problems()
    if not problems and flat:
        problems.append(Finding("return_flat", "the return did not improve, with no other symptom", [trend_text],
                                "train longer (budget), or re-plan with `ppokit plan`"))
        findings.insert(0, problems[0])
    unreadable = checkpoint_finding(run)
    if unreadable is not None:
        findings = [healthy_note(f.evidence[0], False) if f.cause == "healthy" else f for f in findings]
        findings.append(unreadable)
        problems.append(unreadable)
    findings.sort(key=lambda f: (f.severity != "problem" and f.cause != "healthy",
                                 ORDER.index(f.cause) if f.cause in ORDER else len(ORDER)))
    healthy = not problems
    summary = ("HEALTHY: no problem found. " + trend_text) if healthy else (
        f"{len(problems)} problem(s) found; fix the first one first: {problems[0].title}")
    return too_short(Diagnosis(str(run_dir), healthy, findings, checklist(c) if c.q3 else [], summary), n, "update")
