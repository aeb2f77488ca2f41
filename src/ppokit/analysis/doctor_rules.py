"""The doctor's rules: small functions, one per problem, applied in the PPO debugging checklist's order
(docs/diagnostics.md, "ppokit doctor").

Each rule reads a ``RuleContext`` (the run's columns and alerts, its return trend, what earlier rules found) and
returns a ``doctor.Finding`` or None. ``RULES`` is the ordered list ``doctor.diagnose`` runs; ``NOTES`` run after the
health verdict and never make a run unhealthy; ``ORDER`` ranks the problems. Where the live monitor watches the
same problem, the verdict is the monitor's own function with the thresholds of ``schema.py``, so an alert and the
doctor give one verdict (see ``doctor``'s docstring for the order and its source).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ppokit.analysis.diagnosis import MIN_UPDATES_TO_JUDGE, Finding, RunData  # noqa: F401  (re-exported)
from ppokit.core import schema as S
from ppokit.core.schema import (
    ADV_CONST,
    CLIPFRAC_HEALTHY,
    ENTROPY_PINNED,
    GRAD_ZERO,
    KL_BLOWUP_MIN_UPDATES,
    LR_ZERO,
    THRESHOLDS,
)
from ppokit.diagnostics.monitor import (
    RunSummary,
    clip_idle,
    critic_never_learned,
    entropy_collapse,
    kl_level,
    longest_run,
    nonfinite_counts,
    reward_signal,
)

__all__ = ["Finding", "RuleContext", "RULES", "NOTES", "ORDER", "checklist", "fin", "quarters", "Trend", "trend",
           "MIN_UPDATES_TO_JUDGE", "TREND_SIGMAS", "raise_fix"]

# A rise (or a fall from the best level) counts when it exceeds this many noise sigmas of one update's value
# (``trend``): a flat run with Gaussian noise crosses 3 sigmas on ~0.1% of its updates.
TREND_SIGMAS = 3.0
# For iid Gaussian noise, consecutive differences are N(0, 2 sigma^2), whose median absolute value is
# 0.6745 * sqrt(2) * sigma = 0.954 sigma; a trend or one jump moves few differences, so the median ignores them.
_MEDIAN_ABS_DIFF_PER_SIGMA = 0.6745 * math.sqrt(2.0)


def fin(xs: list[float]) -> list[float]:
    return [x for x in xs if math.isfinite(x)]


def _where(run: RunData, name: str, pred) -> list[tuple[int, float]]:
    """``(update, value)`` rows of column ``name`` where ``pred(value)`` holds."""
    return [(u, v) for u, v in zip(run.updates, run.col(name)) if pred(v)]


def _show(rows: list[tuple[int, float]], k: int = 5) -> str:
    """``value @ update`` for the first ``k`` rows, e.g. ``164.6 @ 1, 116 @ 2 (+3 more)``."""
    shown = ", ".join(f"{v:.4g} @ update {u}" for u, v in rows[:k])
    return shown + (f" (+{len(rows) - k} more)" if len(rows) > k else "")


def quarters(xs: list[float]) -> tuple[list[float], list[float]]:
    n = len(xs)
    q = max(1, n // 4)
    return fin(xs[:q]), fin(xs[n - q:])


@dataclass(frozen=True)
class Trend:
    """A curve's start and end levels, the best level it reached, its noise, and whether it rose."""

    start: float  # mean of the start window (the values before the curve's first jump)
    start_len: int
    end: float  # mean of the last quarter
    best: float  # the best mean of any window as long as the last quarter: what the run reached
    noise: float  # robust sigma of one value (from consecutive differences)
    rose: bool  # end clearly above start


