"""``ppokit doctor``: a ranked diagnosis of a finished (or running) PPO run from the files it wrote.

Reads ``metrics.csv`` (via ``plots.read_metrics``), ``alerts.jsonl`` and ``config.toml`` and applies the rules
below, in this rank order (the first finding is the one to fix first):

1. non-finite values: NaN/Inf losses, advantages or env outputs, skipped minibatches (everything else is
   meaningless until the numbers are finite);
2. signal validity (lesson Q3, step 1): rewards all zero, rewards and returns constant, advantages constant;
3. optimization link (Q3, step 2): learning rate ~0 (or decayed to ~0 early), gradient norm ~0;
4. KL blow-up (> 0.1), 5. clip fraction sustained > 0.4 (drift);
6. entropy (Q3, step 3): collapse while the return is flat, or pinned at its start by a dominant bonus;
7. critic never learning (explained variance never > 0);
8. clip fraction ~0 with a flat return and none of the above: the steps are simply too small.

A run with none of these is reported healthy (exit code 0); otherwise exit code 1.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from .monitor import THRESHOLDS

__all__ = ["Finding", "Diagnosis", "diagnose", "RunData", "load_run"]

# Doctor-only thresholds (the live ones come from the monitor's THRESHOLDS).
LR_ZERO = 1e-10  # a learning rate at or below this cannot move the weights
GRAD_ZERO = 1e-6  # median gradient norm below this: no gradient reaches the weights
ADV_CONST = 1e-8  # advantage std below this: every advantage is the same
KL_BLOWUP_MIN_UPDATES = 2  # KL > kl_alert on at least this many updates (or 5%) is a blow-up
ENTROPY_PINNED = 0.02  # entropy within 2% of its start (relative to the start) all run: the policy never moved


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
    """The doctor's result: ranked problems first, then notes, plus the Q3 checklist when it applied."""

    run_dir: str
    healthy: bool
    findings: list[Finding]
    checks: list[str]
    summary: str

    @property
    def problems(self) -> list[Finding]:
        """Findings of severity ``problem`` in rank order."""
        return [f for f in self.findings if f.severity == "problem"]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (``ppokit doctor --json``)."""
        return {"run_dir": self.run_dir, "healthy": self.healthy, "summary": self.summary, "checks": self.checks,
                "findings": [asdict(f) for f in self.findings]}

    def to_text(self) -> str:
        """Plain-text report: summary, Q3 checklist, then each finding with evidence and fix."""
        out = [f"ppokit doctor: {self.run_dir}", self.summary, ""]
        if self.checks:
            out.append("Clip fraction ~0 and return flat: checked in the lesson's order")
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

    def col(self, name: str) -> list[float]:
        """A metrics column (NaN-filled when absent)."""
        return self.cols.get(name) or [math.nan] * len(self.updates)

    @property
    def updates(self) -> list[int]:
        """Update numbers of the rows (1-based as logged)."""
        u = self.cols.get("update") or []
        return [int(x) if math.isfinite(x) else i + 1 for i, x in enumerate(u)]


def load_run(run_dir: str | Path) -> RunData:
    """Parse ``metrics.csv``, ``alerts.jsonl``, ``config.toml`` (and the policy kind from the checkpoint)."""
    from .plots import read_metrics

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
    kind, dim = None, 1
    ckpt_path = run_dir / "checkpoint.pt"
    if ckpt_path.is_file():
        try:
            from .checkpoint import load_checkpoint

            spec = load_checkpoint(ckpt_path).get("policy_spec", {})
            kind = spec.get("kind")
            dim = int((spec.get("action_dims") or [1])[0]) if kind == "continuous" else 1
        except Exception:  # noqa: BLE001 - a damaged checkpoint must not stop the diagnosis
            kind = None
    unsafe = bool(config.get("unsafe")) or (run_dir / "UNSAFE").exists()
    return RunData(run_dir, cols, alerts, config, kind, dim, unsafe)


def _fin(xs: list[float]) -> list[float]:
    return [x for x in xs if math.isfinite(x)]


def _where(run: RunData, name: str, pred) -> list[tuple[int, float]]:
    """``(update, value)`` rows of column ``name`` where ``pred(value)`` holds."""
    return [(u, v) for u, v in zip(run.updates, run.col(name)) if pred(v)]


def _show(rows: list[tuple[int, float]], k: int = 5) -> str:
    """``value @ update`` for the first ``k`` rows, e.g. ``164.6 @ 1, 116 @ 2 (+3 more)``."""
    shown = ", ".join(f"{v:.4g} @ update {u}" for u, v in rows[:k])
    return shown + (f" (+{len(rows) - k} more)" if len(rows) > k else "")


def _quarters(xs: list[float]) -> tuple[list[float], list[float]]:
    n = len(xs)
    q = max(1, n // 4)
    return _fin(xs[:q]), _fin(xs[n - q:])


def return_trend(run: RunData) -> tuple[bool, str]:
    """``(flat, evidence)``: flat when the last quarter's mean return is not clearly above the first quarter's.

    "Clearly above" = by more than max(50% of |first|, one std of the first quarter's per-update returns).
    """
    ret = run.col("charts/episodic_return")
    first, last = _quarters(ret)
    if not first or not last:
        allr = _fin(ret)
        if not allr:
            return True, "no episode finished during the run"
        return False, f"too few finished episodes to judge the trend (mean return {statistics.fmean(allr):.4g})"
    a, b = statistics.fmean(first), statistics.fmean(last)
    sd = statistics.pstdev(first) if len(first) > 1 else 0.0
    flat = b <= a + max(0.5 * abs(a), sd)
    return flat, f"mean return {a:.4g} in the first quarter of updates -> {b:.4g} in the last quarter"


def diagnose(run_dir: str | Path) -> Diagnosis:
    """Diagnose the run in ``run_dir``; problems ranked as in the module docstring."""
    run = load_run(run_dir)
    n = len(run.updates)
    findings: list[Finding] = []
    checks: list[str] = []
    if n == 0:
        f = Finding("no_updates", "the run logged no update", ["metrics.csv has no rows"],
                    "let the run finish at least one update (total_timesteps >= num_envs * num_steps)")
        return Diagnosis(str(run_dir), False, [f], [], "no data")
    t = THRESHOLDS
    flat, trend = return_trend(run)
    lr = run.col("charts/learning_rate")
    cfg_lr = run.config.get("learning_rate")

    # ---- 1. non-finite values
    skipped = _where(run, "diag/skipped_minibatches", lambda v: math.isfinite(v) and v > 0)
    adv_bad = _where(run, "diag/advantages_nonfinite", lambda v: math.isfinite(v) and v > 0)
    env_bad = _where(run, "diag/nonfinite_env", lambda v: math.isfinite(v) and v > 0)
    loss_bad = _where(run, "losses/policy_loss", lambda v: not math.isfinite(v))
    if skipped or adv_bad or env_bad or loss_bad:
        ev = []
        if skipped:
            ev.append(f"skipped minibatches (non-finite loss/gradient): {_show(skipped)}")
        if adv_bad:
            ev.append(f"non-finite advantages: {_show(adv_bad)}")
        if env_bad:
            ev.append(f"env steps with NaN/Inf observations or rewards: {_show(env_bad)}")
        if loss_bad:
            ev.append(f"non-finite policy loss on {len(loss_bad)} update(s), first at update {loss_bad[0][0]}")
        findings.append(Finding("nonfinite", "non-finite values in training", ev,
                                "find the NaN/Inf source first: check the env's rewards/observations, enable "
                                "normalize_reward, lower learning_rate; skipped minibatches mean no update happened",
                                sorted({u for u, _ in skipped + adv_bad + env_bad + loss_bad})))

    # ---- 2. signal validity
    rstd = run.col("diag/reward_std")
    rets = _fin(run.col("charts/episodic_return"))
    zero_std = _where(run, "diag/reward_std", lambda v: v == 0.0)
    all_zero_std = len(_fin(rstd)) > 0 and len(zero_std) == len(_fin(rstd))
    signal_bad = False
    if all_zero_std and (not rets or all(r == 0.0 for r in rets)):
        signal_bad = True
        findings.append(Finding(
            "rewards_all_zero", "every reward is zero: there is no learning signal",
            [f"reward std = 0 on all {n} updates", f"episode returns all 0 ({len(rets)} update(s) with finished "
             "episodes)" if rets else "no episode finished"]
            + [f"live alert rewards_all_zero at steps {_alert_steps(run, 'rewards_all_zero')}"] * bool(
                _alert_steps(run, "rewards_all_zero")),
            "check the reward function / wrapper; on a sparse task shape the reward or explore more "
            "(ent_coef, longer episodes) until some reward is seen", [u for u, _ in zero_std[:1]]))
    elif all_zero_std and len(rets) >= 3 and max(rets) == min(rets):
        signal_bad = True
        findings.append(Finding(
            "zero_reward_variance", "rewards and episode returns never vary: there is no learning signal",
            [f"reward std = 0 on all {n} updates and every episode returned {rets[0]:.4g}"],
            "check the reward function: a constant reward with constant episode lengths cannot rank actions"))
    adv_const = _where(run, "diag/advantage_std", lambda v: math.isfinite(v) and v < ADV_CONST)
    if len(adv_const) > n / 2:
        signal_bad = True
        findings.append(Finding("advantages_constant", "advantages are constant: the policy gradient is zero",
                                [f"advantage std < {ADV_CONST:g} on {len(adv_const)}/{n} updates: {_show(adv_const)}"],
                                "check the rewards and value targets (GAE inputs); masks or dones may zero them",
                                [u for u, _ in adv_const[:5]]))
    checks.append("1 signal validity (rewards, advantages): " + ("PROBLEM" if signal_bad else
                                                               "ok (rewards/returns vary, advantages finite)"))

    # ---- 3. optimization link
    opt_bad = False
    lr_f = _fin(lr)
    if lr_f and max(lr_f) <= LR_ZERO:
        opt_bad = True
        findings.append(Finding("lr_zero", "the learning rate is 0: the optimizer never changes the policy",
                                [f"learning rate = {max(lr_f):g} on all {n} updates (config learning_rate = "
                                 f"{cfg_lr!r})", f"approx KL max {max(_fin(run.col('diag/approx_kl')) or [0]):.3g}, "
                                 f"clip fraction max {max(_fin(run.col('diag/clipfrac')) or [0]):.3g}"],
                                "set learning_rate > 0 (e.g. 3e-4; `ppokit plan` suggests one)", [1]))
    elif lr_f and statistics.median(lr_f) < 0.01 * max(lr_f):
        opt_bad = True
        low = _where(run, "charts/learning_rate", lambda v: math.isfinite(v) and v < 0.01 * max(lr_f))
        findings.append(Finding("lr_decayed", "the learning rate decayed to ~0 for most of the run",
                                [f"learning rate < 1% of its peak {max(lr_f):g} on {len(low)}/{n} updates, from "
                                 f"update {low[0][0]}"], "anneal over the whole run (anneal_lr) or use a constant LR",
                                [low[0][0]]))
    gn = _fin(run.col("diag/grad_norm"))
    if gn and statistics.median(gn) < GRAD_ZERO:
        opt_bad = True
        findings.append(Finding("grad_zero", "gradient norm ~0: no gradient reaches the weights",
                                [f"median grad norm {statistics.median(gn):.3g} over {n} updates"],
                                "check that the loss depends on the policy outputs (detached tensors, masks) and "
                                "that advantages are non-zero"))
    checks.append("2 optimization link (LR, grad norm, skipped steps): " + (
        "PROBLEM" if opt_bad or skipped else f"ok (LR up to {max(lr_f) if lr_f else math.nan:.3g}, median grad norm "
                                             f"{statistics.median(gn) if gn else math.nan:.3g})"))

    # ---- 4. KL blow-up
    kl_hi = _where(run, "diag/approx_kl", lambda v: v > t["kl_alert"])
    if len(kl_hi) >= max(KL_BLOWUP_MIN_UPDATES, math.ceil(0.05 * n)) or any(v > 1.0 for _, v in kl_hi):
        worst = max(kl_hi, key=lambda r: r[1])
        findings.append(Finding(
            "kl_blowup", f"KL blow-up: the policy left the trust region (approx KL > {t['kl_alert']})",
            [f"approx KL > {t['kl_alert']} on {len(kl_hi)}/{n} updates: {_show(kl_hi)}",
             f"worst {worst[1]:.4g} at update {worst[0]} (healthy: 0-{t['kl_warn']})",
             f"config: learning_rate {cfg_lr!r}, update_epochs {run.config.get('update_epochs')!r}"],
            "lower learning_rate (e.g. 10x) and/or update_epochs, or set target_kl = 0.02 for early stopping",
            [u for u, _ in kl_hi]))

    # ---- 5. sustained high clip fraction
    cf = run.col("diag/clipfrac")
    run_len, best, best_end = 0, 0, 0
    for i, c in enumerate(cf):
        run_len = run_len + 1 if c > t["clipfrac_high"] else 0
        if run_len > best:
            best, best_end = run_len, i
    if best >= t["clipfrac_patience"]:
        us = run.updates[best_end - best + 1: best_end + 1]
        findings.append(Finding(
            "clipfrac_high", f"clip fraction sustained above {t['clipfrac_high']}: drift / over-fitting each rollout",
            [f"clip fraction > {t['clipfrac_high']} for {best} consecutive updates ({us[0]}-{us[-1]}), max "
             f"{max(_fin(cf)):.3g} (healthy 0.1-0.3)"],
            "lower learning_rate or update_epochs", us))

    # ---- 6. entropy
    ent = run.col("diag/entropy")
    ent_f = _fin(ent)
    entropy_bad = False
    if len(ent_f) >= 2:
        h0 = ent_f[0]
        kind = run.action_kind or ("continuous" if min(ent_f) < 0 else "discrete")
        if kind == "continuous":
            drop = t["entropy_collapse_nats_per_dim"] * run.action_dim
            collapsed = _where(run, "diag/entropy", lambda v: math.isfinite(v) and h0 - v > drop)
            rule = f"more than {drop:g} nats below its start {h0:.4g}"
        else:
            collapsed = _where(run, "diag/entropy", lambda v: math.isfinite(v) and v < t["entropy_collapse_frac"] * h0)
            rule = f"below {t['entropy_collapse_frac']:.0%} of its start {h0:.4g}"
        if collapsed and flat:
            entropy_bad = True
            findings.append(Finding(
                "entropy_collapse", "entropy collapsed: the policy became deterministic before the return improved",
                [f"entropy {rule} from update {collapsed[0][0]} on ({len(collapsed)}/{n} updates): "
                 f"{_show(collapsed, 3)}", trend, f"config: ent_coef {run.config.get('ent_coef')!r}, "
                 f"learning_rate {cfg_lr!r}"],
                "raise ent_coef (e.g. 0.01) and/or lower learning_rate so the policy keeps exploring",
                [collapsed[0][0]]))
        elif collapsed:
            findings.append(Finding("entropy_low", "entropy fell a lot while the return rose (convergence)",
                                    [f"entropy {rule} from update {collapsed[0][0]}", trend],
                                    "nothing to do if the return is at its optimum; otherwise raise ent_coef",
                                    [collapsed[0][0]], severity="note"))
        pinned = all(abs(v - h0) <= ENTROPY_PINNED * max(abs(h0), 1e-8) or (kind == "continuous" and v > h0)
                     for v in ent_f)
        if pinned and flat and not opt_bad and not signal_bad:
            entropy_bad = True
            ent_coef = run.config.get("ent_coef")
            findings.append(Finding(
                "entropy_pinned", "entropy never decreased: the policy stays as random as at the start",
                [f"entropy stayed within {ENTROPY_PINNED:.0%} of its start {h0:.4g} (or above it) on all {n} "
                 f"updates, last {ent_f[-1]:.4g}", trend, f"config: ent_coef {ent_coef!r}"],
                ("the entropy bonus dominates the policy gradient: lower ent_coef (typical 0-0.01)"
                 if isinstance(ent_coef, (int, float)) and ent_coef >= 0.1 else
                 "the policy does not move: raise learning_rate or update_epochs")))
    checks.append("3 entropy / exploration: " + ("PROBLEM" if entropy_bad else
                                                 f"ok (entropy {ent_f[0]:.3g} -> {ent_f[-1]:.3g})" if ent_f else "no data"))

    # ---- 7. critic never learning
    evs = _fin(run.col("diag/explained_variance"))
    if n >= 10 and evs and max(evs) <= t["ev_min"]:
        findings.append(Finding("critic_not_learning", "the critic never learned (explained variance <= 0 all run)",
                                [f"explained variance max {max(evs):.3g} over {n} updates, last {evs[-1]:.3g} "
                                 "(should climb towards 1)"],
                                "check vf_coef, the reward scale (normalize_reward), learning_rate and gamma"))

    # ---- 8. clip ~0 and flat return with nothing else found
    lr_peak = max(lr_f) if lr_f else 0.0
    low_cf = [(u, c) for u, c, l in zip(run.updates, cf, lr)
              if math.isfinite(c) and c < t["clipfrac_low"] and not (math.isfinite(l) and l < t["lr_tail_frac"] * lr_peak)]
    q3 = flat and len(low_cf) > n / 2
    if q3 and not [f for f in findings if f.severity == "problem"]:
        findings.append(Finding("clip_never_fires", "clip fraction ~0 and the return is flat: the updates are too small",
                                [f"clip fraction < {t['clipfrac_low']} on {len(low_cf)}/{n} updates", trend],
                                "raise learning_rate or update_epochs (signal, gradients and entropy look fine)"))

    if run.unsafe:
        findings.append(Finding("unsafe_run", "the run was started with --unsafe (outside the guard rails)",
                                [f"config unsafe = {run.config.get('unsafe')!r}; UNSAFE file "
                                 f"{'present' if (run.run_dir / 'UNSAFE').exists() else 'absent'}"],
                                "treat its results as an ablation, not a baseline", severity="note"))
    if not flat and not [f for f in findings if f.severity == "problem"]:
        findings.insert(0, Finding("healthy", "healthy run", [trend], "nothing to fix", severity="note"))
    kl_warn = _where(run, "diag/approx_kl", lambda v: t["kl_warn"] < v <= t["kl_alert"])
    if kl_warn:
        findings.append(Finding("kl_high", f"approx KL above {t['kl_warn']} on some updates (warn level)",
                                [f"{len(kl_warn)}/{n} updates: {_show(kl_warn, 3)}"],
                                "fine if rare; if frequent, lower learning_rate or set target_kl",
                                [u for u, _ in kl_warn], severity="note"))

    problems = [f for f in findings if f.severity == "problem"]
    if not problems and flat:
        problems.append(Finding("return_flat", "the return did not improve, with no other symptom", [trend],
                                "train longer (budget), or re-plan with `ppokit plan`"))
        findings.insert(0, problems[0])
    order = ["nonfinite", "rewards_all_zero", "zero_reward_variance", "advantages_constant", "lr_zero", "lr_decayed",
             "grad_zero", "kl_blowup", "clipfrac_high", "entropy_collapse", "entropy_pinned", "critic_not_learning",
             "clip_never_fires", "return_flat"]
    findings.sort(key=lambda f: (f.severity != "problem" and f.cause != "healthy",
                                 order.index(f.cause) if f.cause in order else len(order)))
    healthy = not problems
    summary = ("HEALTHY: no problem found. " + trend) if healthy else (
        f"{len(problems)} problem(s) found; fix the first one first: {problems[0].title}")
    return Diagnosis(str(run_dir), healthy, findings, checks if q3 else [], summary)


def _alert_steps(run: RunData, name: str) -> str:
    steps = [a.get("step") for a in run.alerts if a.get("name") == name]
    return ", ".join(str(s) for s in steps[:5]) + (" ..." if len(steps) > 5 else "")
