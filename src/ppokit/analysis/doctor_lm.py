"""``ppokit doctor`` for language-model runs (``ppokit.lm``): what RLHF users fear, read from ``metrics.csv``.

``doctor.diagnose`` hands a run directory here when its metrics carry the LM columns (``is_lm_run``). The rules,
in rank order (the first finding is the one to fix first):

1. non-finite numbers (score, KL to pi_ref, losses) or skipped minibatches;
2. reward hacking: the score rises while the KL to pi_ref runs away, i.e. the policy buys reward by leaving the
   reference model far behind instead of by answering better (Ziegler et al. 2019, section 3; Gao et al. 2022,
   "Scaling laws for reward model overoptimization"; the reason PPO-RLHF has a KL penalty at all);
3. responses collapsing: in length (towards empty answers), running to ``max_new_tokens`` (EOS no longer sampled),
   or in diversity (the per-token entropy falls to a small fraction of its start: one answer for every prompt);
4. groups with zero reward variance (GRPO): every completion of a prompt scored the same, so the group-normalised
   advantage is 0 and the loss is 0 (trl#3857);
5. KL to pi_old blown (approx KL > the schema's ``KL_ALERT``) and 6. clip fraction sustained above
   ``CLIPFRAC_HIGH``: the Gymnasium doctor's own rules (``doctor_rules``), one verdict for both kinds of run;
7. the policy not moving (clip fraction ~0 and approx KL negligible all run) and 8. the score flat.

A DPO run has no reward (it learns from preference pairs): it is judged by its preference accuracy, and none of
the reward-based rules (2-4, and the flat score's "check that the reward can vary") applies to it. A run of fewer
than ``MIN_UPDATES_TO_JUDGE`` iterations is "too short to judge", and an unreadable ``trainer_state.pt`` a finding
of its own, as in the Gymnasium doctor.

Notes, which never make a run unhealthy: approx KL at the warn level on some iterations, an unsafe config,
monitoring switched off (the Gymnasium doctor's notes), and groups with zero reward variance once the score rose.

The LM thresholds below are stated per sequence or as fractions of the run's own first quarter; the trust-region
ones (approx KL, clip fraction, entropy collapse) are the schema's.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from ppokit.analysis.diagnosis import Diagnosis, RunData, checkpoint_finding, healthy_note, too_short
from ppokit.analysis.doctor_rules import (
    Finding,
    RuleContext,
    _rule_clipfrac_high,
    _rule_kl_blowup,
    _rule_kl_high,
    _rule_monitoring_off,
    _rule_unsafe,
    fin,
    quarters,
    trend,
)
from ppokit.core import schema as S
from ppokit.diagnostics.monitor import longest_run

__all__ = ["is_lm_run", "is_dpo_run", "diagnose_lm", "LM_CURVES", "lm_curves", "KL_REF_RUNAWAY", "KL_REF_GROWTH"]

SCORE = S.SCORE_MEAN
KL_REF = S.KL_REF
RESPONSE_LENGTH = S.RESPONSE_LENGTH
EOS_FRAC = S.EOS_FRAC
ZERO_STD = S.FRAC_REWARD_ZERO_STD
DISTINCT = S.DISTINCT_FRAC
DPO_ACCURACY = S.DPO_PREF_ACCURACY
KL_COEF = S.KL_COEF
LM_META = "lm_run.json"  # what an LM trainer writes into its run directory: {"kind", "algo", "config"}

KL_REF_RUNAWAY = S.KL_REF_RUNAWAY  # shared with the live alerts (lm.alerts)
# ... and "runs away" = still climbing at the end: the last quarter's mean is this many times the second quarter's.
KL_REF_GROWTH = 1.5
KL_REF_BUDGET = 6.0  # with no KL penalty at all (kl_coef / beta 0), a KL past this is already a runaway
LENGTH_COLLAPSE_FRAC = 0.5  # last-quarter mean response length below this fraction of the first quarter's
LENGTH_COLLAPSE_TOKENS = 2.0  # ... or below this many tokens
EOS_LOST = 0.1  # EOS fraction below this in the last quarter (after >= 0.5 in the first): responses run to the cap
ZERO_STD_FRAC = S.ZERO_STD_FRAC
DISTINCT_COLLAPSE = 0.05  # distinct completions below 5% of a rollout's (~3 of 64): one answer for everything
SCORE_RISE_MIN = 0.05  # a rise of the score smaller than this (and than one std of the first quarter) is flat

# (column, title, y label) of the report's LM curves, x axis: iteration.
LM_CURVES = (
    (SCORE, "Score (reward) mean", "score"),
    (KL_REF, "KL to pi_ref per sequence", "nats"),
    (S.APPROX_KL, "Approx KL to pi_old (k3)", "KL"),
    (S.CLIPFRAC, "Clip fraction", "fraction"),
    (RESPONSE_LENGTH, "Response length", "tokens"),
    (EOS_FRAC, "EOS fraction", "fraction"),
    (S.ENTROPY, "Per-token entropy", "nats"),
    (ZERO_STD, "Groups with zero reward std", "fraction"),
    (DPO_ACCURACY, "DPO preference accuracy (the step's pairs)", "accuracy"),
    (S.DPO_REWARD_MARGIN, "DPO implicit reward margin (chosen - rejected)", "margin"),
    (S.POLICY_LOSS, "Policy loss", "loss"),
)


def lm_curves(run: RunData) -> tuple[tuple[str, str, str], ...]:
    """The ``LM_CURVES`` this run logged (a GRPO run has no DPO accuracy, a DPO run no score)."""
    return tuple(c for c in LM_CURVES if fin(run.col(c[0])))


def is_lm_run(run: RunData) -> bool:
    """A ``ppokit.lm`` run: it has ``lm_run.json``, or its metrics have the score, KL-to-reference or DPO column."""
    return ((run.run_dir / LM_META).is_file() or SCORE in run.cols or KL_REF in run.cols
            or DPO_ACCURACY in run.cols)


def is_dpo_run(run: RunData) -> bool:
    """A DPO run: its config says so, or it logged the preference accuracy and no score (it has no reward)."""
    return run.config.get("algo") == "dpo" or (DPO_ACCURACY in run.cols and SCORE not in run.cols)


def lm_run_config(run_dir: Path) -> dict:
    """The config an LM trainer wrote into ``lm_run.json`` (its LMConfig fields plus ``algo``), {} when absent or
    unreadable (the doctor reads what is there; it never fails on a damaged file)."""
    path = Path(run_dir) / LM_META
    if not path.is_file():
        return {}
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(meta, dict) or not isinstance(meta.get("config", {}), dict):
        return {}
    return {**meta.get("config", {}), "algo": meta.get("algo", "?")}


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else math.nan


def _quarter_means(run: RunData, name: str) -> tuple[float, float]:
    first, last = quarters(run.col(name))
    return _mean(first), _mean(last)


def _start_len(n: int) -> int:
    """The run's start: its first tenth of iterations (at least one). LM runs move fast (a hacked reward
    saturates within a few iterations), so a first-quarter mean would hide what changed."""
    return max(1, n // 10)


def _start_mean(run: RunData, name: str) -> float:
    values = run.col(name)
    return _mean(fin(values[:_start_len(len(values))]))


def score_trend(run: RunData, column: str = SCORE) -> tuple[bool, str]:
    """``(rising, evidence)``: the last quarter's mean score clearly above the start's (``doctor_rules.trend``:
    the first tenth of the iterations, cut before the first jump, so DPO's accuracy 0 -> 1 at its second step
    is a rise): by more than ``SCORE_RISE_MIN`` (relative to the score's scale) and the curve's noise."""
    t = trend(run.col(column), lambda start: SCORE_RISE_MIN * max(1.0, abs(start)))
    if t is None or not quarters(run.col(column))[1]:
        return False, f"no {column} logged"
    return t.rose, (f"mean {column} {t.start:.4g} in the first {t.start_len} iteration(s) -> {t.end:.4g} in the "
                    "last quarter")


# ---------------------------------------------------------------- rules
def _rule_nonfinite(run: RunData, n: int) -> Finding | None:
    bad = []
    for name in (SCORE, KL_REF, S.POLICY_LOSS, S.VALUE_LOSS, S.APPROX_KL):
        values = run.cols.get(name, [])
        k = sum(1 for v in values if not math.isfinite(v))
        # A column that is empty all run is not measured by this trainer (GRPO has no value loss); the score is.
        if k and (fin(values) or name == SCORE):
            bad.append(f"{name} is NaN/Inf on {k}/{n} iterations")
    skipped = sum(v for v in fin(run.col(S.SKIPPED_MINIBATCHES)) if v > 0)
    if skipped:
        bad.append(f"{int(skipped)} minibatches skipped for a non-finite loss or gradient")
    if not bad:
        return None
    return Finding("nonfinite", "non-finite numbers in the run", bad,
                   "lower learning_rate; check the reward function for NaN/Inf and the model for fp16 overflow")


def _rule_reward_hacking(run: RunData, n: int, rising: bool, trend: str) -> Finding | None:
    kl = run.col(KL_REF)
    if not rising or not fin(kl):
        return None
    q = max(1, n // 4)
    second = _mean(fin(kl[q:2 * q]))
    last = _mean(fin(kl[n - q:]))
    growing = math.isfinite(second) and last > KL_REF_GROWTH * max(second, 1e-8)
    # PPO logs the KL coefficient it used (KL_COEF); GRPO's KL term is beta's.
    knob = "kl_coef" if KL_COEF in run.cols else "beta"
    coef = run.config.get(knob)
    coefs = fin(run.col(KL_COEF))  # it moves with adaptive_kl: the last one used is what anchors the policy now
    unanchored = (coefs[-1] if coefs else coef) == 0
    # Runaway: large and still climbing; or past the usual KL budget with no penalty at all to stop it (a hack
    # that saturates its reward within a few iterations stops climbing, but nothing pulls it back either).
    if last > KL_REF_RUNAWAY and growing:
        how = f"runaway: > {KL_REF_RUNAWAY:g} and still growing x{KL_REF_GROWTH:g}"
    elif unanchored and last > KL_REF_BUDGET:
        how = f"past the usual budget of {KL_REF_BUDGET:g} nats with {knob} = 0: nothing anchors the policy"
    else:
        return None
    return Finding(
        "reward_hacking", "reward hacking: the score rises while the KL to pi_ref runs away",
        [trend, f"KL to pi_ref per sequence {second:.3g} nats in the second quarter -> {last:.3g} in the last "
                f"({how})",
         f"config: {knob} {coef!r}" + (" (no KL anchor at all)" if coef == 0 else "")],
        (f"raise {knob}" + (" from 0" if coef == 0 else "")
         + (", or use adaptive_kl with kl_target ~6" if knob == "kl_coef" else "")
         + "; read sample completions: a reward that rises while answers drift from the reference model is being "
           "gamed (make the reward harder to exploit)"),
        run.updates[n - q:])


def _rule_length(run: RunData, n: int) -> list[Finding]:
    out = []
    a, b = _quarter_means(run, RESPONSE_LENGTH)
    if math.isfinite(a) and math.isfinite(b) and (b < LENGTH_COLLAPSE_FRAC * a or b < LENGTH_COLLAPSE_TOKENS) \
            and a >= LENGTH_COLLAPSE_TOKENS:
        out.append(Finding(
            "length_collapse", "responses collapsed in length",
            [f"mean response length {a:.3g} tokens in the first quarter -> {b:.3g} in the last"],
            "the reward probably favours short answers: add a length floor or penalty to it, raise kl_coef/beta"))
    e0, e1 = _start_mean(run, EOS_FRAC), _quarter_means(run, EOS_FRAC)[1]
    if math.isfinite(e0) and math.isfinite(e1) and e0 >= 0.5 and e1 < EOS_LOST:
        out.append(Finding(
            "eos_lost", "responses no longer end: they run to max_new_tokens",
            [f"EOS fraction {e0:.2f} in the first {_start_len(n)} iteration(s) -> {e1:.2f} in the last quarter"],
            "the reward favours long answers: set missing_eos_penalty, cap the reward's length term, raise "
            "kl_coef/beta"))
    return out


def _rule_diversity(run: RunData, n: int) -> Finding | None:
    ent = fin(run.col(S.ENTROPY))
    frac = S.THRESHOLDS["entropy_collapse_frac"]
    evidence = []
    if len(ent) >= 4:
        first, last = ent[0], _mean(ent[-max(1, len(ent) // 4):])
        if first > 0 and last < frac * first:
            evidence.append(f"entropy {first:.3g} nats/token at the start -> {last:.3g} in the last quarter "
                            f"(collapse: below {frac:g} of the start)")
    d0, d1 = _quarter_means(run, DISTINCT)
    if math.isfinite(d1) and d1 < DISTINCT_COLLAPSE and d0 > 2 * DISTINCT_COLLAPSE:
        evidence.append(f"distinct completions per rollout {d0:.2f} of the completions in the first quarter -> "
                        f"{d1:.3f} in the last (collapse: below {DISTINCT_COLLAPSE:g})")
    if not evidence:
        return None
    return Finding(
        "diversity_collapse", "responses collapsed in diversity: (nearly) one answer for every prompt", evidence,
        "raise kl_coef/beta (the reference model keeps the policy spread), lower learning_rate, or add ent_coef")


def _rule_zero_std(run: RunData, n: int, rising: bool) -> Finding | None:
    col = run.col(ZERO_STD)
    if not fin(col):
        return None
    patience = int(S.THRESHOLDS["reward_patience"])
    best, end = longest_run(col, lambda v: math.isfinite(v) and v >= ZERO_STD_FRAC)
    if best < min(patience, n):
        return None
    us = run.updates[end - best + 1:end + 1]
    evidence = [f"{ZERO_STD} >= {ZERO_STD_FRAC:g} for {best} consecutive iterations ({us[0]}-{us[-1]}), mean "
                f"{_mean(fin(col)):.2f} over the run"]
    if rising:
        # The score rose first: groups whose completions all reach the same (top) reward are a task learned, not
        # a stuck run; said as a note, since the rest of training on those prompts is a no-op.
        return Finding("zero_reward_variance", "many groups have zero reward variance (after the score rose): "
                       "those prompts no longer teach anything", evidence,
                       "harder prompts, or stop here; a loss of 0 on those groups is expected (trl#3857)", us,
                       severity="note")
    return Finding(
        "zero_reward_variance", "groups with zero reward variance: their advantages and loss are 0", evidence,
        "raise group_size or temperature, or make the reward finer-grained (partial credit) so completions of one "
        "prompt can differ; a loss of 0 here is expected, not a bug (trl#3857)", us)


def _rule_not_moving(run: RunData, n: int) -> Finding | None:
    cf, kl = fin(run.col(S.CLIPFRAC)), fin(run.col(S.APPROX_KL))
    if not cf or not kl:
        return None
    if max(cf) < S.CLIPFRAC_NEVER_FIRES and max(abs(x) for x in kl) < S.KL_NEGLIGIBLE:
        return Finding("policy_not_moving", "the policy does not move: clip fraction ~0 and approx KL ~0 all run",
                       [f"max clip fraction {max(cf):.3g}, max approx KL {max(abs(x) for x in kl):.3g}"],
                       "raise learning_rate or update_epochs; check that gradients reach the weights (LoRA target "
                       "modules, frozen parameters)")
    return None


_ORDER = ["nonfinite", "reward_hacking", "length_collapse", "eos_lost", "diversity_collapse", "zero_reward_variance",
          "kl_blowup", "clipfrac_high", "policy_not_moving", "score_flat"]


def diagnose_lm(run: RunData) -> Diagnosis:
    """The LM rules above on ``run``; a ``Diagnosis`` like the Gymnasium doctor's."""

    n = len(run.updates)
    if n == 0:
        f = Finding("no_updates", "the run logged no iteration", ["metrics.csv has no rows"],
                    "let the run finish at least one iteration")
        return Diagnosis(str(run.run_dir), False, [f], [], "no data")
    # DPO has no score (no sampling) and no reward: its progress is the preference accuracy.
    dpo = is_dpo_run(run)
    rising, trend_text = score_trend(run, DPO_ACCURACY if dpo else SCORE)
    findings: list[Finding] = []
    reward_rules = () if dpo else (_rule_reward_hacking(run, n, rising, trend_text), *_rule_length(run, n),
                                   _rule_zero_std(run, n, rising))
    for f in (_rule_nonfinite(run, n), *reward_rules, _rule_diversity(run, n)):
        if f is not None:
            findings.append(f)
    # The trust-region rules are the Gymnasium doctor's own (one verdict, the schema's thresholds).
    context = RuleContext(run, n, not rising, trend_text, None)
    findings += [f for f in (_rule_kl_blowup(context), _rule_clipfrac_high(context)) if f is not None]
    moving = _rule_not_moving(run, n)
    if moving is not None:
        findings.append(moving)
    if not rising and not any(f.severity == "problem" for f in findings):
        what = "preference accuracy" if dpo else "score"
        findings.append(Finding("score_flat", f"the {what} did not improve, with no other symptom", [trend_text],
                                "train longer, raise learning_rate or beta, or check that the chosen and rejected "
                                "responses of a pair differ" if dpo else
                                "train longer, raise learning_rate, or check that the reward can vary"))
    # The Gymnasium doctor's notes (never a problem): KL at the warn level, an unsafe config, monitoring off.
    findings += [f for f in (_rule_kl_high(context), _rule_unsafe(context), _rule_monitoring_off(context))
                 if f is not None]
    findings.sort(key=lambda f: (f.severity != "problem",
                                 _ORDER.index(f.cause) if f.cause in _ORDER else len(_ORDER)))
    unreadable = checkpoint_finding(run)
    if unreadable is not None and not any(f.severity == "problem" for f in findings):
        findings.insert(0, healthy_note(trend_text, checkpoint_ok=False))
    if unreadable is not None:
        findings.insert(sum(f.severity == "problem" for f in findings), unreadable)
    problems = [f for f in findings if f.severity == "problem"]
    healthy = not problems
    if healthy:
        findings.insert(0, healthy_note(trend_text))
        summary = "HEALTHY: no problem found. " + trend_text
    else:
        summary = f"{len(problems)} problem(s) found; fix the first one first: {problems[0].title}"
    return too_short(Diagnosis(str(run.run_dir), healthy, findings, [], summary), n, "iteration")