def trend(values: list[float], rise_min: Callable[[float], float]) -> Trend | None:
    """The trend of ``values`` (one per update, NaN where none was measured); None with no finite value.

    The start window is the first tenth of the values, cut before the first jump larger than ``TREND_SIGMAS``
    noise sigmas: a window that holds the jump itself (DPO's accuracy 0 -> 1 at its second step, a return that
    rises within the first updates) has a mean that is neither the start nor the end. "Clearly" = by more than
    ``max(TREND_SIGMAS * noise, rise_min(start))``: against the curve's own noise, estimated from consecutive
    differences (their median, which a trend or a jump barely moves), not against a fraction of the start, so a
    run that starts near the best it can reach (0.96 -> 0.98 on a corridor whose optimum is 0.98) still rose.
    """
    xs = fin(values)
    if not xs:
        return None
    diffs = [abs(b - a) for a, b in itertools.pairwise(xs)]
    noise = statistics.median(diffs) / _MEDIAN_ABS_DIFF_PER_SIGMA if diffs else 0.0
    k = max(1, len(xs) // 10)
    jump = next((i for i in range(1, k) if diffs[i - 1] > TREND_SIGMAS * noise), k)
    start = statistics.fmean(xs[:jump])
    q = max(1, len(xs) // 4)
    end = statistics.fmean(xs[-q:])
    best = max(statistics.fmean(xs[i:i + q]) for i in range(len(xs) - q + 1))
    return Trend(start, jump, end, best, noise, end > start + max(TREND_SIGMAS * noise, rise_min(start)))


def raise_fix(name: str, current: Any, example: float) -> str:
    """"raise NAME ..." relative to the config's value, never suggesting the value it already has."""
    if isinstance(current, (int, float)) and not isinstance(current, bool) and current > 0:
        return f"raise {name} above {current:g} (e.g. {max(2 * current, example):g})"
    return f"raise {name} from {current!r} (e.g. {example:g})" if current is not None else \
        f"raise {name} (e.g. {example:g})"



@dataclass
class RuleContext:
    """What every rule reads (the run, its trend) and what earlier rules found (the debugging checklist's verdicts)."""

    run: RunData
    n: int
    flat: bool
    trend: str
    time_limit: int | None
    findings: list[Finding] = field(default_factory=list)
    signal_bad: bool = False
    opt_bad: bool = False
    entropy_bad: bool = False
    signal_note: str = "rewards/returns vary, advantages finite"  # the checklist's "ok (...)" text
    skipped: bool = False  # some minibatches were skipped (the optimization link's checklist line)
    q3: bool = False  # clip ~0 with a flat return: the checklist is printed
    _summary: RunSummary | None = None

    @property
    def summary(self) -> RunSummary:
        """The whole run as the monitor's verdicts read it (``monitor.RunSummary``), built once."""
        if self._summary is None:
            keys = list(self.run.cols)
            self._summary = RunSummary()
            for vals in zip(*self.run.cols.values()):
                self._summary.add(dict(zip(keys, vals)))
        return self._summary

    @property
    def t(self) -> dict:
        return THRESHOLDS

    @property
    def cfg_lr(self) -> Any:
        return self.run.config.get("learning_rate")

    @property
    def lr_peak(self) -> float:
        lr_f = fin(self.run.col(S.LEARNING_RATE))
        return max(lr_f) if lr_f else 0.0

    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "problem"]


# ---------------------------------------------------------------- the rules, in the debugging checklist's order
def _rule_nonfinite(c: RuleContext) -> Finding | None:
    """1. Non-finite values: nothing else means anything until the numbers are finite."""
    # The live rules' per-update verdict (``monitor.nonfinite_counts``) on each row of metrics.csv.
    keys = list(c.run.cols)
    rows = [(u, nonfinite_counts(dict(zip(keys, vals)))) for u, vals in zip(c.run.updates, zip(*c.run.cols.values()))]
    skipped = [(u, b["skipped"]) for u, b in rows if b["skipped"]]
    adv_bad = [(u, b["advantages"]) for u, b in rows if b["advantages"]]
    env_bad = [(u, b["env"]) for u, b in rows if b["env"]]
    loss_bad = _where(c.run, S.POLICY_LOSS, lambda v: not math.isfinite(v))
    c.skipped = bool(skipped)
    if not (skipped or adv_bad or env_bad or loss_bad):
        return None
    ev = []
    if skipped:
        ev.append(f"skipped minibatches (non-finite loss/gradient): {_show(skipped)}")
    if adv_bad:
        ev.append(f"non-finite advantages: {_show(adv_bad)}")
    if env_bad:
        ev.append(f"env steps with NaN/Inf observations or rewards: {_show(env_bad)}")
    if loss_bad:
        ev.append(f"non-finite policy loss on {len(loss_bad)} update(s), first at update {loss_bad[0][0]}")
    return Finding("nonfinite", "non-finite values in training", ev,
                   "find the NaN/Inf source first: check the env's rewards/observations, enable "
                   "normalize_reward, lower learning_rate; skipped minibatches mean no update happened",
                   sorted({u for u, _ in skipped + adv_bad + env_bad + loss_bad}))


def _rule_reward_signal(c: RuleContext) -> Finding | None:
    """2a. Signal validity: the live monitor's verdict (``monitor.reward_signal``), on the whole run."""
    run = c.run
    verdict = reward_signal(c.summary, c.time_limit)
    if verdict is None:
        return None
    cause, evidence = verdict
    if cause == "returns_at_time_limit":
        c.signal_note = "constant reward, every episode ran to the time limit: no terminal state reached yet"
        return Finding("returns_at_time_limit", "every episode ran to the time limit with the same return",
                       [evidence, "a constant per-step reward ranks actions through the episode length, which only "
                        "changes once an episode reaches a terminal state"],
                       "explore more (ent_coef, more steps) or shape the reward; the reward function itself can be "
                       "fine (Acrobot's -1 per step before its first swing-up)", severity="note")
    c.signal_bad = True
    zero_std = _where(run, S.REWARD_STD, lambda v: v == 0.0)
    alerts = _alert_steps(run, cause)
    alert_ev = [f"live alert {cause} at steps {alerts}"] if alerts else []
    if cause == "rewards_all_zero":
        return Finding("rewards_all_zero", "every reward is zero: there is no learning signal",
                       [evidence] + alert_ev,
                       "check the reward function / wrapper; on a sparse task shape the reward or explore more "
                       "(ent_coef, longer episodes) until some reward is seen", [u for u, _ in zero_std[:1]])
    return Finding("zero_reward_variance", "rewards and episode returns never vary: there is no learning signal",
                   [evidence] + alert_ev,
                   "check the reward function: a constant reward with constant episode lengths cannot rank actions")


def _rule_signal_alert_cleared(c: RuleContext) -> Finding | None:
    """A live signal alert that the whole run overturned: the monitor judged the updates up to it with the same
    verdict (``reward_signal``); later updates showed a signal. Said here so that the run has one verdict."""
    run = c.run
    fired = [name for name in ("rewards_all_zero", "zero_reward_variance") if _alert_steps(run, name)]
    if not fired or c.signal_bad:
        return None
    rets = fin(run.col(S.EPISODIC_RETURN))
    moved = [u for u, std, r in zip(run.updates, run.col(S.REWARD_STD), run.col(S.EPISODIC_RETURN))
             if (math.isfinite(std) and std != 0.0) or (rets and math.isfinite(r) and r != rets[0])]
    return Finding("signal_alert_cleared", "an early live alert about the reward signal no longer holds",
                   [f"live alert {name} at steps {_alert_steps(run, name)}: true of the updates before it"
                    for name in fired]
                   + ([f"the rewards or returns varied from update {moved[0]} on"] if moved else []),
                   "nothing to fix in the reward; judge the run by the findings above", moved[:1], severity="note")


def _rule_advantages_constant(c: RuleContext) -> Finding | None:
    """2b. Signal validity: constant advantages give a zero policy gradient."""
    adv_const = _where(c.run, S.ADVANTAGE_STD, lambda v: math.isfinite(v) and v < ADV_CONST)
    if len(adv_const) <= c.n / 2:
        return None
    c.signal_bad = True
    return Finding("advantages_constant", "advantages are constant: the policy gradient is zero",
                   [f"advantage std < {ADV_CONST:g} on {len(adv_const)}/{c.n} updates: {_show(adv_const)}"],
                   "check the rewards and value targets (GAE inputs); masks or dones may zero them",
                   [u for u, _ in adv_const[:5]])


def _rule_learning_rate(c: RuleContext) -> Finding | None:
    """3a. Optimization link: a learning rate of ~0, from the start or decayed early."""
    run, n = c.run, c.n
    lr_f = fin(run.col(S.LEARNING_RATE))
    if lr_f and max(lr_f) <= LR_ZERO:
        c.opt_bad = True
        return Finding("lr_zero", "the learning rate is 0: the optimizer never changes the policy",
                       [f"learning rate = {max(lr_f):g} on all {n} updates (config learning_rate = {c.cfg_lr!r})",
                        f"approx KL max {max(fin(run.col(S.APPROX_KL)) or [0]):.3g}, "
                        f"clip fraction max {max(fin(run.col(S.CLIPFRAC)) or [0]):.3g}"],
                       "set learning_rate > 0 (e.g. 3e-4; `ppokit plan` suggests one)", [1])
    if lr_f and statistics.median(lr_f) < 0.01 * max(lr_f):
        c.opt_bad = True
        low = _where(run, S.LEARNING_RATE, lambda v: math.isfinite(v) and v < 0.01 * max(lr_f))
        return Finding("lr_decayed", "the learning rate decayed to ~0 for most of the run",
                       [f"learning rate < 1% of its peak {max(lr_f):g} on {len(low)}/{n} updates, from "
                        f"update {low[0][0]}"], "anneal over the whole run (anneal_lr) or use a constant LR",
                       [low[0][0]])
    return None


def _rule_grad_zero(c: RuleContext) -> Finding | None:
    """3b. Optimization link: no gradient reaches the weights."""
    gn = fin(c.run.col(S.GRAD_NORM))
    if not (gn and statistics.median(gn) < GRAD_ZERO):
        return None
    c.opt_bad = True
    return Finding("grad_zero", "gradient norm ~0: no gradient reaches the weights",
                   [f"median grad norm {statistics.median(gn):.3g} over {c.n} updates"],
                   "check that the loss depends on the policy outputs (detached tensors, masks) and "
                   "that advantages are non-zero")


def _rule_kl_blowup(c: RuleContext) -> Finding | None:
    """4. KL blow-up: the live ``kl_blowup`` level (``monitor.kl_level``) on enough of the run."""
    run, n, t = c.run, c.n, c.t
    kl_hi = _where(run, S.APPROX_KL, lambda v: kl_level(v) == "alert")
    if not (len(kl_hi) >= max(KL_BLOWUP_MIN_UPDATES, math.ceil(0.05 * n)) or any(v > 1.0 for _, v in kl_hi)):
        return None
    worst = max(kl_hi, key=lambda r: r[1])
    return Finding(
        "kl_blowup", f"KL blow-up: the policy left the trust region (approx KL > {t['kl_alert']})",
        [f"approx KL > {t['kl_alert']} on {len(kl_hi)}/{n} updates: {_show(kl_hi)}",
         f"worst {worst[1]:.4g} at update {worst[0]} (healthy: 0-{t['kl_warn']})",
         f"config: learning_rate {c.cfg_lr!r}, update_epochs {run.config.get('update_epochs')!r}"],
        f"lower learning_rate (e.g. 10x) and/or update_epochs, or set target_kl = {t['kl_warn']:g} for early stopping",
        [u for u, _ in kl_hi])


def _rule_clipfrac_high(c: RuleContext) -> Finding | None:
    """5. Clip fraction sustained above the drift line: the live rule's run of updates, anywhere in the run."""
    t = c.t
    cf = c.run.col(S.CLIPFRAC)
    best, best_end = longest_run(cf, lambda v: v > t["clipfrac_high"])
    if best < t["clipfrac_patience"]:
        return None
    us = c.run.updates[best_end - best + 1: best_end + 1]
    return Finding(
        "clipfrac_high", f"clip fraction sustained above {t['clipfrac_high']}: drift / over-fitting each rollout",
        [f"clip fraction > {t['clipfrac_high']} for {best} consecutive updates ({us[0]}-{us[-1]}), max "
         f"{max(fin(cf)):.3g} (healthy {CLIPFRAC_HEALTHY[0]}-{CLIPFRAC_HEALTHY[1]})"],
        "lower learning_rate or update_epochs", us)


def _entropy_series(c: RuleContext) -> tuple[list[float], float, str] | None:
    """The run's finite entropies, the first one and the action kind; None with fewer than two updates."""
    ent_f = fin(c.run.col(S.ENTROPY))
    if len(ent_f) < 2:
        return None
    return ent_f, ent_f[0], c.run.action_kind or ("continuous" if min(ent_f) < 0 else "discrete")


def _rule_entropy_collapse(c: RuleContext) -> Finding | None:
    """6a. Entropy: the live ``entropy_collapse`` rule; a problem only while the return stayed flat."""
    run, n = c.run, c.n
    series = _entropy_series(c)
    if series is None:
        return None
    _, h0, kind = series
    collapsed = _where(run, S.ENTROPY, lambda v: entropy_collapse(h0, v, kind, run.action_dim) is not None)
    if not collapsed:
        return None
    rule = entropy_collapse(h0, collapsed[0][1], kind, run.action_dim)
    # ``c.flat`` is judged against the return's own noise (``trend``): a policy that converged at the level it
    # rose to, however close to its start, is not a collapse.
    if c.flat:
        c.entropy_bad = True
        return Finding(
            "entropy_collapse", "entropy collapsed: the policy became deterministic before the return improved",
            [f"entropy {rule} from update {collapsed[0][0]} on ({len(collapsed)}/{n} updates): "
             f"{_show(collapsed, 3)}", c.trend, f"config: ent_coef {run.config.get('ent_coef')!r}, "
             f"learning_rate {c.cfg_lr!r}"],
            raise_fix("ent_coef", run.config.get("ent_coef"), 0.01)
            + " and/or lower learning_rate so the policy keeps exploring",
            [collapsed[0][0]])
    return Finding("entropy_low", "entropy fell a lot while the return rose (convergence)",
                   [f"entropy {rule} from update {collapsed[0][0]}", c.trend],
                   "nothing to do if the return is at its optimum; otherwise "
                   + raise_fix("ent_coef", run.config.get("ent_coef"), 0.01),
                   [collapsed[0][0]], severity="note")


def _rule_entropy_pinned(c: RuleContext) -> Finding | None:
    """6b. Entropy pinned at its start with a flat return (and the signal and the optimizer fine)."""
    run, n = c.run, c.n
    series = _entropy_series(c)
    if series is None:
        return None
    ent_f, h0, kind = series
    pinned = all(abs(v - h0) <= ENTROPY_PINNED * max(abs(h0), 1e-8) or (kind == "continuous" and v > h0)
                 for v in ent_f)
    if not (pinned and c.flat and not c.opt_bad and not c.signal_bad):
        return None
    c.entropy_bad = True
    ent_coef = run.config.get("ent_coef")
    return Finding(
        "entropy_pinned", "entropy never decreased: the policy stays as random as at the start",
        [f"entropy stayed within {ENTROPY_PINNED:.0%} of its start {h0:.4g} (or above it) on all {n} "
         f"updates, last {ent_f[-1]:.4g}", c.trend, f"config: ent_coef {ent_coef!r}"],
        ("the entropy bonus dominates the policy gradient: lower ent_coef (typical 0-0.01)"
         if isinstance(ent_coef, (int, float)) and ent_coef >= S.ENT_COEF_DOMINANT else
         "the policy does not move: raise learning_rate or update_epochs"))


def _rule_critic(c: RuleContext) -> Finding | None:
    """7. The critic never learned: the live ``critic_not_learning`` verdict on the whole run."""
    if not critic_never_learned(c.summary):
        return None
    return Finding("critic_not_learning", "the critic never learned (explained variance <= 0 all run)",
                   [f"explained variance max {c.summary.ev_max:.3g} over {c.n} updates, last {c.summary.ev_last:.3g} "
                    "(should climb towards 1)"],
                   "check vf_coef, the reward scale (normalize_reward), learning_rate and gamma")


def _rule_clip_never_fires(c: RuleContext) -> Finding | None:
    """8. Clip ~0 on most updates (outside the annealed tail) with a flat return, and nothing else wrong."""
    run, t, peak = c.run, c.t, c.lr_peak
    # The live clip_never_fires's per-update test (``monitor.clip_idle``); the doctor adds "return flat".
    low_cf = [(u, v) for u, v, lr in zip(run.updates, run.col(S.CLIPFRAC), run.col(S.LEARNING_RATE))
              if clip_idle(v, lr, peak)]
    c.q3 = c.flat and len(low_cf) > c.n / 2
    if not c.q3 or c.problems():
        return None
    return Finding("clip_never_fires", "clip fraction ~0 and the return is flat: the updates are too small",
                   [f"clip fraction < {t['clipfrac_low']} on {len(low_cf)}/{c.n} updates", c.trend],
                   "raise learning_rate or update_epochs (signal, gradients and entropy look fine)")


def _rule_unsafe(c: RuleContext) -> Finding | None:
    if not c.run.unsafe:
        return None
    return Finding("unsafe_run", "the run was started with --unsafe (outside the guard rails)",
                   [f"config unsafe = {c.run.config.get('unsafe')!r}; UNSAFE file "
                    f"{'present' if (c.run.run_dir / 'UNSAFE').exists() else 'absent'}"],
                   "treat its results as an ablation, not a baseline", severity="note")


def _rule_monitoring_off(c: RuleContext) -> Finding | None:
    """A run with monitor_kl / monitor_clipfrac off raised no live alert of that kind; say so."""
    off = [(k, what) for k, what in (("monitor_kl", "approx KL (kl_high, kl_blowup)"),
                                     ("monitor_clipfrac", "clip fraction (clip_never_fires, clipfrac_high)"))
           if c.run.config.get(k) is False]
    if not off:
        return None
    return Finding("monitoring_off", "live monitoring was off for part of the diagnostics",
                   [f"{k} = false: no live alert on {what} was raised during the run" for k, what in off],
                   "the findings above still read metrics.csv; turn monitoring back on for a real run",
                   severity="note")


def _rule_kl_high(c: RuleContext) -> Finding | None:
    kl_warn = _where(c.run, S.APPROX_KL, lambda v: kl_level(v) == "warn")
    if not kl_warn:
        return None
    return Finding("kl_high", f"approx KL above {c.t['kl_warn']} on some updates (warn level)",
                   [f"{len(kl_warn)}/{c.n} updates: {_show(kl_warn, 3)}"],
                   "fine if rare; if frequent, lower learning_rate or set target_kl",
                   [u for u, _ in kl_warn], severity="note")


# The debugging checklist's order for "clip fraction ~0 but the return is flat" (signal validity -> optimization link ->
# entropy/exploration), with the trust-region and critic checks in between; each rule sees what the earlier ones
# found (``RuleContext``), e.g. a pinned entropy is only blamed once the signal and the optimizer are fine.
RULES = (_rule_nonfinite, _rule_reward_signal, _rule_signal_alert_cleared, _rule_advantages_constant,
         _rule_learning_rate, _rule_grad_zero, _rule_kl_blowup, _rule_clipfrac_high, _rule_entropy_collapse,
         _rule_entropy_pinned, _rule_critic, _rule_clip_never_fires, _rule_unsafe, _rule_monitoring_off)
NOTES = (_rule_kl_high,)  # after the health verdict: they never make a run unhealthy
ORDER = ["nonfinite", "rewards_all_zero", "zero_reward_variance", "advantages_constant", "lr_zero", "lr_decayed",
         "grad_zero", "kl_blowup", "clipfrac_high", "entropy_collapse", "entropy_pinned", "critic_not_learning",
         "clip_never_fires", "return_flat"]


def checklist(c: RuleContext) -> list[str]:
    """The debugging checklist lines: each step's verdict from the rules above."""
    gn = fin(c.run.col(S.GRAD_NORM))
    ent_f = fin(c.run.col(S.ENTROPY))
    peak = max(fin(c.run.col(S.LEARNING_RATE)) or [math.nan])
    return [
        "1 signal validity (rewards, advantages): " + ("PROBLEM" if c.signal_bad else f"ok ({c.signal_note})"),
        "2 optimization link (LR, grad norm, skipped steps): " + (
            "PROBLEM" if c.opt_bad or c.skipped else f"ok (LR up to {peak:.3g}, median grad norm "
                                                     f"{statistics.median(gn) if gn else math.nan:.3g})"),
        "3 entropy / exploration: " + ("PROBLEM" if c.entropy_bad else
                                       f"ok (entropy {ent_f[0]:.3g} -> {ent_f[-1]:.3g})" if ent_f else "no data"),
    ]



def _alert_steps(run: RunData, name: str) -> str:
    # alerts.jsonl is read as written: a hand-edited line may be any JSON value, not an alert object.
    steps = [a.get("step") for a in run.alerts if isinstance(a, dict) and a.get("name") == name]
    return ", ".join(str(s) for s in steps[:5]) + (" ..." if len(steps) > 5 else "")
